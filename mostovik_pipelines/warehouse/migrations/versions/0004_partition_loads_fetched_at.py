"""partition_loads.fetched_at: when the payload of a partition's last load was fetched, so that a
load of an older payload (a replayed run output, a slow duplicate) is refused as superseded

Revision ID: 0004
Revises: 0003
"""

import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("partition_loads", sa.Column(
        "fetched_at", sa.DateTime(timezone=True), nullable=True,
        comment="when the payload of the last load was fetched from the source; a load of an "
                "older payload is refused as superseded"))


def downgrade() -> None:
    with op.batch_alter_table("partition_loads") as table:
        table.drop_column("fetched_at")
