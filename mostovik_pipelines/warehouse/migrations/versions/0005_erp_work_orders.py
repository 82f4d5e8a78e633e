"""erp_work_orders: work orders synced from the ERP by day of change (merge by version, tombstones
kept); sync_progress: the committed progress of paged partitions

Frozen history: plain DDL only, the PostgreSQL conventions written out as they were on the day
(natural key in the "C" collation, bookkeeping defaults, the trigger that forgets the table's
content digests when anything but the loader writes it; its function exists since 0003).

Revision ID: 0005
Revises: 0004
"""

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

POSTGRESQL_CONVENTIONS = [
    'ALTER TABLE "erp_work_orders" ALTER COLUMN "id" TYPE VARCHAR(64) COLLATE "C"',
    "ALTER TABLE \"erp_work_orders\" ALTER COLUMN loaded_by_run "
    "SET DEFAULT NULLIF(current_setting('mostovik.run_id', true), '')",
    "ALTER TABLE \"erp_work_orders\" ALTER COLUMN changed_by_run "
    "SET DEFAULT NULLIF(current_setting('mostovik.run_id', true), '')",
    'ALTER TABLE "erp_work_orders" ALTER COLUMN loaded_at SET DEFAULT now()',
    'ALTER TABLE "erp_work_orders" ALTER COLUMN changed_at SET DEFAULT now()',
    'CREATE TRIGGER "erp_work_orders_written_outside_loader" AFTER INSERT OR UPDATE OR DELETE '
    'OR TRUNCATE ON "erp_work_orders" FOR EACH STATEMENT '
    "EXECUTE FUNCTION mostovik_forget_partition_digests()",
]


def upgrade() -> None:
    op.create_table(
        "erp_work_orders",
        sa.Column("id", sa.String(64), nullable=False, comment="the ERP's work order id"),
        sa.Column("object_code", sa.String(64), nullable=False,
                  comment="construction site or bridge"),
        sa.Column("title", sa.Text(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False,
                  comment="planned, in_progress, done, cancelled"),
        sa.Column("planned_start", sa.Date(), nullable=True),
        sa.Column("planned_finish", sa.Date(), nullable=True),
        sa.Column("amount", sa.Numeric().with_variant(sa.String(), "sqlite"), nullable=False,
                  comment="roubles, exact"),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("version", sa.BigInteger(), nullable=False, comment="grows with every change"),
        sa.Column("deleted", sa.Boolean(), nullable=False,
                  comment="a tombstone: deleted at the source"),
        sa.Column("window_date", sa.Date(), nullable=False,
                  comment="the sync window (day of updated_at) the record's version came in"),
        sa.Column("loaded_by_run", sa.String(64), nullable=False,
                  comment="run that inserted the row"),
        sa.Column("loaded_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("changed_by_run", sa.String(64), nullable=False,
                  comment="run that last changed the row's data"),
        sa.Column("changed_at", sa.DateTime(timezone=True), nullable=False),
        sa.UniqueConstraint("id", name="uq_erp_work_orders_natural_key"),
    )
    op.create_index("ix_erp_work_orders_window_date", "erp_work_orders", ["window_date"])
    op.create_table(
        "sync_progress",
        sa.Column("source", sa.String(128), nullable=False),
        sa.Column("partition_key", sa.String(255), nullable=False),
        sa.Column("pages_committed", sa.Integer(), nullable=False),
        sa.Column("next_page_token", sa.Text(), nullable=True,
                  comment="the source's token for the next page, while it honours it"),
        sa.Column("resume_after", sa.Text(), nullable=True,
                  comment="JSON sort key of the last committed item: restart point once the "
                          "token has expired"),
        sa.Column("run_id", sa.String(64), nullable=False,
                  comment="run that committed the last page"),
        sa.Column("committed_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("source", "partition_key", name="pk_sync_progress"),
        comment="Progress of paged partitions (sync windows) still being loaded; written in the "
                "transaction of each page's rows, deleted with the last page.",
    )
    if op.get_bind().dialect.name == "postgresql":
        for statement in POSTGRESQL_CONVENTIONS:
            op.execute(statement)


def downgrade() -> None:
    op.drop_table("sync_progress")
    op.drop_index("ix_erp_work_orders_window_date", table_name="erp_work_orders")
    op.drop_table("erp_work_orders")
