"""material_deliveries: waybill lines of the delivery reports dropped into the inbox, one file
version a partition, a file's rows replaced by its newer version

Frozen history: plain DDL only, the PostgreSQL conventions written out as they were on the day
(natural key text in the "C" collation, bookkeeping defaults, the trigger that forgets the
table's content digests when anything but the loader writes it; its function exists since 0003).

Revision ID: 0006
Revises: 0005
"""

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"
branch_labels = None
depends_on = None

POSTGRESQL_CONVENTIONS = [
    'ALTER TABLE "material_deliveries" ALTER COLUMN "waybill" TYPE VARCHAR(64) COLLATE "C"',
    "ALTER TABLE \"material_deliveries\" ALTER COLUMN loaded_by_run "
    "SET DEFAULT NULLIF(current_setting('mostovik.run_id', true), '')",
    "ALTER TABLE \"material_deliveries\" ALTER COLUMN changed_by_run "
    "SET DEFAULT NULLIF(current_setting('mostovik.run_id', true), '')",
    'ALTER TABLE "material_deliveries" ALTER COLUMN loaded_at SET DEFAULT now()',
    'ALTER TABLE "material_deliveries" ALTER COLUMN changed_at SET DEFAULT now()',
    'CREATE TRIGGER "material_deliveries_written_outside_loader" AFTER INSERT OR UPDATE OR '
    'DELETE OR TRUNCATE ON "material_deliveries" FOR EACH STATEMENT '
    "EXECUTE FUNCTION mostovik_forget_partition_digests()",
]


def upgrade() -> None:
    exact = sa.Numeric().with_variant(sa.String(), "sqlite")
    op.create_table(
        "material_deliveries",
        sa.Column("delivery_date", sa.Date(), nullable=False),
        sa.Column("object_code", sa.String(64), nullable=False,
                  comment="construction site or bridge"),
        sa.Column("waybill", sa.String(64), nullable=False,
                  comment="waybill number as written (leading zeros kept)"),
        sa.Column("line_no", sa.Integer(), nullable=False, comment="line of the waybill"),
        sa.Column("material", sa.String(500), nullable=False),
        sa.Column("unit", sa.String(32), nullable=False),
        sa.Column("quantity", exact, nullable=False, comment="exact, as reported"),
        sa.Column("price", exact, nullable=False, comment="roubles per unit, exact"),
        sa.Column("supplier", sa.String(500), nullable=False),
        sa.Column("source_file", sa.String(255), nullable=False,
                  comment="the report's file name as it was in the inbox"),
        sa.Column("file_version", sa.String(300), nullable=False,
                  comment="<file name>@<content hash>: the version the row came from"),
        sa.Column("loaded_by_run", sa.String(64), nullable=False,
                  comment="run that inserted the row"),
        sa.Column("loaded_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("changed_by_run", sa.String(64), nullable=False,
                  comment="run that last changed the row's data"),
        sa.Column("changed_at", sa.DateTime(timezone=True), nullable=False),
        sa.UniqueConstraint("waybill", "line_no", name="uq_material_deliveries_natural_key"),
    )
    op.create_index("ix_material_deliveries_source_file", "material_deliveries", ["source_file"])
    if op.get_bind().dialect.name == "postgresql":
        for statement in POSTGRESQL_CONVENTIONS:
            op.execute(statement)


def downgrade() -> None:
    op.drop_index("ix_material_deliveries_source_file", table_name="material_deliveries")
    op.drop_table("material_deliveries")
