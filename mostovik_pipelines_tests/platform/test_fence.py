"""The fence: a run cut off from its claim writes nothing more, while the run that takes its
partitions over loads; a run whose claim connection merely dropped takes it again and goes on,
and no other run acts on its partitions meanwhile.

Run 1 reaches the run storage through a link the test can cut (the holder alone partitioned from
the database: everyone else still reaches it) and the warehouse directly, as a run on a machine
that lost its route to the run storage's server only would."""

from __future__ import annotations

import threading
import time
from datetime import UTC, date, datetime
from decimal import Decimal

import pandas as pd
import psycopg
import pytest
from dagster import DagsterInstance, build_init_resource_context, build_output_context

from mostovik_pipelines.core.errors import RunClaimLost, classify
from mostovik_pipelines.core.outages import Store, setting_of
from mostovik_pipelines.framework.load.partition import load_partition
from mostovik_pipelines.platform.claims import (
    CLAIM_GONE_SECONDS,
    FENCE_GRACE_SECONDS,
    KEEPER_CHECK_SECONDS,
    LEASE_SECONDS,
    _postgres_dsn,
    ensure_run_claim,
    hold_run_claim,
    lease_left,
    run_claim_gone,
    run_claim_held,
)
from mostovik_pipelines.platform.instance_storage import OUTAGE_ENV
from mostovik_pipelines.resources.landing import LandingStoreResource
from mostovik_pipelines.resources.op_outputs import OpOutputStore
from mostovik_pipelines.resources.warehouse import warehouse_engine
from mostovik_pipelines.sources.cbr_daily_rates import SOURCE
from mostovik_pipelines_tests.support.instances import production_instance
from mostovik_pipelines_tests.support.postgres import (
    PartitionableLink,
    ThrowawayPostgres,
    cut_claim_connections,
)
from mostovik_pipelines_tests.support.waiting import wait_until
from mostovik_pipelines_tests.support.warehouse import table_rows

DAY = date(2026, 11, 5)


def rates(value: str) -> pd.DataFrame:
    return pd.DataFrame([
        {"partition_date": DAY, "rate_date": DAY, "cbr_id": f"R{code}", "num_code": "001",
         "char_code": code, "nominal": 1, "name": code, "value": Decimal(value),
         "unit_rate": Decimal(value)}
        for code in ("USD", "EUR")
    ])


def writes(run_id: str, warehouse_url: str, landing: LandingStoreResource, outputs,
           value: str) -> None:
    """Everything a run writes, in the order a run writes it: the landing, an op's output,
    the warehouse."""
    landing.land("cbr_daily_rates", DAY.isoformat(), value.encode(), content_type="text/plain",
                 origin="test", fetched_at=datetime.now(UTC), run_id=run_id)
    outputs.handle_output(build_output_context(step_key="extract", name="result",
                                               run_id=run_id), value)
    load_partition(warehouse_engine(warehouse_url), SOURCE.load_target, rates(value),
                   DAY.isoformat(), run_id)


@pytest.fixture
def run_storage(production_home, monkeypatch):
    """(instance seen through a link that can be cut, instance everyone else uses, the
    link)."""
    home, environment = production_home
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    link = PartitionableLink(int(environment["MOSTOVIK_DAGSTER_PG_PORT"]))
    monkeypatch.setenv("MOSTOVIK_DAGSTER_PG_PORT", str(link.port))
    cut_off = DagsterInstance.from_config(str(home))
    _postgres_dsn(cut_off)  # built while the link is up
    monkeypatch.setenv("MOSTOVIK_DAGSTER_PG_PORT", environment["MOSTOVIK_DAGSTER_PG_PORT"])
    with DagsterInstance.from_config(str(home)) as others:
        yield cut_off, others, link
    link.cut()


