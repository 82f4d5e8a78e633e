"""quarantined_rows: rows a source sent that could not be loaded, with the reason

Revision ID: 0002
Revises: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "quarantined_rows",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("source", sa.String(128), nullable=False),
        sa.Column("partition_key", sa.String(255), nullable=False),
        sa.Column("run_id", sa.String(64), nullable=False, comment="run that rejected the row"),
        sa.Column("row_number", sa.Integer(), nullable=False,
                  comment="1-based position in the payload"),
        sa.Column("raw_row", sa.Text(), nullable=False, comment="the row as the source sent it"),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("quarantined_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_index("ix_quarantined_rows_source_partition", "quarantined_rows",
                    ["source", "partition_key"])
    op.create_index("ix_quarantined_rows_run_id", "quarantined_rows", ["run_id"])


def downgrade() -> None:
    op.drop_table("quarantined_rows")
