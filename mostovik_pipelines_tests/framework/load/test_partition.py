"""The partition load on both backends: exact, idempotent, atomic, and version-guarded (how a
re-load compares rows: ``test_partition_comparison.py``)."""

from __future__ import annotations

import threading
import time
from datetime import UTC, date, datetime
from decimal import Decimal

import pandas as pd
import psycopg
import pyarrow as pa
import pytest
from sqlalchemy import (
    BigInteger,
    Boolean,
    Column,
    Date,
    DateTime,
    Float,
    Integer,
    MetaData,
    String,
)

from mostovik_pipelines.core.load_target import LoadMode, LoadTarget
from mostovik_pipelines.framework.load.lock import partition_lock_keys
from mostovik_pipelines.framework.load.partition import (
    KeptRows,
    PartitionSuperseded,
    _looks_new,
    load_partition,
)
from mostovik_pipelines.framework.load.transfer import arrow_rows
from mostovik_pipelines.resources.warehouse import warehouse_engine
from mostovik_pipelines.sources.cbr_daily_rates import SOURCE
from mostovik_pipelines.warehouse.schema import warehouse_table
from mostovik_pipelines.warehouse.types import ExactDecimal
from mostovik_pipelines_tests.support.postgres import dsn_of
from mostovik_pipelines_tests.support.warehouse import (
    create_tables,
    physical_snapshot,
    table_rows,
)

DAY = date(2026, 11, 5)


def rates(day: date = DAY, **overrides: str) -> pd.DataFrame:
    values = {"USD": "92.5000", "EUR": "100.1000", "JPY": "61.2000"} | overrides
    return pd.DataFrame([
        {"partition_date": day, "rate_date": day, "cbr_id": f"R{code}", "num_code": "001",
         "char_code": code, "nominal": 1, "name": code, "value": Decimal(value),
         "unit_rate": Decimal(value)}
        for code, value in values.items() if value is not None
    ])


def load(url: str, frame: pd.DataFrame, run_id: str = "run-1", day: date = DAY):
    return load_partition(warehouse_engine(url), SOURCE.load_target, frame, day.isoformat(),
                          run_id)


def test_first_load_inserts_and_reload_touches_nothing(warehouse_url):
    assert load(warehouse_url, rates()).as_dict() == {
        "inserted": 3, "updated": 0, "unchanged": 0, "deleted": 0}
    before = physical_snapshot(warehouse_url, "cbr_daily_rates")
    assert load(warehouse_url, rates(), "run-2").as_dict() == {
        "inserted": 0, "updated": 0, "unchanged": 3, "deleted": 0}
    assert physical_snapshot(warehouse_url, "cbr_daily_rates") == before


def test_changed_rows_are_updated_and_vanished_rows_deleted_in_this_partition_only(
    warehouse_url
):
    other_day = date(2026, 11, 6)
    load(warehouse_url, rates())
    load(warehouse_url, rates(other_day), day=other_day)
    counts = load(warehouse_url, rates(USD="93.0000", EUR=None, CNY="12.7000"), "run-2")
    assert counts.as_dict() == {"inserted": 1, "updated": 1, "unchanged": 1, "deleted": 1}
    rows = table_rows(warehouse_url, "cbr_daily_rates")
    today = {r["char_code"]: r for r in rows if r["partition_date"] == DAY}
    assert set(today) == {"USD", "JPY", "CNY"}
    assert today["USD"]["value"] == Decimal("93.0000")
    assert (today["USD"]["loaded_by_run"], today["USD"]["changed_by_run"]) == ("run-1", "run-2")
    assert today["JPY"]["changed_by_run"] == "run-1"
    assert len([r for r in rows if r["partition_date"] == other_day]) == 3


