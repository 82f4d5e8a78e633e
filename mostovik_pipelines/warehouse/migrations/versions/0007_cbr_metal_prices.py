"""cbr_metal_prices: Central Bank of Russia prices of precious metals: gold, silver, platinum and
palladium in roubles per gram, one daily partition per day (a parser job)

Frozen history: plain DDL only, written by `mostovik new-source` from the declared table, the
PostgreSQL conventions written out as they were on the day (natural key text in the "C" collation,
bookkeeping defaults, the trigger that forgets the table's content digests when anything but the
loader writes it; its function exists since 0003).

Revision ID: 0007
Revises: 0006
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

POSTGRESQL_CONVENTIONS = [
    'ALTER TABLE "cbr_metal_prices" ALTER COLUMN loaded_by_run SET DEFAULT '
    "NULLIF(current_setting('mostovik.run_id', true), '')",
    'ALTER TABLE "cbr_metal_prices" ALTER COLUMN changed_by_run SET DEFAULT '
    "NULLIF(current_setting('mostovik.run_id', true), '')",
    'ALTER TABLE "cbr_metal_prices" ALTER COLUMN loaded_at SET DEFAULT now()',
    'ALTER TABLE "cbr_metal_prices" ALTER COLUMN changed_at SET DEFAULT now()',
    'CREATE TRIGGER "cbr_metal_prices_written_outside_loader" AFTER INSERT OR UPDATE OR DELETE '
    'OR TRUNCATE ON "cbr_metal_prices" FOR EACH STATEMENT EXECUTE FUNCTION '
    "mostovik_forget_partition_digests()",
]


def upgrade() -> None:
    exact = sa.Numeric().with_variant(sa.String(), "sqlite")
    op.create_table(
        "cbr_metal_prices",
        sa.Column("price_date", sa.Date(), nullable=False,
                  comment="the day the prices are set for (Record/@Date)"),
        sa.Column("metal_code", sa.Integer(), nullable=False,
                  comment="1 gold, 2 silver, 3 platinum, 4 palladium"),
        sa.Column("buy", exact, nullable=False, comment="roubles per gram, as published"),
        sa.Column("sell", exact, nullable=False, comment="roubles per gram, as published"),
        sa.Column("loaded_by_run", sa.String(length=64), nullable=False,
                  comment="run that inserted the row"),
        sa.Column("loaded_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("changed_by_run", sa.String(length=64), nullable=False,
                  comment="run that last changed the row's data"),
        sa.Column("changed_at", sa.DateTime(timezone=True), nullable=False),
        sa.UniqueConstraint("price_date", "metal_code", name="uq_cbr_metal_prices_natural_key"),
    )
    if op.get_bind().dialect.name == "postgresql":
        for statement in POSTGRESQL_CONVENTIONS:
            op.execute(statement)


def downgrade() -> None:
    op.drop_table("cbr_metal_prices")
