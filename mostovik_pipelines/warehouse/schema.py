"""Conventions every warehouse table follows: natural-key uniqueness, load bookkeeping (indexed
by the run that last changed a row, which the rows_in_partition check looks up after every
partition), and the ledger of partition loads.

On PostgreSQL a target table also gets (:func:`postgresql_conventions`, applied by the
migrations and by :func:`warehouse_table` on ``create_all``):

* its natural-key text columns in the ``"C"`` collation: keys are identifiers, compared byte by
  byte, so the unique index is cheaper to maintain, sorts exactly as the loader sends rows, and
  never changes order with an operating-system locale upgrade;
* bookkeeping filled by column defaults from the load transaction's settings
  (``mostovik.run_id``, ``now()``), so a bulk ``COPY`` sends only the source's columns, and an
  insert from outside the loader, which sets no run id, fails on ``NOT NULL``;
* a statement trigger that forgets the table's content digests in :data:`partition_loads`
  whenever anything but the loader writes the table (the loader marks its transactions with
  ``mostovik.loading``), so a re-load compares the real rows again instead of trusting the digest;
  the loader trusts a digest only while that trigger is there and enabled.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from sqlalchemy import (
    DDL,
    BigInteger,
    Column,
    DateTime,
    Index,
    Integer,
    MetaData,
    String,
    Table,
    Text,
    UniqueConstraint,
    event,
)
from sqlalchemy.dialects import postgresql
from sqlalchemy.schema import SchemaItem

metadata = MetaData(
    naming_convention={
        "uq": "uq_%(table_name)s_natural_key",
        "ix": "ix_%(table_name)s_%(column_0_name)s",
        "pk": "pk_%(table_name)s",
    }
)

BOOKKEEPING_COLUMNS = ("loaded_by_run", "loaded_at", "changed_by_run", "changed_at")
RUN_ID_SETTING = "mostovik.run_id"
"""Transaction setting the loader sets to its run id; the bookkeeping defaults read it."""
LOADING_SETTING = "mostovik.loading"
"""Transaction setting that marks a write as the loader's (``on``)."""

partition_loads = Table(
    "partition_loads",
    metadata,
    Column("table_name", String(128), primary_key=True),
    Column("partition_key", String(255), primary_key=True),
    Column("row_count", BigInteger, nullable=False,
           comment="rows the source delivered for the partition at its last load"),
    Column("content_digest", String(64), nullable=True,
           comment="sha256 of those rows as loaded; NULL: unknown, compare the stored rows"),
    Column("loaded_by_run", String(64), nullable=False, comment="run of the last load"),
    Column("loaded_at", DateTime(timezone=True), nullable=False),
    Column("fetched_at", DateTime(timezone=True), nullable=True,
           comment="when the payload of the last load was fetched from the source; a load of "
                   "an older payload is refused as superseded"),
    Column("loaded_partition_key", String(300), nullable=True,
           comment="the partition key of the last load (a day, a file version <name>@<hash>); "
                   "NULL: loaded before it was recorded"),
    Column("payload_hash", String(64), nullable=True,
           comment="sha256 of the landed payload the last load came from (a sync window: of "
                   "its pages' hashes); NULL: loaded before it was recorded"),
    Column("parser_version", String(64), nullable=True,
           comment="digest of the code that parsed and validated the last load's payload; "
                   "NULL: unknown, the next load of the same payload parses it again"),
    comment="The last load of every partition of every target table.",
)


sync_progress = Table(
    "sync_progress",
    metadata,
    Column("source", String(128), primary_key=True),
    Column("partition_key", String(255), primary_key=True),
    Column("pages_committed", Integer, nullable=False),
    Column("next_page_token", Text, nullable=True,
           comment="the source's token for the next page, while it honours it"),
    Column("resume_after", Text, nullable=True,
           comment="JSON sort key of the last committed item: restart point once the token "
                   "has expired"),
    Column("run_id", String(64), nullable=False, comment="run that committed the last page"),
    Column("committed_at", DateTime(timezone=True), nullable=False),
    comment="Progress of paged partitions (sync windows) still being loaded; written in the "
            "transaction of each page's rows, deleted with the last page.",
)


alert_outbox = Table(
    "alert_outbox",
    metadata,
    Column("idempotency_key", String(255), primary_key=True,
           comment="what the alert is about (kind, source, subject): written once, sent once"),
    Column("kind", String(32), nullable=False),
    Column("source", String(128), nullable=True),
    Column("period", String(255), nullable=True),
    Column("body", Text, nullable=False, comment="the alert as posted (JSON)"),
    Column("created_at", DateTime(timezone=True), nullable=False),
    Column("attempts", Integer, nullable=False, comment="deliveries tried so far"),
    Column("next_attempt_at", DateTime(timezone=True), nullable=False,
           comment="not tried again before then (backoff, or a delivery in flight)"),
    Column("sent_at", DateTime(timezone=True), nullable=True,
           comment="when the webhook acknowledged it (2xx); NULL: pending"),
    Column("channel", String(16), nullable=True,
           comment="webhook, or log where no webhook is configured"),
    Column("last_error", Text, nullable=True, comment="why the last delivery failed"),
    Index("ix_alert_outbox_pending", "sent_at", "next_attempt_at"),
    comment="Every alert, written before it is posted and marked sent only once the webhook "
            "acknowledged it: delivered at least once, never lost in a log.",
)


