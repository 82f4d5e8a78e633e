"""partition_loads.loaded_partition_key and payload_hash: which partition key and which landed
payload a partition's last load came from, so that the ledger alone can name every loaded
partition to the job tracker (a file version, not only its file name) and the payload a
verification re-reads

Revision ID: 0009
Revises: 0008
"""

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("partition_loads", sa.Column(
        "loaded_partition_key", sa.String(300), nullable=True,
        comment="the partition key of the last load (a day, a file version <name>@<hash>); "
                "NULL: loaded before it was recorded"))
    op.add_column("partition_loads", sa.Column(
        "payload_hash", sa.String(64), nullable=True,
        comment="sha256 of the landed payload the last load came from (a sync window: of its "
                "pages' hashes); NULL: loaded before it was recorded"))


def downgrade() -> None:
    with op.batch_alter_table("partition_loads") as table:
        table.drop_column("payload_hash")
        table.drop_column("loaded_partition_key")
