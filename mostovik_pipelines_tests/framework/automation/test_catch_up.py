"""What a schedule's tick asks for, from what real runs left in run storage: the newest
partition, a sync's window once it closed, a partition after a transient failure (with backoff),
a missing one; never one in flight or one that failed for a permanent reason.

The runs here are real (in process, the stand-in sources, a real warehouse) and so start at the
real time; the ticks are evaluated at chosen times relative to them. What a tick at midnight does
with the real daemon is ``test_calendar_daemon.py``'s."""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime, timedelta
from zoneinfo import ZoneInfo

import pytest
from dagster import DagsterRunStatus, build_schedule_context, instance_for_test

from mostovik_pipelines.core.tags import (
    PARTITION_TAG,
    RANGE_END_TAG,
    RANGE_START_TAG,
    REQUESTED_BECAUSE_TAG,
)
from mostovik_pipelines.framework.automation.catch_up import Reason, plan_catch_up
from mostovik_pipelines.framework.automation.partition_states import Outcome, partition_states
from mostovik_pipelines.framework.spec import CatchUpPolicy
from mostovik_pipelines.sources import cbr_daily_rates, erp_work_orders
from mostovik_pipelines_tests.support.locations import FAST_RETRY, code_location_for
from mostovik_pipelines_tests.support.runs import run_partition

pytestmark = pytest.mark.postgres

MOSCOW = ZoneInfo("Europe/Moscow")


def _day(offset: int) -> str:
    return (datetime.now(MOSCOW).date() + timedelta(days=offset)).isoformat()


def _cbr_date(key: str) -> str:
    year, month, day = key.split("-")
    return f"date_req={day}/{month}/{year}"


@pytest.fixture
def instance():
    """A persistent (temporary SQLite) instance: a schedule's context reads it by reference."""
    with instance_for_test() as persistent:
        yield persistent


@pytest.fixture
def cbr(pg_warehouse_url, standin_server, standin, tmp_path):
    source = dataclasses.replace(
        cbr_daily_rates.SOURCE, extract_retry=FAST_RETRY, load_retry=FAST_RETRY,
        catch_up=CatchUpPolicy(lookback=timedelta(days=4)))
    location = code_location_for(pg_warehouse_url, standin_server, tmp_path, [source])
    return source, location


@pytest.fixture
def erp(pg_warehouse_url, standin_server, standin, tmp_path):
    """The ERP source with a lookback of ``lookback`` (a function of the test's own)."""
    standin.reset_erp()

    def with_lookback(lookback: timedelta):
        source = dataclasses.replace(
            erp_work_orders.SOURCE, extract_retry=FAST_RETRY, load_retry=FAST_RETRY,
            catch_up=CatchUpPolicy(lookback=lookback))
        return source, code_location_for(pg_warehouse_url, standin_server, tmp_path, [source])

    yield with_lookback
    standin.reset_erp()


def test_the_first_tick_after_a_window_closes_syncs_it_again_with_the_newest(erp, instance):
    # A lookback of 10 minutes, shorter just after Moscow's midnight, so that yesterday's
    # window (closed at midnight) is outside it now whatever the time of day the test runs.
    soon = datetime.now(UTC) + timedelta(seconds=10)
    today, tomorrow = _day(0), _day(1)
    since_midnight = soon - datetime.fromisoformat(today).replace(tzinfo=MOSCOW)
    lookback = min(timedelta(minutes=10), since_midnight - timedelta(seconds=1))
    source, location = erp(lookback)
    assert run_partition(location.resolve_job_def("erp_work_orders_job"), today,
                         instance).success
    assert [run.reasons for run in plan_catch_up(instance, source, soon).runs] == [
        {today: Reason.NEWEST}]

    after_midnight = datetime.fromisoformat(tomorrow).replace(tzinfo=MOSCOW) + min(
        timedelta(minutes=5), lookback / 2)
    (run,) = plan_catch_up(instance, source, after_midnight).runs
    assert run.reasons == {today: Reason.WINDOW_CLOSED, tomorrow: Reason.NEWEST}

    # The schedule of the code location asks for exactly that, as one ranged run with the reason.
    schedule = location.resolve_schedule_def("erp_work_orders_schedule")
    with build_schedule_context(instance=instance,
                                scheduled_execution_time=after_midnight) as context:
        (request,) = schedule.evaluate_tick(context).run_requests
    assert request.tags[RANGE_START_TAG] == today and request.tags[RANGE_END_TAG] == tomorrow
    assert request.tags[REQUESTED_BECAUSE_TAG] == f"window_closed {today}; newest {tomorrow}"


def test_a_window_synced_by_a_run_that_started_after_it_closed_is_final(erp, instance):
    source, location = erp(timedelta(days=2))
    before, yesterday, today = _day(-2), _day(-1), _day(0)
    assert run_partition(location.resolve_job_def("erp_work_orders_job"), yesterday,
                         instance).success
    now = datetime.now(UTC) + timedelta(seconds=10)
    assert partition_states(instance, source, [yesterday], now - timedelta(days=2))[
        yesterday].final
    # Runs per contiguous span: a multi-run source never re-syncs a final window in between.
    assert [run.reasons for run in plan_catch_up(instance, source, now).runs] == [
        {before: Reason.MISSING}, {today: Reason.NEWEST}]


