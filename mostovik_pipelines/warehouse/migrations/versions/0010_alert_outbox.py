"""alert_outbox: every alert is a row before it is posted, marked sent only once the webhook
acknowledged it, so a webhook away for an hour loses none and a retried one doubles none

Revision ID: 0010
Revises: 0009
"""

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "alert_outbox",
        sa.Column("idempotency_key", sa.String(255), nullable=False,
                  comment="what the alert is about (kind, source, subject): written once, sent "
                          "once"),
        sa.Column("kind", sa.String(32), nullable=False),
        sa.Column("source", sa.String(128), nullable=True),
        sa.Column("period", sa.String(255), nullable=True),
        sa.Column("body", sa.Text(), nullable=False, comment="the alert as posted (JSON)"),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False,
                  comment="deliveries tried so far"),
        sa.Column("next_attempt_at", sa.DateTime(timezone=True), nullable=False,
                  comment="not tried again before then (backoff, or a delivery in flight)"),
        sa.Column("sent_at", sa.DateTime(timezone=True), nullable=True,
                  comment="when the webhook acknowledged it (2xx); NULL: pending"),
        sa.Column("channel", sa.String(16), nullable=True,
                  comment="webhook, or log where no webhook is configured"),
        sa.Column("last_error", sa.Text(), nullable=True,
                  comment="why the last delivery failed"),
        sa.PrimaryKeyConstraint("idempotency_key", name="pk_alert_outbox"),
        comment="Every alert, written before it is posted and marked sent only once the "
                "webhook acknowledged it: delivered at least once, never lost in a log.",
    )
    op.create_index("ix_alert_outbox_pending", "alert_outbox", ["sent_at", "next_attempt_at"])


def downgrade() -> None:
    op.drop_index("ix_alert_outbox_pending", table_name="alert_outbox")
    op.drop_table("alert_outbox")
