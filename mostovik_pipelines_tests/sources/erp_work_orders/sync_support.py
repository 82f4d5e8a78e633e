"""What the ERP sync tests start, hold and compare: the table against the stand-in's records of
the same windows, a ``dagster job execute`` sync in a session of its own, a page's commit held at
a lock, and what a sync recorded (its committed pages, its retries, the instance's runs)."""

from __future__ import annotations

import contextlib
import json
import subprocess
from datetime import date, datetime
from decimal import Decimal

import psycopg
from dagster import DagsterEventType, DagsterInstance, EventRecordsFilter

from mostovik_pipelines.core.retries import RETRY_METADATA_KEY
from mostovik_pipelines.sources import erp_work_orders
from mostovik_pipelines_tests.support.postgres import backend_waiting_on_a_lock, dsn_of
from mostovik_pipelines_tests.support.processes import DAGSTER
from mostovik_pipelines_tests.support.warehouse import table_rows

COMPARED = ("id", "object_code", "title", "status", "planned_start", "planned_finish", "amount",
            "version", "deleted")


def source_state(standin, days) -> dict[str, dict]:
    items = {}
    for day in days:
        start, end = erp_work_orders.window_bounds(day)
        for item in standin.erp_window_state(start.isoformat(), end.isoformat()):
            items[item["id"]] = item
    return items


def stored_by_id(url: str) -> dict[str, dict]:
    return {row["id"]: row for row in table_rows(url, "erp_work_orders")}


def same_record(row: dict, item: dict) -> bool:
    expected = {**item, "amount": Decimal(item["amount"]),
                "planned_start": item["planned_start"] and date.fromisoformat(
                    item["planned_start"]),
                "planned_finish": item["planned_finish"] and date.fromisoformat(
                    item["planned_finish"])}
    actual = {**row, "amount": Decimal(str(row["amount"]))}
    return all(actual[k] == expected[k] for k in COMPARED)


def assert_equals_source(url: str, standin, days) -> None:
    table, oracle = stored_by_id(url), source_state(standin, days)
    assert set(table) == set(oracle), (set(table) ^ set(oracle))
    different = [i for i in oracle if not same_record(table[i], oracle[i])]
    assert not different, [(table[i], oracle[i]) for i in different[:3]]


def instant_between(earlier: dict, later: dict) -> str:
    """The instant halfway between two items' ``updated_at``."""
    start = datetime.fromisoformat(earlier["updated_at"])
    return (start + (datetime.fromisoformat(later["updated_at"]) - start) / 2).isoformat()


HOLD_LOCK_KEY = 4_242_004
"""The advisory lock a held page commit waits for (one 64-bit key: not the two-key space of
the partition locks)."""


@contextlib.contextmanager
def page_commit_held(url: str, page: int):
    """Hold the transaction that commits page ``page`` of any sync, as it records its progress
    (its rows written, not committed), for as long as the block runs or the server lives: a
    trigger on ``sync_progress`` waits for an advisory lock this block holds."""
    with psycopg.connect(dsn_of(url), autocommit=True) as connection:
        connection.execute(f"""
            CREATE FUNCTION hold_page_commit() RETURNS trigger LANGUAGE plpgsql AS $$
            BEGIN PERFORM pg_advisory_xact_lock({HOLD_LOCK_KEY}); RETURN NEW; END $$""")
        connection.execute(f"""
            CREATE TRIGGER hold_page_commit BEFORE INSERT OR UPDATE ON sync_progress
            FOR EACH ROW WHEN (NEW.pages_committed = {page})
            EXECUTE FUNCTION hold_page_commit()""")
        connection.execute("SELECT pg_advisory_lock(%s)", (HOLD_LOCK_KEY,))
        yield


def a_commit_waits_for_the_hold(url: str, process) -> bool:
    assert process.poll() is None, process.stdout.read()[-3000:]
    with psycopg.connect(dsn_of(url), autocommit=True) as observer:
        return backend_waiting_on_a_lock(observer, "%sync_progress%", timeout=0.2) is not None



def retry_records(instance: DagsterInstance) -> list[dict]:
    return [record.event_log_entry.asset_observation.metadata[RETRY_METADATA_KEY].value
            for record in instance.get_event_records(EventRecordsFilter(
                DagsterEventType.ASSET_OBSERVATION))
            if RETRY_METADATA_KEY in record.event_log_entry.asset_observation.metadata]


def instance_runs(env: dict) -> list[str]:
    """The ids of the runs in the instance of ``env``, newest first."""
    with DagsterInstance.from_config(env["DAGSTER_HOME"]) as instance:
        return [run.run_id for run in instance.get_runs()]


def start_sync(day: str, env: dict, cwd) -> subprocess.Popen:
    return subprocess.Popen(
        [DAGSTER, "job", "execute", "-m", "mostovik_pipelines", "-j", "erp_work_orders_job",
         "--tags", json.dumps({"dagster/partition": day})],
        env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)


def committed_pages(url: str, day: str) -> int | None:
    with psycopg.connect(dsn_of(url)) as connection:
        row = connection.execute(
            "SELECT pages_committed FROM sync_progress WHERE source = 'erp_work_orders' "
            "AND partition_key = %s", (day,)).fetchone()
    return row[0] if row else None

