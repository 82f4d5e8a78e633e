"""The ledger of partition loads: an identical re-load trusts the recorded digest, and every
write that did not come from the loader makes the next re-load compare the real rows again."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from datetime import date
from decimal import Decimal
from pathlib import Path

import pandas as pd
import psycopg
import pytest
from sqlalchemy import Column, Date, Integer, MetaData, String, create_engine, select
from sqlalchemy.engine import make_url

from mostovik_pipelines.core.load_target import LoadMode, LoadTarget
from mostovik_pipelines.framework.load import partition
from mostovik_pipelines.framework.load.partition import load_partition
from mostovik_pipelines.resources.warehouse import warehouse_engine
from mostovik_pipelines.warehouse.schema import partition_loads, warehouse_table
from mostovik_pipelines_tests.framework.load.test_partition import DAY, load, rates
from mostovik_pipelines_tests.support.postgres import backend_waiting_on_a_lock, dsn_of
from mostovik_pipelines_tests.support.warehouse import (
    create_tables,
    physical_snapshot,
    table_rows,
)

MOSTOVIK = str(Path(sys.executable).parent / "mostovik")


def ledger(url: str) -> dict[tuple[str, str], dict]:
    engine = create_engine(url)
    try:
        with engine.connect() as connection:
            return {(r.table_name, r.partition_key): dict(r._mapping)
                    for r in connection.execute(select(partition_loads))}
    finally:
        engine.dispose()


def operator_sql(url: str, sql: str) -> None:
    """What an operator does by hand in psql: outside the loader."""
    with psycopg.connect(dsn_of(url), autocommit=True) as connection:
        connection.execute(sql)


def test_every_load_records_the_partition_and_a_digest_only_where_writes_are_guarded(
    warehouse_url
):
    load(warehouse_url, rates(), "run-1")
    recorded = ledger(warehouse_url)[("cbr_daily_rates", DAY.isoformat())]
    assert (recorded["row_count"], recorded["loaded_by_run"]) == (3, "run-1")
    if warehouse_url.startswith("postgresql"):
        assert len(recorded["content_digest"]) == 64
    else:
        assert recorded["content_digest"] is None  # SQLite: no trigger, so always compare


def test_an_identical_reload_trusts_the_digest_and_writes_nothing(pg_warehouse_url):
    load(pg_warehouse_url, rates(), "run-1")
    before = physical_snapshot(pg_warehouse_url, "cbr_daily_rates")
    recorded = ledger(pg_warehouse_url)
    assert load(pg_warehouse_url, rates(), "run-2").as_dict() == {
        "inserted": 0, "updated": 0, "unchanged": 3, "deleted": 0}
    assert physical_snapshot(pg_warehouse_url, "cbr_daily_rates") == before
    assert ledger(pg_warehouse_url) == recorded  # still the load of run-1


@pytest.mark.parametrize("by_hand, repaired", [
    ("UPDATE cbr_daily_rates SET value = 1 WHERE char_code = 'USD'",
     {"inserted": 0, "updated": 1, "unchanged": 2, "deleted": 0}),
    ("DELETE FROM cbr_daily_rates WHERE char_code = 'EUR'",
     {"inserted": 1, "updated": 0, "unchanged": 2, "deleted": 0}),
    ("TRUNCATE cbr_daily_rates",
     {"inserted": 3, "updated": 0, "unchanged": 0, "deleted": 0}),
    ("INSERT INTO cbr_daily_rates SELECT partition_date, rate_date, 'RX', '999', 'XXX', 1, 'x', "
     "1, 1, 'me', now(), 'me', now() FROM cbr_daily_rates WHERE char_code = 'USD'",
     {"inserted": 0, "updated": 0, "unchanged": 3, "deleted": 1}),
])
def test_a_write_by_hand_makes_the_next_reload_repair_the_partition(
    pg_warehouse_url, by_hand, repaired
):
    load(pg_warehouse_url, rates(), "run-1")
    clean = [{k: v for k, v in r.items() if k not in ("loaded_at", "changed_at")}
             for r in table_rows(pg_warehouse_url, "cbr_daily_rates")]
    operator_sql(pg_warehouse_url, by_hand)
    assert ledger(pg_warehouse_url)[("cbr_daily_rates", DAY.isoformat())]["content_digest"] is None
    assert load(pg_warehouse_url, rates(), "run-2").as_dict() == repaired
    stored = table_rows(pg_warehouse_url, "cbr_daily_rates")
    assert [(r["char_code"], r["value"]) for r in stored] == [
        (r["char_code"], r["value"]) for r in clean]
    assert ledger(pg_warehouse_url)[("cbr_daily_rates", DAY.isoformat())]["content_digest"]


def test_an_insert_by_hand_without_bookkeeping_is_refused(pg_warehouse_url):
    with pytest.raises(psycopg.errors.NotNullViolation, match="loaded_by_run"):
        operator_sql(pg_warehouse_url,
                     "INSERT INTO cbr_daily_rates (partition_date, rate_date, cbr_id, num_code, "
                     "char_code, nominal, name, value, unit_rate) VALUES ('2026-11-05', "
                     "'2026-11-05', 'R1', '840', 'USD', 1, 'Dollar', 1, 1)")


moving_metadata = MetaData()
orders_by_day = warehouse_table(
    "test_orders_by_day",
    Column("order_id", String(16), nullable=False),
    Column("day", Date, nullable=False),
    Column("quantity", Integer, nullable=False),
    natural_key=("order_id",),
    in_metadata=moving_metadata,
)
ORDERS_BY_DAY = LoadTarget(orders_by_day, ("order_id",), "day", LoadMode.REPLACE_PARTITION)


def orders(day: str, *ids: str) -> pd.DataFrame:
    return pd.DataFrame({"order_id": pd.array(list(ids), dtype="str"),
                         "day": [date.fromisoformat(day)] * len(ids),
                         "quantity": [1] * len(ids)})


def test_a_load_that_moves_a_row_between_partitions_forgets_their_digests(pg_warehouse_url):
    """The key is the order alone, so a load of 11-06 can take an order away from 11-05; the
    next load of 11-05 then has work to do, even with the rows it had before."""
    create_tables(pg_warehouse_url, moving_metadata)
    warehouse = warehouse_engine(pg_warehouse_url)
    load_partition(warehouse, ORDERS_BY_DAY, orders("2026-11-05", "A", "B"), "2026-11-05", "r1")
    moved = load_partition(warehouse, ORDERS_BY_DAY, orders("2026-11-06", "A"), "2026-11-06",
                           "r2")
    assert moved.updated == 1
    again = load_partition(warehouse, ORDERS_BY_DAY, orders("2026-11-05", "A", "B"),
                           "2026-11-05", "r3")
    assert again.as_dict() == {"inserted": 0, "updated": 1, "unchanged": 1, "deleted": 0}
    assert {r["order_id"]: r["day"] for r in table_rows(pg_warehouse_url, orders_by_day)} == {
        "A": date(2026, 11, 5), "B": date(2026, 11, 5)}


def test_an_operator_can_make_every_next_reload_compare_the_stored_rows(pg_warehouse_url):
    """``mostovik db forget-digests``: after writes no trigger saw (here: triggers disabled the
    way a data-only restore disables them), the next re-load repairs the partition."""
    load(pg_warehouse_url, rates(), "run-1")
    operator_sql(pg_warehouse_url, "SET session_replication_role = replica; "
                                   "UPDATE cbr_daily_rates SET value = 1 WHERE char_code = 'USD'")
    assert ledger(pg_warehouse_url)[("cbr_daily_rates", DAY.isoformat())]["content_digest"]
    result = subprocess.run([MOSTOVIK, "db", "forget-digests"], capture_output=True, text=True,
                            env={**os.environ, "MOSTOVIK_DATABASE_URL": pg_warehouse_url},
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert "forgot the content digests of 1 partition load(s)" in result.stdout
    assert load(pg_warehouse_url, rates(), "run-2").updated == 1
    usd = [r for r in table_rows(pg_warehouse_url, "cbr_daily_rates") if r["char_code"] == "USD"]
    assert usd[0]["value"] == rates().set_index("char_code").loc["USD", "value"]


def test_a_clerk_without_rights_on_the_ledger_can_still_edit_and_is_still_noticed(
    pg_warehouse_url
):
    """The trigger runs with its owner's rights: an operator role allowed to edit the table,
    and nothing else, neither fails on the ledger nor slips past it."""
    load(pg_warehouse_url, rates(), "run-1")
    parsed = make_url(pg_warehouse_url)
    clerk = f"clerk_{parsed.database}"
    operator_sql(pg_warehouse_url, f"CREATE ROLE {clerk} LOGIN PASSWORD 'clerk'; "
                                   f"GRANT SELECT, UPDATE ON cbr_daily_rates TO {clerk}")
    try:
        as_clerk = parsed.set(username=clerk, password="clerk").render_as_string(
            hide_password=False)
        operator_sql(as_clerk, "UPDATE cbr_daily_rates SET value = 1 WHERE char_code = 'USD'")
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            operator_sql(as_clerk, "UPDATE partition_loads SET content_digest = 'forged'")
    finally:
        operator_sql(pg_warehouse_url, f"REVOKE ALL ON cbr_daily_rates FROM {clerk}; "
                                       f"DROP ROLE {clerk}")
    assert ledger(pg_warehouse_url)[("cbr_daily_rates", DAY.isoformat())]["content_digest"] is None
    assert load(pg_warehouse_url, rates(), "run-2").updated == 1


class PausedLoad:
    """A load in a thread of its own that stops inside its transaction, after staging its rows
    and before writing the table or recording anything, until released."""

    def __init__(self, monkeypatch, load) -> None:
        self.entered, self.release = threading.Event(), threading.Event()
        self.result: dict = {}
        merge = partition._merge_from_stage

        def paused_merge(*args, **kwargs):
            if threading.current_thread() is self.thread:
                self.entered.set()
                assert self.release.wait(60)
            return merge(*args, **kwargs)

        monkeypatch.setattr(partition, "_merge_from_stage", paused_merge)
        self.thread = threading.Thread(target=lambda: self.result.update(counts=load()))
        self.thread.start()
        assert self.entered.wait(60), "the load never reached its merge"

    def finish(self):
        self.release.set()
        self.thread.join(60)
        return self.result["counts"]


def in_thread(work) -> tuple[threading.Thread, dict]:
    outcome: dict = {}

    def run():
        try:
            outcome["value"] = work()
        except Exception as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    return thread, outcome


def finished_or_waiting(pg_url: str, thread: threading.Thread, query_like: str) -> None:
    """Until ``thread`` is done or its statement waits on a lock (then it stays waiting)."""
    with psycopg.connect(dsn_of(pg_url), autocommit=True) as observer:
        deadline = time.monotonic() + 30
        while thread.is_alive() and time.monotonic() < deadline:
            if backend_waiting_on_a_lock(observer, query_like, timeout=0.2):
                return
    assert not thread.is_alive() or time.monotonic() < deadline


def test_a_write_by_hand_during_a_load_is_never_hidden_by_its_digest(
    pg_warehouse_url, monkeypatch
):
    """The operator's edit commits while a load of the same partition is in flight: either the
    load sees it, or the edit forgets the digest the load records. Never a digest that claims
    the edited row is as the source says."""
    load(pg_warehouse_url, rates(), "run-1")
    changed = rates(USD="93.0000")
    paused = PausedLoad(monkeypatch, lambda: load(pg_warehouse_url, changed, "run-2"))
    edit, outcome = in_thread(lambda: operator_sql(
        pg_warehouse_url, "UPDATE cbr_daily_rates SET value = 1 WHERE char_code = 'EUR'"))
    finished_or_waiting(pg_warehouse_url, edit, "UPDATE cbr_daily_rates%")
    assert paused.finish().updated == 1
    edit.join(60)
    assert "error" not in outcome
    repaired = load(pg_warehouse_url, changed, "run-3")
    assert repaired.as_dict() == {"inserted": 0, "updated": 1, "unchanged": 2, "deleted": 0}
    values = {r["char_code"]: r["value"] for r in table_rows(pg_warehouse_url, "cbr_daily_rates")}
    assert values == {"USD": Decimal("93.0000"), "EUR": Decimal("100.1000"),
                      "JPY": Decimal("61.2000")}


def test_a_move_between_partitions_during_a_load_is_never_hidden_by_its_digest(
    pg_warehouse_url, monkeypatch
):
    """A load of 11-06 takes order A from 11-05 while a load of 11-05 is in flight: the 11-05
    load's digest must not survive to claim A is still there."""
    create_tables(pg_warehouse_url, moving_metadata)
    warehouse = warehouse_engine(pg_warehouse_url)
    load_partition(warehouse, ORDERS_BY_DAY, orders("2026-11-05", "A", "B"), "2026-11-05", "r1")
    again = orders("2026-11-05", "A", "B")
    again.loc[1, "quantity"] = 2
    paused = PausedLoad(monkeypatch, lambda: load_partition(
        warehouse, ORDERS_BY_DAY, again, "2026-11-05", "r2"))
    mover, outcome = in_thread(lambda: load_partition(
        warehouse, ORDERS_BY_DAY, orders("2026-11-06", "A"), "2026-11-06", "r3"))
    finished_or_waiting(pg_warehouse_url, mover, "%pg_advisory_xact_lock(%")
    assert paused.finish().updated == 1
    mover.join(60)
    assert outcome["value"].updated == 1  # A moved to 11-06
    back = load_partition(warehouse, ORDERS_BY_DAY, again, "2026-11-05", "r4")
    assert back.as_dict() == {"inserted": 0, "updated": 1, "unchanged": 1, "deleted": 0}
    assert {r["order_id"]: r["day"] for r in table_rows(pg_warehouse_url, orders_by_day)} == {
        "A": date(2026, 11, 5), "B": date(2026, 11, 5)}


def test_a_digest_is_not_trusted_while_the_guard_trigger_is_disabled(pg_warehouse_url):
    load(pg_warehouse_url, rates(), "run-1")
    operator_sql(pg_warehouse_url, "ALTER TABLE cbr_daily_rates DISABLE TRIGGER "
                                   "cbr_daily_rates_written_outside_loader; "
                                   "UPDATE cbr_daily_rates SET value = 1 WHERE char_code = 'USD'")
    assert load(pg_warehouse_url, rates(), "run-2").updated == 1
    assert ledger(pg_warehouse_url)[("cbr_daily_rates", DAY.isoformat())]["content_digest"] is None