def test_a_run_cut_off_from_its_claim_writes_nothing_once_another_run_took_over(
    run_storage, pg_warehouse_url, tmp_path, monkeypatch
):
    cut_off, others, link = run_storage
    # How long a write waits for a claim it cannot take again (the run storage's budget).
    monkeypatch.setenv(OUTAGE_ENV, "15")
    landing = LandingStoreResource(base_dir=str(tmp_path / "landing"))
    outputs = OpOutputStore(base_dir=str(tmp_path / "storage")).create_io_manager(
        build_init_resource_context())
    with hold_run_claim(cut_off, "run-1"):
        writes("run-1", pg_warehouse_url, landing, outputs, "90.0000")
        assert run_claim_held(others, "run-1")

        link.cut()
        cut_at = time.time()
        # The run storage's server saw the session end: to everyone else the claim is free,
        # and stays free, so a second run takes the partition over and loads it.
        wait_until(lambda: run_claim_gone(others, "run-1"), 60, "run 1 counted dead")
        with hold_run_claim(others, "run-2"):
            writes("run-2", pg_warehouse_url, landing, outputs, "91.0000")

        # Run 1 is still alive and goes on: each of its writes is refused, as transient.
        for write in (
            lambda: landing.land("cbr_daily_rates", DAY.isoformat(), b"92", origin="test",
                                 content_type="text/plain", fetched_at=datetime.now(UTC),
                                 run_id="run-1"),
            lambda: outputs.handle_output(build_output_context(
                step_key="transform", name="result", run_id="run-1"), "92"),
            lambda: load_partition(warehouse_engine(pg_warehouse_url), SOURCE.load_target,
                                   rates("92.0000"), DAY.isoformat(), "run-1"),
        ):
            with pytest.raises(RunClaimLost) as lost:
                write()
            verdict = classify(lost.value)
            assert verdict.transient and not verdict.retried_by_step
            assert "run-1" in str(lost.value)

    rows = table_rows(pg_warehouse_url, "cbr_daily_rates")
    assert {(r["value"], r["loaded_by_run"], r["changed_by_run"]) for r in rows} == {
        (Decimal("91.0000"), "run-1", "run-2")}
    fetches = sorted((tmp_path / "landing").rglob("fetches/*.json"))
    assert len(fetches) == 2 and all(
        f.stat().st_mtime < cut_at or "run-2" in f.read_text() for f in fetches)
    assert not list((tmp_path / "storage").rglob("run-1/transform/**/*"))
    assert list((tmp_path / "storage").rglob("run-2/extract/*"))


def test_a_holder_cut_off_writes_only_within_its_lease_and_nobody_takes_over_before_it_ends(
    run_storage, monkeypatch
):
    """The lease that lets a write go without asking for the claim (two round trips a
    partition less) under the take-over rule: cut off from the run storage, the holder's
    writes pass only until its lease, counted from when its connection last answered, ends;
    another run counts it dead only after its claim stayed free for CLAIM_GONE_SECONDS, which
    ends at least CLAIM_GONE_SECONDS - LEASE_SECONDS after the holder's last write passed."""
    assert LEASE_SECONDS + KEEPER_CHECK_SECONDS <= CLAIM_GONE_SECONDS / 2
    cut_off, others, link = run_storage
    monkeypatch.setenv(OUTAGE_ENV, "12")  # how long a write waits for a claim it cannot take
    passed: list[float] = []
    refused: list[BaseException] = []

    def write_until_refused() -> None:
        while True:
            try:
                ensure_run_claim("run-1")
            except RunClaimLost as lost:
                refused.append(lost)
                return
            passed.append(time.monotonic())
            time.sleep(0.05)

    with hold_run_claim(cut_off, "run-1"):
        wait_until(lambda: lease_left("run-1") > 0, 10, "the claim leased")
        lease_ends = time.monotonic() + lease_left("run-1")
        writer = threading.Thread(target=write_until_refused, daemon=True)
        writer.start()
        link.cut()
        # Everyone else sees the claim free, and counts the run dead once it stayed free.
        wait_until(lambda: run_claim_gone(others, "run-1"), 60, "run 1 counted dead")
        taken_over_at = time.monotonic()
        writer.join(60)
    assert refused and "run-1" in str(refused[0])
    last_write = max(passed)
    # Its last write passed before the lease it had when cut off ended (it may have been
    # renewed once more in flight: one keeper check), and long before anyone took over.
    assert last_write <= lease_ends + KEEPER_CHECK_SECONDS + LEASE_SECONDS
    assert taken_over_at - last_write >= CLAIM_GONE_SECONDS - LEASE_SECONDS