def test_a_transient_failure_is_asked_for_again_after_a_backoff_that_doubles(
        cbr, instance, standin):
    source, location = cbr
    job = location.resolve_job_def("cbr_daily_rates_job")
    past = _day(-2)
    standin.fault("status", status=503, times=100, match=_cbr_date(past))
    assert not run_partition(job, past, instance).success
    state = partition_states(instance, source, [past], datetime.now(UTC) - timedelta(days=1))[
        past]
    assert (state.latest_outcome, state.failures_in_a_row, state.loaded) == (
        Outcome.FAILED, 1, False)

    now = datetime.now(UTC)
    held = plan_catch_up(instance, source, now + timedelta(minutes=1))
    assert "backing off after 1 failure" in held.held[past]
    assert len(held.runs) == 2 and all(past not in run.reasons for run in held.runs)
    (run,) = plan_catch_up(instance, source, now + timedelta(minutes=31)).runs
    assert run.reasons[past] is Reason.AFTER_FAILURE

    assert not run_partition(job, past, instance).success  # fails again: 60 minutes now
    now = datetime.now(UTC)
    assert past in plan_catch_up(instance, source, now + timedelta(minutes=31)).held
    (run,) = plan_catch_up(instance, source, now + timedelta(minutes=61)).runs
    assert run.reasons[past] is Reason.AFTER_FAILURE

    standin.clear_faults()
    assert run_partition(job, past, instance).success
    (run,) = plan_catch_up(instance, source, datetime.now(UTC)).runs
    assert run.reasons[past] is Reason.IN_RANGE  # final: re-loaded only as part of the range


def test_a_permanent_failure_waits_for_an_operator_then_is_final_once_they_load_it(
        cbr, instance, standin):
    source, location = cbr
    job = location.resolve_job_def("cbr_daily_rates_job")
    past = _day(-2)
    standin.fault("malformed", times=100, match=_cbr_date(past))
    assert not run_partition(job, past, instance).success
    plan = plan_catch_up(instance, source, datetime.now(UTC) + timedelta(days=2))
    assert plan.held[past].startswith("waiting for an operator")
    assert all(past not in run.reasons for run in plan.runs)

    standin.clear_faults()
    assert run_partition(job, past, instance).success  # the operator's re-run
    state = partition_states(instance, source, [past], datetime.now(UTC) - timedelta(days=1))[
        past]
    assert state.final and not state.waiting_for_operator


def test_a_ranged_run_sets_apart_the_partition_it_failed_for_good(cbr, instance, standin):
    source, location = cbr
    job = location.resolve_job_def("cbr_daily_rates_job")
    bad, good = _day(-3), _day(-2)
    standin.fault("malformed", times=100, match=_cbr_date(bad))
    result = job.execute_in_process(instance=instance, raise_on_error=False, tags={
        RANGE_START_TAG: bad, RANGE_END_TAG: good})
    assert not result.success
    states = partition_states(instance, source, [bad, good],
                              datetime.now(UTC) - timedelta(days=1))
    assert states[bad].latest_outcome is Outcome.FAILED_PERMANENTLY
    assert states[good].final and states[good].latest_outcome is Outcome.LOADED


def test_a_partition_with_a_run_in_flight_is_not_asked_for(cbr, instance):
    source, location = cbr
    past = _day(-2)
    queued = instance.create_run_for_job(
        location.resolve_job_def("cbr_daily_rates_job"), tags={PARTITION_TAG: past},
        status=DagsterRunStatus.NOT_STARTED)
    plan = plan_catch_up(instance, source, datetime.now(UTC))
    assert plan.held[past] == f"run {queued.run_id} in flight"
    # The single-run source splits its catch-up around it, into the spans before and after.
    assert [run.keys[-1] for run in plan.runs] == [_day(-3), _day(1)]


def test_a_final_partition_with_an_operators_run_in_flight_is_never_bridged(
        cbr, instance, standin):
    """The CBR's catch-up is one ranged run that re-loads the final days between two asked
    for; a final day an operator is re-running right now is not one of them: the catch-up is
    cut around it, so no second run of it starts while the first is in flight."""
    source, location = cbr
    job = location.resolve_job_def("cbr_daily_rates_job")
    final = _day(-2)
    assert run_partition(job, final, instance).success
    plan = plan_catch_up(instance, source, datetime.now(UTC))
    (bridged,) = plan.runs
    assert bridged.reasons[final] is Reason.IN_RANGE  # final, re-loaded inside the range

    rerun = instance.create_run_for_job(job, tags={PARTITION_TAG: final},
                                        status=DagsterRunStatus.STARTED)
    plan = plan_catch_up(instance, source, datetime.now(UTC))
    assert all(final not in run.reasons for run in plan.runs), plan.describe()
    assert [(run.keys[0], run.keys[-1]) for run in plan.runs] == [
        (_day(-4), _day(-3)), (_day(-1), _day(1))]
    assert partition_states(instance, source, [final], datetime.now(UTC) - timedelta(
        days=1))[final].in_flight_run == rerun.run_id


def test_a_single_run_backfill_of_file_versions_holds_each_of_them_in_flight(
        instance, pg_warehouse_url, standin_server, tmp_path):
    """A UI backfill of several delivery report versions is one ranged run over dynamic
    partitions: each version in it is in flight, and the sensor does not ask for it."""
    from mostovik_pipelines.sources import material_deliveries

    source = material_deliveries.SOURCE
    versions = ["a.csv@000000000001", "b.csv@000000000002", "c.csv@000000000003"]
    instance.add_dynamic_partitions(source.partitions_def.name, versions)
    location = code_location_for(pg_warehouse_url, standin_server, tmp_path, [source])
    ranged = instance.create_run_for_job(
        location.resolve_job_def("material_deliveries_job"), status=DagsterRunStatus.NOT_STARTED,
        tags={RANGE_START_TAG: versions[0], RANGE_END_TAG: versions[1]})
    states = partition_states(instance, source, versions, datetime.now(UTC) - timedelta(days=1))
    assert [states[key].in_flight_run for key in versions] == [
        ranged.run_id, ranged.run_id, None]
