"""partition_loads: the ledger of partition loads; cbr_daily_rates gets the PostgreSQL
conventions (natural key in the "C" collation, bookkeeping defaults, the trigger that forgets
content digests when anything but the loader writes the table)

Frozen history: plain DDL only, the conventions written out as they were on the day.

Revision ID: 0003
Revises: 0002
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

POSTGRESQL_CONVENTIONS = [
    'ALTER TABLE "cbr_daily_rates" ALTER COLUMN "char_code" TYPE VARCHAR(3) COLLATE "C"',
    "ALTER TABLE \"cbr_daily_rates\" ALTER COLUMN loaded_by_run "
    "SET DEFAULT NULLIF(current_setting('mostovik.run_id', true), '')",
    "ALTER TABLE \"cbr_daily_rates\" ALTER COLUMN changed_by_run "
    "SET DEFAULT NULLIF(current_setting('mostovik.run_id', true), '')",
    'ALTER TABLE "cbr_daily_rates" ALTER COLUMN loaded_at SET DEFAULT now()',
    'ALTER TABLE "cbr_daily_rates" ALTER COLUMN changed_at SET DEFAULT now()',
    # SECURITY DEFINER: whoever writes a table by hand needs no rights on the ledger.
    """CREATE OR REPLACE FUNCTION mostovik_forget_partition_digests() RETURNS trigger
            LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $body$
            BEGIN
                IF current_setting('mostovik.loading', true) IS DISTINCT FROM 'on' THEN
                    -- Wait for the loads in flight to commit, and keep new ones waiting until
                    -- this write commits: a load then either sees the write or records its
                    -- digest before the digest is forgotten here.
                    PERFORM pg_advisory_xact_lock(('x' || substr(md5('mostovik table writes: '
                        || TG_TABLE_NAME), 1, 16))::bit(64)::bigint);
                    EXECUTE 'UPDATE ' || quote_ident(TG_TABLE_SCHEMA) || '.partition_loads '
                        || 'SET content_digest = NULL '
                        || 'WHERE table_name = $1 AND content_digest IS NOT NULL'
                        USING TG_TABLE_NAME;
                END IF;
                RETURN NULL;
            END
            $body$""",
    'DROP TRIGGER IF EXISTS "cbr_daily_rates_written_outside_loader" ON "cbr_daily_rates"',
    'CREATE TRIGGER "cbr_daily_rates_written_outside_loader" AFTER INSERT OR UPDATE OR DELETE '
    'OR TRUNCATE ON "cbr_daily_rates" FOR EACH STATEMENT '
    "EXECUTE FUNCTION mostovik_forget_partition_digests()",
]


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
        for statement in POSTGRESQL_CONVENTIONS:
            op.execute(statement)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute('DROP TRIGGER IF EXISTS "cbr_daily_rates_written_outside_loader" '
                   'ON cbr_daily_rates')
        op.execute("DROP FUNCTION IF EXISTS mostovik_forget_partition_digests()")
        for column in ("loaded_by_run", "loaded_at", "changed_by_run", "changed_at"):
            op.execute(f"ALTER TABLE cbr_daily_rates ALTER COLUMN {column} DROP DEFAULT")
        op.execute('ALTER TABLE cbr_daily_rates ALTER COLUMN char_code TYPE VARCHAR(3) '
                   'COLLATE "default"')
    op.drop_table("partition_loads")