def test_a_dropped_claim_connection_is_taken_again_and_no_other_run_acts_meanwhile(
    run_storage, pg_warehouse_url, postgres, tmp_path
):
    _, others, _ = run_storage
    landing = LandingStoreResource(base_dir=str(tmp_path / "landing"))
    outputs = OpOutputStore(base_dir=str(tmp_path / "storage")).create_io_manager(
        build_init_resource_context())
    with hold_run_claim(others, "run-1"):
        with psycopg.connect(_postgres_dsn(others), autocommit=True) as observer:
            assert len(cut_claim_connections(observer, postgres.port)) == 1
        # Free for a moment; the keeper takes it again well within the grace, so a check at
        # that moment does not count the run dead, and the run goes on writing.
        started = time.monotonic()
        assert not run_claim_gone(others, "run-1")
        assert time.monotonic() - started < FENCE_GRACE_SECONDS
        writes("run-1", pg_warehouse_url, landing, outputs, "90.0000")
    assert {r["value"] for r in table_rows(pg_warehouse_url, "cbr_daily_rates")} == {
        Decimal("90.0000")}


@pytest.mark.servers  # restarts a PostgreSQL of its own
def test_a_run_storage_restart_longer_than_the_grace_is_ridden_out(tmp_path, monkeypatch):
    """The database away for everyone (a restart, a failover) is no cut: nobody can count the
    run dead meanwhile, so a write waits for the claim and goes on once it is taken again."""
    _write_through_a_restart(tmp_path, monkeypatch, "dagster_fence")


@pytest.mark.servers  # restarts a PostgreSQL of its own
def test_a_write_waits_for_its_claim_as_long_as_the_run_storage_budget_not_a_steps(
    tmp_path, monkeypatch
):
    """The claim lives in the run storage: a write waits for it as long as every storage call
    of the run rides the database out (``MOSTOVIK_DAGSTER_PG_OUTAGE_SECONDS``), whatever the
    step's budget for the warehouse and the broker says. An operator who raised the run
    storage's budget for a longer failover found runs fenced at the step's 90 s instead."""
    # The warehouse's budget: far shorter than the outage.
    monkeypatch.setenv(setting_of(Store.WAREHOUSE), "1")
    monkeypatch.delenv(OUTAGE_ENV, raising=False)  # the run storage's: its 90 s default
    _write_through_a_restart(tmp_path, monkeypatch, "dagster_fence_budget")


def _write_through_a_restart(tmp_path, monkeypatch, database: str) -> None:
    """A run holding its claim on a production instance of its own whose PostgreSQL restarts
    for longer than the fence's grace: its landing write waits for the claim, then writes, and
    the claim is held again. The restart's length is the fault's own, not a wait."""
    server = ThrowawayPostgres().start()
    try:
        home, environment = production_instance(server, database, tmp_path)
        for name, value in environment.items():
            monkeypatch.setenv(name, value)
        landing = LandingStoreResource(base_dir=str(tmp_path / "landing"))
        with DagsterInstance.from_config(str(home)) as instance, hold_run_claim(instance, "run-1"):
            server.pause()
            down_at = time.monotonic()
            # The lease its connection's last answer gave ends (the keeper finds it gone): from
            # then on a write asks for the claim.
            wait_until(lambda: lease_left("run-1") == 0, LEASE_SECONDS + KEEPER_CHECK_SECONDS + 5,
                       "the claim's lease ended")
            back = threading.Timer(FENCE_GRACE_SECONDS + 4, server.resume)
            back.start()
            landing.land("cbr_daily_rates", DAY.isoformat(), b"90", content_type="text/plain",
                         origin="test", fetched_at=datetime.now(UTC), run_id="run-1")
            assert time.monotonic() - down_at > FENCE_GRACE_SECONDS  # it waited, then wrote
            back.join()
            assert run_claim_held(instance, "run-1")
        assert len(list((tmp_path / "landing").rglob("fetches/*.json"))) == 1
    finally:
        server.stop()