def test_a_failing_load_leaves_the_partition_as_it_was(warehouse_url):
    load(warehouse_url, rates())
    before = physical_snapshot(warehouse_url, "cbr_daily_rates")
    broken = rates(USD="1.0000", CNY="2.0000")
    broken.loc[broken["char_code"] == "CNY", "name"] = None  # NOT NULL violation mid-load
    with pytest.raises(Exception, match=r"(?i)null"):
        load(warehouse_url, broken, "run-2")
    assert physical_snapshot(warehouse_url, "cbr_daily_rates") == before


def test_hostile_text_is_stored_as_data(warehouse_url):
    frame = rates()
    frame.loc[0, "name"] = "'); DROP TABLE cbr_daily_rates; --\t\\N \"quoted\""
    load(warehouse_url, frame)
    stored = table_rows(warehouse_url, "cbr_daily_rates")
    assert {r["name"] for r in stored} >= {"'); DROP TABLE cbr_daily_rates; --\t\\N \"quoted\""}


versioned_metadata = MetaData()
work_orders = warehouse_table(
    "test_work_orders",
    Column("external_id", String(32), nullable=False),
    Column("window_start", Date, nullable=False),
    Column("version", Integer, nullable=False),
    Column("status", String(32), nullable=False),
    Column("amount", ExactDecimal(), nullable=True),
    natural_key=("external_id",),
    in_metadata=versioned_metadata,
)
WORK_ORDERS = LoadTarget(work_orders, ("external_id",), "window_start",
                         LoadMode.MERGE_BY_VERSION, "version")


def orders(*rows: tuple[str, str, int, str]) -> pd.DataFrame:
    return pd.DataFrame([
        {"external_id": i, "window_start": date.fromisoformat(w), "version": v, "status": s,
         "amount": Decimal("10.50")} for i, w, v, s in rows
    ])


def test_merge_by_version_never_lets_an_old_window_overwrite_a_newer_record(warehouse_url):
    create_tables(warehouse_url, versioned_metadata)
    merge = warehouse_engine(warehouse_url)

    first = load_partition(merge, WORK_ORDERS, orders(("A", "2026-11-01", 1, "open"),
                                                     ("B", "2026-11-01", 1, "open")),
                           "2026-11-01", "run-1")
    assert first.as_dict() == {"inserted": 2, "updated": 0, "unchanged": 0, "deleted": 0}
    newer = load_partition(merge, WORK_ORDERS, orders(("A", "2026-11-02", 2, "done")),
                           "2026-11-02", "run-2")
    assert newer.as_dict() == {"inserted": 0, "updated": 1, "unchanged": 0, "deleted": 0}
    replay = load_partition(merge, WORK_ORDERS, orders(("A", "2026-11-01", 1, "open"),
                                                      ("B", "2026-11-01", 1, "open")),
                            "2026-11-01", "run-3")
    assert replay.as_dict(merge=True) == {"inserted": 0, "updated": 0, "unchanged": 1,
                                          "deleted": 0, "ignored_older": 1, "tombstoned": 0}
    stored = {r["external_id"]: r for r in table_rows(warehouse_url, work_orders)}
    assert (stored["A"]["version"], stored["A"]["status"]) == (2, "done")
    assert stored["B"]["status"] == "open"


synced_metadata = MetaData()
synced_orders = warehouse_table(
    "test_synced_orders",
    Column("external_id", String(32), nullable=False),
    Column("window_start", Date, nullable=False),
    Column("version", Integer, nullable=False),
    Column("deleted", Boolean, nullable=False),
    natural_key=("external_id",),
    in_metadata=synced_metadata,
)
SYNCED_ORDERS = LoadTarget(synced_orders, ("external_id",), "window_start",
                           LoadMode.MERGE_BY_VERSION, "version", "deleted")


def synced(window: str, *rows: tuple[str, int, bool]) -> pd.DataFrame:
    return pd.DataFrame([{"external_id": i, "window_start": date.fromisoformat(window),
                          "version": v, "deleted": d} for i, v, d in rows])


