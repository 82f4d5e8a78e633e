"""The migrations: the conventions they give a table on PostgreSQL, and that they go both ways."""

from __future__ import annotations

import psycopg
import pytest
from sqlalchemy import String, create_engine, inspect

from mostovik_pipelines.sources import ALL_SOURCES
from mostovik_pipelines.warehouse import migrate
from mostovik_pipelines.warehouse.schema import BOOKKEEPING_COLUMNS
from mostovik_pipelines_tests.support.postgres import dsn_of


def pg_query(url: str, sql: str) -> list[tuple]:
    with psycopg.connect(dsn_of(url)) as connection:
        return connection.execute(sql).fetchall()


@pytest.mark.parametrize("source", ALL_SOURCES, ids=lambda source: source.name)
def test_every_source_table_has_the_conventions_the_loader_relies_on(pg_warehouse_url, source):
    """A migration that creates a target table must apply ``postgresql_conventions``: without
    them a first load fails on NOT NULL bookkeeping, keys sort unlike the loader's rows, and an
    edit by hand goes unnoticed by the next re-load."""
    target = source.load_target
    table = target.table.name
    collations = dict(pg_query(pg_warehouse_url, (
        "SELECT column_name, collation_name FROM information_schema.columns "
        f"WHERE table_name = '{table}' AND collation_name IS NOT NULL")))
    key_text = [k for k in target.natural_key if isinstance(target.table.c[k].type, String)]
    assert all(collations[k] == "C" for k in key_text), collations
    defaults = dict(pg_query(pg_warehouse_url, (
        "SELECT column_name, column_default FROM information_schema.columns "
        f"WHERE table_name = '{table}' AND column_default IS NOT NULL")))
    assert set(BOOKKEEPING_COLUMNS) <= set(defaults), table
    assert "mostovik.run_id" in defaults["loaded_by_run"]
    triggers = pg_query(pg_warehouse_url, (
        f"SELECT tgname FROM pg_trigger WHERE tgrelid = '{table}'::regclass AND NOT tgisinternal"))
    assert triggers == [(f"{table}_written_outside_loader",)]
    indexed = pg_query(pg_warehouse_url, (
        f"SELECT indexname FROM pg_indexes WHERE tablename = '{table}' "
        "AND indexdef LIKE '%(changed_by_run, changed_at)'"))
    assert indexed == [(f"ix_{table}_changed_by_run",)], (
        "the rows_in_partition check looks rows up by the run that changed them and when")


def test_the_ledger_migration_goes_down_and_up_again(warehouse_url):
    migrate.downgrade(warehouse_url, "0002")
    engine = create_engine(warehouse_url)
    assert not inspect(engine).has_table("partition_loads")
    engine.dispose()
    migrate.upgrade(warehouse_url)
    engine = create_engine(warehouse_url)
    assert inspect(engine).has_table("partition_loads")
    engine.dispose()
    assert migrate.current_revision(warehouse_url) == migrate.head_revision()


def test_a_migration_makes_every_next_load_compare_the_stored_rows(warehouse_url):
    """A migration may change stored values without the loader: the digests the ledger keeps
    are forgotten by any upgrade or downgrade that changes the schema's revision."""
    from datetime import UTC, datetime

    from mostovik_pipelines.framework.load.ledger import record_load

    engine = create_engine(warehouse_url)
    with engine.begin() as connection:
        record_load(connection, "cbr_daily_rates", "2026-11-05", 43, "d" * 64, "run-1",
                    datetime.now(UTC))
    digests = "SELECT content_digest FROM partition_loads"
    with engine.connect() as connection:
        assert connection.exec_driver_sql(digests).scalars().all() == ["d" * 64]
    migrate.downgrade(warehouse_url, "0006")
    migrate.upgrade(warehouse_url)
    with engine.connect() as connection:
        assert connection.exec_driver_sql(digests).scalars().all() == [None]
    engine.dispose()
