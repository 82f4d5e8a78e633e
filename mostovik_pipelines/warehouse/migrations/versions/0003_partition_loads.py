"""partition_loads: the ledger of partition loads; cbr_daily_rates gets the PostgreSQL
conventions (natural key in the "C" collation, bookkeeping defaults, the trigger that forgets
content digests when anything but the loader writes the table)

Revision ID: 0003
Revises: 0002
"""

import sqlalchemy as sa
from alembic import op

from mostovik_pipelines.warehouse.schema import FORGET_DIGESTS_FUNCTION, postgresql_conventions

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "partition_loads",
        sa.Column("table_name", sa.String(128), nullable=False),
        sa.Column("partition_key", sa.String(255), nullable=False),
        sa.Column("row_count", sa.BigInteger(), nullable=False,
                  comment="rows the source delivered for the partition at its last load"),
        sa.Column("content_digest", sa.String(64), nullable=True,
                  comment="sha256 of those rows as loaded; NULL: unknown, compare the stored rows"),
        sa.Column("loaded_by_run", sa.String(64), nullable=False, comment="run of the last load"),
        sa.Column("loaded_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("table_name", "partition_key", name="pk_partition_loads"),
        comment="The last load of every partition of every target table.",
    )
    if op.get_bind().dialect.name == "postgresql":
        for statement in postgresql_conventions("cbr_daily_rates", {"char_code": "VARCHAR(3)"}):
            op.execute(statement)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute('DROP TRIGGER IF EXISTS "cbr_daily_rates_written_outside_loader" '
                   'ON cbr_daily_rates')
        op.execute(f"DROP FUNCTION IF EXISTS {FORGET_DIGESTS_FUNCTION}()")
        for column in ("loaded_by_run", "loaded_at", "changed_by_run", "changed_at"):
            op.execute(f"ALTER TABLE cbr_daily_rates ALTER COLUMN {column} DROP DEFAULT")
        op.execute('ALTER TABLE cbr_daily_rates ALTER COLUMN char_code TYPE VARCHAR(3) '
                   'COLLATE "default"')
    op.drop_table("partition_loads")