def test_page_groups_of_new_keys_and_of_keys_stored_elsewhere_load_alike(pg_warehouse_url):
    """A page group whose keys the table never held is copied straight into the table; one
    with a key stored in another window (one the key probes miss, among many new keys) still
    moves that record and counts as the staged merge does."""
    create_tables(pg_warehouse_url, synced_metadata)
    engine = warehouse_engine(pg_warehouse_url)

    def page(window: str, frame: pd.DataFrame, run_id: str):
        return load_partition(engine, SYNCED_ORDERS, frame, window, run_id,
                              whole_partition=False).as_dict(merge=True)

    first = synced("2026-11-01", *((f"A{n:03d}", 1, n % 10 == 0) for n in range(100)))
    assert page("2026-11-01", first, "run-1") == {
        "inserted": 100, "updated": 0, "unchanged": 0, "deleted": 0, "ignored_older": 0,
        "tombstoned": 10}
    # A051 sits between the probed keys: only the unique key can tell it is stored.
    later = synced("2026-11-02", *((f"B{n:03d}", 1, False) for n in range(50)),
                   ("A051", 2, False), ("A052", 1, False),
                   *((f"B{n:03d}", 1, False) for n in range(50, 100)))
    with engine.connect() as connection:  # the probes miss A051: the copy meets its key
        assert _looks_new(connection, SYNCED_ORDERS, arrow_rows(later), "2026-11-02",
                          whole_partition=False)
    assert page("2026-11-02", later, "run-2") == {
        "inserted": 100, "updated": 1, "unchanged": 1, "deleted": 0, "ignored_older": 0,
        "tombstoned": 0}
    stored = {r["external_id"]: r for r in table_rows(pg_warehouse_url, synced_orders)}
    assert len(stored) == 200
    assert (stored["A051"]["window_start"], stored["A051"]["version"]) == (date(2026, 11, 2), 2)
    assert stored["A052"]["window_start"] == date(2026, 11, 1)
    assert {r["loaded_by_run"] for k, r in stored.items() if k.startswith("B")} == {"run-2"}
    assert sum(r["deleted"] for r in stored.values()) == 10
    assert page("2026-11-02", later, "run-3")["unchanged"] == 102


def test_loads_of_one_partition_wait_for_each_other_and_other_partitions_do_not(
    pg_warehouse_url
):
    holder = psycopg.connect(dsn_of(pg_warehouse_url), autocommit=True)
    holder.execute("SELECT pg_advisory_lock(%s, %s)",
                   partition_lock_keys("cbr_daily_rates", DAY.isoformat()))
    finished: dict[str, float] = {}

    def load_and_time(day: date) -> None:
        load(pg_warehouse_url, rates(day), day=day)
        finished[day.isoformat()] = time.monotonic()

    same = threading.Thread(target=load_and_time, args=(DAY,))
    other = threading.Thread(target=load_and_time, args=(date(2026, 11, 6),))
    same.start()
    other.start()
    other.join(timeout=30)
    time.sleep(0.5)
    assert "2026-11-06" in finished and DAY.isoformat() not in finished
    released = time.monotonic()
    holder.execute("SELECT pg_advisory_unlock_all()")
    holder.close()
    same.join(timeout=30)
    assert finished[DAY.isoformat()] >= released


def test_the_quarantine_commits_with_the_data_or_not_at_all(warehouse_url):
    from functools import partial

    from mostovik_pipelines.framework.quality.quarantine import replace_quarantine
    from mostovik_pipelines.framework.spec import RejectedRow
    from mostovik_pipelines_tests.support.warehouse import quarantined_by_run

    engine = warehouse_engine(warehouse_url)

    def quarantine(run_id: str):
        replace = partial(replace_quarantine, source="cbr_daily_rates",
                          partition_key="2026-11-05", run_id=run_id,
                          rejected=[RejectedRow(4, "<Valute/>", "broken")])
        return lambda connection, _counts: replace(connection)

    load_partition(engine, SOURCE.load_target, rates(), DAY.isoformat(), "run-1",
                   within_transaction=quarantine("run-1"))
    broken = rates(CNY="2.0000")
    broken.loc[broken["char_code"] == "CNY", "name"] = None
    with pytest.raises(Exception, match=r"(?i)null"):
        load_partition(engine, SOURCE.load_target, broken, DAY.isoformat(), "run-2",
                       within_transaction=quarantine("run-2"))
    assert [r["run_id"] for r in quarantined_by_run(engine, "run-1")] == ["run-1"]
    assert quarantined_by_run(engine, "run-2") == []


