"""partition_loads.parser_version: the code that parsed and validated a partition's last load,
so that a re-load of the same landed payload by the same code, whose stored rows the ledger's
digest still vouches for, is not made into rows and compared again

Revision ID: 0011
Revises: 0010
"""

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("partition_loads", sa.Column(
        "parser_version", sa.String(64), nullable=True,
        comment="digest of the code that parsed and validated the last load's payload; NULL: "
                "unknown, the next load of the same payload parses it again"))


def downgrade() -> None:
    with op.batch_alter_table("partition_loads") as table:
        table.drop_column("parser_version")
