"""The migrations: the conventions they give a table on PostgreSQL, and that they go both ways."""

from __future__ import annotations

import psycopg
import pytest
from sqlalchemy import create_engine, inspect
from sqlalchemy.engine import make_url

from mostovik_pipelines.sources import ALL_SOURCES
from mostovik_pipelines.warehouse import migrate
from mostovik_pipelines.warehouse.schema import BOOKKEEPING_COLUMNS


def pg_query(url: str, sql: str) -> list[tuple]:
    parsed = make_url(url)
    with psycopg.connect(host=parsed.host, port=parsed.port, user=parsed.username,
                         password=parsed.password, dbname=parsed.database) as connection:
        return connection.execute(sql).fetchall()


@pytest.mark.parametrize("source", ALL_SOURCES, ids=lambda source: source.name)
def test_every_source_table_has_the_conventions_the_loader_relies_on(pg_warehouse_url, source):
    """A migration that creates a target table must apply ``postgresql_conventions``: without
    them a first load fails on NOT NULL bookkeeping, and without the trigger an edit by hand
    would go unnoticed by the next re-load."""
    table = source.load_target.table.name
    defaults = dict(pg_query(pg_warehouse_url, (
        "SELECT column_name, column_default FROM information_schema.columns "
        f"WHERE table_name = '{table}' AND column_default IS NOT NULL")))
    assert set(BOOKKEEPING_COLUMNS) <= set(defaults), table
    triggers = pg_query(pg_warehouse_url, (
        f"SELECT tgname FROM pg_trigger WHERE tgrelid = '{table}'::regclass AND NOT tgisinternal"))
    assert (f"{table}_written_outside_loader",) in triggers


def test_a_target_table_gets_the_postgresql_conventions(pg_warehouse_url):
    collations = dict(pg_query(pg_warehouse_url, (
        "SELECT column_name, collation_name FROM information_schema.columns "
        "WHERE table_name = 'cbr_daily_rates' AND data_type = 'character varying'")))
    assert collations["char_code"] == "C"
    defaults = dict(pg_query(pg_warehouse_url, (
        "SELECT column_name, column_default FROM information_schema.columns "
        "WHERE table_name = 'cbr_daily_rates' AND column_default IS NOT NULL")))
    assert set(defaults) == {"loaded_by_run", "loaded_at", "changed_by_run", "changed_at"}
    assert "mostovik.run_id" in defaults["loaded_by_run"]
    triggers = pg_query(pg_warehouse_url, (
        "SELECT tgname FROM pg_trigger WHERE tgrelid = 'cbr_daily_rates'::regclass "
        "AND NOT tgisinternal"))
    assert triggers == [("cbr_daily_rates_written_outside_loader",)]


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