typed_metadata = MetaData()
every_type = warehouse_table(
    "test_every_type",
    Column("key", String(16), nullable=False),
    Column("day", Date, nullable=False),
    Column("count", Integer, nullable=True),
    Column("big", BigInteger, nullable=True),
    Column("amount", ExactDecimal(), nullable=True),
    Column("score", Float, nullable=True),
    Column("flag", Boolean, nullable=True),
    Column("seen_at", DateTime(timezone=True), nullable=True),
    Column("note", String(64), nullable=True),
    natural_key=("key",),
    in_metadata=typed_metadata,
)
EVERY_TYPE = LoadTarget(every_type, ("key",), "day", LoadMode.REPLACE_PARTITION)
DECIMAL = pa.decimal128(20, 4)


def every_type_frame() -> pd.DataFrame:
    """Arrow-typed columns, the shape a large source delivers (on PostgreSQL they go in
    PostgreSQL's binary COPY format), with every edge a value can have."""
    seen = datetime(2026, 11, 5, 9, 30, 15, 123456, tzinfo=UTC)
    return pd.DataFrame({
        "key": pd.array(["b", "a", "é", "z\u00a0"], dtype="str"),
        "day": pd.array(pa.array([DAY] * 4, pa.date32()), dtype=pd.ArrowDtype(pa.date32())),
        "count": pd.array([0, -2_147_483_648, 2_147_483_647, None], dtype="Int64"),
        "big": pd.array([2**62, -(2**62), 0, None], dtype="Int64"),
        "amount": pd.array(pa.array([Decimal("-12345678901234.5678"), Decimal("0.0001"),
                                     Decimal("0"), None], DECIMAL),
                           dtype=pd.ArrowDtype(DECIMAL)),
        "score": [0.1, -0.0, 1e300, None],
        "flag": pd.array([True, False, None, True], dtype="boolean"),
        "seen_at": pd.array(pa.array([seen, None, seen, seen], pa.timestamp("us", "UTC")),
                            dtype=pd.ArrowDtype(pa.timestamp("us", "UTC"))),
        "note": pd.array(["", None, "tab\there, \"quoted\", back\\slash", "line\nbreak ₽"],
                         dtype="str"),
    })


def test_every_column_type_is_stored_exactly(warehouse_url):
    create_tables(warehouse_url, typed_metadata)
    counts = load_partition(warehouse_engine(warehouse_url), EVERY_TYPE, every_type_frame(),
                            DAY.isoformat(), "run-1")
    assert counts.inserted == 4
    stored = {r["key"]: r for r in table_rows(warehouse_url, every_type)}
    seen = datetime(2026, 11, 5, 9, 30, 15, 123456, tzinfo=UTC)
    expected = {
        "b": (DAY, 0, 2**62, Decimal("-12345678901234.5678"), 0.1, True, seen, ""),
        "a": (DAY, -2_147_483_648, -(2**62), Decimal("0.0001"), -0.0, False, None, None),
        "é": (DAY, 2_147_483_647, 0, Decimal("0"), 1e300, None, seen,
              "tab\there, \"quoted\", back\\slash"),
        "z\u00a0": (DAY, None, None, None, None, True, seen, "line\nbreak ₽"),
    }
    columns = ["day", "count", "big", "amount", "score", "flag", "seen_at", "note"]
    actual = {key: tuple(row[c] for c in columns) for key, row in stored.items()}
    for key, row in actual.items():  # SQLite hands timestamps back without their zone
        if row[6] is not None and row[6].tzinfo is None:
            actual[key] = (*row[:6], row[6].replace(tzinfo=UTC), row[7])
    assert actual == expected
    again = load_partition(warehouse_engine(warehouse_url), EVERY_TYPE, every_type_frame(),
                           DAY.isoformat(), "run-2")
    assert again.as_dict() == {"inserted": 0, "updated": 0, "unchanged": 4, "deleted": 0}