def warehouse_table(name: str, *columns: SchemaItem, natural_key: Sequence[str],
                    in_metadata: MetaData = metadata) -> Table:
    """A target table: the source's columns, a unique constraint on the natural key, and the
    bookkeeping of which run inserted the row and which run last changed it. ``in_metadata``
    is for tables that are not the warehouse's own (tests, benchmarks)."""
    table = Table(
        name,
        in_metadata,
        *columns,
        Column("loaded_by_run", String(64), nullable=False, comment="run that inserted the row"),
        Column("loaded_at", DateTime(timezone=True), nullable=False),
        Column("changed_by_run", String(64), nullable=False,
               comment="run that last changed the row's data"),
        Column("changed_at", DateTime(timezone=True), nullable=False),
        UniqueConstraint(*natural_key),
        # The rows_in_partition check finds the rows a partition's load wrote (the run's,
        # written since the load began) after every partition: without the index, a scan of
        # the whole table each time; on changed_by_run alone, of every row the run wrote so far.
        Index(f"ix_{name}_changed_by_run", "changed_by_run", "changed_at"),
    )
    key_text_columns = {
        key: table.c[key].type.compile(dialect=postgresql.dialect())
        for key in natural_key if isinstance(table.c[key].type, String)
    }
    for statement in postgresql_conventions(name, key_text_columns):
        event.listen(table, "after_create", DDL(statement).execute_if(dialect="postgresql"))
    return table


def data_columns(table: Table) -> list[str]:
    """The columns a source provides (everything but the load bookkeeping)."""
    return [c.name for c in table.columns if c.name not in BOOKKEEPING_COLUMNS]


FORGET_DIGESTS_FUNCTION = "mostovik_forget_partition_digests"
GUARD_TRIGGER_SUFFIX = "_written_outside_loader"


def table_writes_lock_key(name_sql: str) -> str:
    """SQL for the advisory lock key (bigint) that orders a table's loads against writes from
    outside the loader: loads hold it shared, the trigger exclusively (see
    :mod:`mostovik_pipelines.framework.load.ledger`). ``name_sql`` is SQL for the table's name."""
    return f"('x' || substr(md5('mostovik table writes: ' || {name_sql}), 1, 16))::bit(64)::bigint"


def postgresql_conventions(table: str, key_text_columns: Mapping[str, str]) -> list[str]:
    """The PostgreSQL DDL that gives ``table`` the conventions above; ``key_text_columns`` maps
    each natural-key text column to its SQL type (``VARCHAR(3)``). Safe to run again."""
    run_id_default = f"NULLIF(current_setting('{RUN_ID_SETTING}', true), '')"
    return [
        *(f'ALTER TABLE "{table}" ALTER COLUMN "{column}" TYPE {sql_type} COLLATE "C"'
          for column, sql_type in key_text_columns.items()),
        f'ALTER TABLE "{table}" ALTER COLUMN loaded_by_run SET DEFAULT {run_id_default}',
        f'ALTER TABLE "{table}" ALTER COLUMN changed_by_run SET DEFAULT {run_id_default}',
        f'ALTER TABLE "{table}" ALTER COLUMN loaded_at SET DEFAULT now()',
        f'ALTER TABLE "{table}" ALTER COLUMN changed_at SET DEFAULT now()',
        # SECURITY DEFINER: whoever writes the table by hand needs no rights on the ledger.
        f"""CREATE OR REPLACE FUNCTION {FORGET_DIGESTS_FUNCTION}() RETURNS trigger
            LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $body$
            BEGIN
                IF current_setting('{LOADING_SETTING}', true) IS DISTINCT FROM 'on' THEN
                    -- Wait for the loads in flight to commit, and keep new ones waiting until
                    -- this write commits: a load then either sees the write or records its
                    -- digest before the digest is forgotten here.
                    PERFORM pg_advisory_xact_lock({table_writes_lock_key("TG_TABLE_NAME")});
                    EXECUTE 'UPDATE ' || quote_ident(TG_TABLE_SCHEMA) || '.partition_loads '
                        || 'SET content_digest = NULL '
                        || 'WHERE table_name = $1 AND content_digest IS NOT NULL'
                        USING TG_TABLE_NAME;
                END IF;
                RETURN NULL;
            END
            $body$""",
        f'DROP TRIGGER IF EXISTS "{table}{GUARD_TRIGGER_SUFFIX}" ON "{table}"',
        f'CREATE TRIGGER "{table}{GUARD_TRIGGER_SUFFIX}" '
        f'AFTER INSERT OR UPDATE OR DELETE OR TRUNCATE ON "{table}" '
        f"FOR EACH STATEMENT EXECUTE FUNCTION {FORGET_DIGESTS_FUNCTION}()",
    ]
