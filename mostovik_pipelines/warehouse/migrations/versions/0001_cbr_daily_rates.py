"""cbr_daily_rates: official CBR exchange rates per date asked for

Frozen history: plain DDL only (exact decimals: NUMERIC, their text on SQLite).

Revision ID: 0001
Revises:
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    exact = sa.Numeric().with_variant(sa.String(), "sqlite")
    op.create_table(
        "cbr_daily_rates",
        sa.Column("partition_date", sa.Date(), nullable=False,
                  comment="date the rates were asked for"),
        sa.Column("rate_date", sa.Date(), nullable=False,
                  comment="date the rates are effective (ValCurs/@Date)"),
        sa.Column("cbr_id", sa.String(16), nullable=False,
                  comment="CBR's own currency id, e.g. R01235"),
        sa.Column("num_code", sa.String(3), nullable=False, comment="ISO 4217 numeric code"),
        sa.Column("char_code", sa.String(3), nullable=False, comment="ISO 4217 letter code"),
        sa.Column("nominal", sa.Integer(), nullable=False,
                  comment="units of the currency the value is for"),
        sa.Column("name", sa.String(255), nullable=False),
        sa.Column("value", exact, nullable=False,
                  comment="roubles per nominal, as published"),
        sa.Column("unit_rate", exact, nullable=False, comment="roubles per one unit"),
        sa.Column("loaded_by_run", sa.String(64), nullable=False,
                  comment="run that inserted the row"),
        sa.Column("loaded_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("changed_by_run", sa.String(64), nullable=False,
                  comment="run that last changed the row's data"),
        sa.Column("changed_at", sa.DateTime(timezone=True), nullable=False),
        sa.UniqueConstraint("partition_date", "char_code",
                            name="uq_cbr_daily_rates_natural_key"),
    )
    op.create_index("ix_cbr_daily_rates_rate_date", "cbr_daily_rates", ["rate_date"])


def downgrade() -> None:
    op.drop_index("ix_cbr_daily_rates_rate_date", table_name="cbr_daily_rates")
    op.drop_table("cbr_daily_rates")