# --- a partition never goes back in time; a rejected row is not an absent row -----------------


def _stored_values(url: str) -> dict[str, Decimal]:
    return {r["char_code"]: Decimal(str(r["value"])) for r in table_rows(url, "cbr_daily_rates")}


def test_a_load_of_a_payload_older_than_the_stored_one_is_refused(warehouse_url):
    engine, target, key = warehouse_engine(warehouse_url), SOURCE.load_target, DAY.isoformat()
    newer = datetime(2026, 11, 5, 13, 0, tzinfo=UTC)
    load_partition(engine, target, rates(USD="95.0000"), key, "newer", fetched_at=newer)
    with pytest.raises(PartitionSuperseded, match="run newer"):
        load_partition(engine, target, rates(USD="90.0000"), key, "older",
                       fetched_at=datetime(2026, 11, 5, 12, 0, tzinfo=UTC))
    assert _stored_values(warehouse_url)["USD"] == Decimal("95.0000")
    # The same fetch again (a retry), and a later one, load as usual.
    load_partition(engine, target, rates(USD="95.0000"), key, "retry", fetched_at=newer)
    counts = load_partition(engine, target, rates(USD="96.0000"), key, "latest",
                            fetched_at=datetime(2026, 11, 5, 14, 0, tzinfo=UTC))
    assert counts.updated == 1
    assert _stored_values(warehouse_url)["USD"] == Decimal("96.0000")


def test_a_rejected_rows_key_keeps_its_stored_row_and_absent_rows_still_go(warehouse_url):
    engine, target, key = warehouse_engine(warehouse_url), SOURCE.load_target, DAY.isoformat()
    load_partition(engine, target, rates(GBP="110.0000"), key, "run-1")
    # USD arrives unreadable (rejected), GBP no longer arrives at all, EUR changed.
    kept = KeptRows(pd.DataFrame([{"partition_date": DAY, "char_code": "USD"}]))
    counts = load_partition(engine, target, rates(USD=None, EUR="101.0000"), key, "run-2",
                            kept=kept)
    assert (counts.updated, counts.deleted) == (1, 1)
    assert _stored_values(warehouse_url) == {
        "USD": Decimal("92.5000"), "EUR": Decimal("101.0000"), "JPY": Decimal("61.2000")}
    # Re-running the same delivery keeps it that way; once USD is readable again it is loaded.
    load_partition(engine, target, rates(USD=None, EUR="101.0000"), key, "run-3", kept=kept)
    assert _stored_values(warehouse_url)["USD"] == Decimal("92.5000")
    load_partition(engine, target, rates(USD="93.0000", EUR="101.0000"), key, "run-4")
    assert _stored_values(warehouse_url)["USD"] == Decimal("93.0000")
    # Then USD really vanishes: deleted.
    load_partition(engine, target, rates(USD=None, EUR="101.0000"), key, "run-5")
    assert "USD" not in _stored_values(warehouse_url)


def test_a_rejected_row_with_an_unreadable_key_holds_back_every_deletion(warehouse_url):
    engine, target, key = warehouse_engine(warehouse_url), SOURCE.load_target, DAY.isoformat()
    load_partition(engine, target, rates(), key, "run-1")
    kept = KeptRows(pd.DataFrame(columns=["partition_date", "char_code"]),
                            all_vanished=True)
    counts = load_partition(engine, target, rates(USD=None, EUR=None), key, "run-2", kept=kept)
    assert counts.deleted == 0
    assert set(_stored_values(warehouse_url)) == {"USD", "EUR", "JPY"}
