"""partition_loads.parser_version, and every source table's changed_by_run index ordered by
changed_at too

The ledger names the code that parsed and validated a partition's last load: a re-load of the
same landed payload by the same code, whose stored rows the ledger's digest still vouches for,
is not made into rows and compared again. The index on (changed_by_run, changed_at) lets the
rows_in_partition check read only the rows the partition's own load wrote (the run's, written
since its load began): on changed_by_run alone it read every row the run had written so far,
after every partition, which grew with a ranged run (quadratic over five years). Rebuilding the
index holds writes to its table until it is built (seconds for a million rows).

Revision ID: 0011
Revises: 0010
"""

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

TABLES = ("cbr_daily_rates", "erp_work_orders", "material_deliveries", "cbr_metal_prices")


def upgrade() -> None:
    op.add_column("partition_loads", sa.Column(
        "parser_version", sa.String(64), nullable=True,
        comment="digest of the code that parsed and validated the last load's payload; NULL: "
                "unknown, the next load of the same payload parses it again"))
    for table in TABLES:
        op.drop_index(f"ix_{table}_changed_by_run", table_name=table)
        op.create_index(f"ix_{table}_changed_by_run", table, ["changed_by_run", "changed_at"])


def downgrade() -> None:
    for table in reversed(TABLES):
        op.drop_index(f"ix_{table}_changed_by_run", table_name=table)
        op.create_index(f"ix_{table}_changed_by_run", table, ["changed_by_run"])
    with op.batch_alter_table("partition_loads") as table:
        table.drop_column("parser_version")
