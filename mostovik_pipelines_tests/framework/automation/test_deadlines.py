"""Each period's deadline: when the sources declare their periods due, what the check
``period_deadlines`` says after real runs (red while a due period is not final, whatever other
periods were loaded), and what the sensor alerts (once per late period, once per period that
left the lookback, however often it is evaluated). The truth test with the real daemon on a fake
clock is ``test_signals_truth.py``."""

from __future__ import annotations

import dataclasses
import logging
from datetime import UTC, date, datetime, time, timedelta
from zoneinfo import ZoneInfo

import pytest
from dagster import AssetCheckKey, AssetKey, build_sensor_context, instance_for_test

from mostovik_pipelines.framework.automation.deadlines import (
    DEADLINE_CHECK,
    deadline_state,
    deadlines_sensor,
)
from mostovik_pipelines.framework.automation.policy import CatchUpPolicy
from mostovik_pipelines.resources.notifier import AlertNotifierResource
from mostovik_pipelines.sources import cbr_daily_rates, cbr_metal_prices, erp_work_orders
from mostovik_pipelines_tests.support.locations import FAST_RETRY, code_location_for
from mostovik_pipelines_tests.support.runs import run_partition

MOSCOW = ZoneInfo("Europe/Moscow")


def _due(spec, day: str) -> datetime:
    window = spec.partitions_def.time_window_for_partition_key(day)
    return spec.deadline.due(window.start, window.end).astimezone(MOSCOW)


def test_each_source_declares_when_its_periods_are_due_on_the_cbr_calendar():
    """The week of 2-8 November 2026: 4 November (Wednesday) is Unity Day, a public holiday on
    which the CBR sets no rates; 7 and 8 November are a weekend."""
    at = {day: _due(cbr_daily_rates.SOURCE, f"2026-11-{day:02d}").strftime("%d %H:%M")
          for day in range(3, 11)}
    assert at == {3: "02 16:30", 4: "03 16:30",
                  5: "05 16:30",  # its eve is the holiday: asked on it, the CBR answers older
                  6: "05 16:30", 7: "06 16:30",
                  8: "08 16:30", 9: "09 16:30",  # Sunday's and Monday's: on their own day
                  10: "09 16:30"}
    assert _due(cbr_metal_prices.SOURCE, "2026-11-04") == datetime(2026, 11, 4, 19, 0,
                                                                   tzinfo=MOSCOW)
    # A window is due an hour after its close and settle time (5 minutes): 01:05.
    assert _due(erp_work_orders.SOURCE, "2026-11-04") == datetime(2026, 11, 5, 1, 5,
                                                                  tzinfo=MOSCOW)


@pytest.fixture
def instance():
    with instance_for_test() as persistent:
        yield persistent


@pytest.fixture
def cbr(pg_warehouse_url, standin_server, standin, tmp_path):
    source = dataclasses.replace(
        cbr_daily_rates.SOURCE, extract_retry=FAST_RETRY, load_retry=FAST_RETRY,
        catch_up=CatchUpPolicy(lookback=timedelta(days=20)))
    return source, code_location_for(pg_warehouse_url, standin_server, tmp_path,
                                     [source]).resolve_job_def("cbr_daily_rates_job")


def _last_weeks_tuesday() -> date:
    today = datetime.now(MOSCOW).date()
    return today - timedelta(days=today.weekday() + 6)


@pytest.mark.postgres
def test_an_old_day_loaded_while_tomorrows_rates_are_missing_leaves_the_check_red(cbr, instance):
    """The 16:00 tick that loads an older missing day makes Dagster's freshness (the newest
    load of any partition) green; the deadline check stays red while tomorrow's rates are not
    in, naming them, and turns green for them once they are."""
    source, job = cbr
    tuesday = _last_weeks_tuesday()
    tomorrow, old_day = (tuesday + timedelta(days=1)).isoformat(), (
        tuesday - timedelta(days=2)).isoformat()
    at = datetime.combine(tuesday, time(17, 0), MOSCOW)
    assert run_partition(job, old_day, instance).success  # the catch-up of an old day

    late = {period.key: period for period in deadline_state(instance, source, at).late}
    assert tomorrow in late and old_day not in late
    assert late[tomorrow].why() == "never loaded"
    assert late[tomorrow].due == datetime.combine(tuesday, time(16, 30), MOSCOW)

    assert run_partition(job, tomorrow, instance).success
    state = deadline_state(instance, source, at)
    assert tomorrow not in {period.key for period in state.late}
    assert not state.met  # the days nobody loaded are still due and not final
    assert f"{tuesday.isoformat()} (due" in state.describe()


@pytest.mark.postgres
def test_the_sensor_records_the_check_and_alerts_each_late_period_once(
        cbr, instance, pg_warehouse_url, webhook):
    source, job = cbr
    tuesday = _last_weeks_tuesday()
    assert run_partition(job, tuesday.isoformat(), instance).success
    [sensor] = [deadlines_sensor([source])]
    notifier = AlertNotifierResource(database_url=pg_warehouse_url, webhook_url=webhook.url)

    def tick(cursor: str | None):
        context = build_sensor_context(instance=instance, cursor=cursor,
                                       resources={"alert_notifier": notifier})
        result = sensor(context)
        for event in result.asset_events:
            instance.report_runless_asset_event(event)
        return result

    first = tick(None)
    [evaluation] = first.asset_events
    assert evaluation.check_name == DEADLINE_CHECK and not evaluation.passed
    late = evaluation.metadata["late_periods"].value
    assert tuesday.isoformat() not in late and (tuesday - timedelta(days=1)).isoformat() in late
    [record] = instance.event_log_storage.get_asset_check_execution_history(
        AssetCheckKey(AssetKey(source.name), DEADLINE_CHECK), limit=1)
    assert record.status.value == "FAILED"
    alerted = {alert["period"] for alert in webhook.alerts if alert["kind"] == "late"}
    assert alerted == set(late)

    second = tick(first.cursor)
    assert second.asset_events == []  # nothing changed: nothing recorded again
    tick(None)  # its cursor lost: the outbox's idempotency keys hold
    assert all(count == 1 for count in webhook.delivered().values())
    assert len(webhook.alerts) == len(late)


@pytest.mark.postgres
def test_a_failed_run_that_planned_the_check_does_not_leave_it_skipped(
        pg_warehouse_url, standin_server, standin, tmp_path, instance):
    """A UI backfill selects the asset with all its checks, the deadline check among them; when
    that run fails, the check's latest execution is the failed run's plan, which the UI shows as
SKIPPED. The
    sensor's next tick records the truth again (red, naming the late days), though its own
    verdict did not change."""
    source = dataclasses.replace(
        cbr_daily_rates.SOURCE, extract_retry=FAST_RETRY, load_retry=FAST_RETRY,
        catch_up=CatchUpPolicy(lookback=timedelta(days=20)))
    location = code_location_for(pg_warehouse_url, standin_server, tmp_path, [source])
    job, whole_asset = (location.resolve_job_def("cbr_daily_rates_job"),
                        location.resolve_implicit_global_asset_job_def())
    key = AssetCheckKey(AssetKey(source.name), DEADLINE_CHECK)
    assert key in whole_asset.asset_layer.asset_graph.asset_check_keys
    tuesday = _last_weeks_tuesday()
    assert run_partition(job, tuesday.isoformat(), instance).success
    sensor = deadlines_sensor([source])
    notifier = AlertNotifierResource(database_url=pg_warehouse_url)

    def tick(cursor: str | None):
        result = sensor(build_sensor_context(instance=instance, cursor=cursor,
                                             resources={"alert_notifier": notifier}))
        for event in result.asset_events:
            instance.report_runless_asset_event(event)
        return result

    def shown():
        [record] = instance.event_log_storage.get_asset_check_execution_history(key, limit=1)
        return record.status.value

    first = tick(None)
    assert shown() == "FAILED"
    standin.fault("status", status=404, times=10)
    failed = run_partition(whole_asset, (tuesday - timedelta(days=1)).isoformat(), instance)
    standin.clear_faults()
    # Stored as planned by a run that failed: GraphQL and the UI show it SKIPPED.
    assert not failed.success and shown() == "PLANNED"

    second = tick(first.cursor)
    [evaluation] = second.asset_events
    assert not evaluation.passed
    assert evaluation.metadata["late_periods"].value == (
        first.asset_events[0].metadata["late_periods"].value)
    assert shown() == "FAILED"
    assert tick(second.cursor).asset_events == []  # the truth shown: nothing recorded again


@pytest.mark.postgres
def test_a_period_past_the_lookback_is_flagged_aged_out(cbr, instance):
    source, job = cbr
    tuesday = _last_weeks_tuesday()
    assert run_partition(job, tuesday.isoformat(), instance).success
    later = datetime.now(UTC) + timedelta(days=25)
    state = deadline_state(instance, source, later)
    horizon = later - source.catch_up.lookback
    for period in state.late:
        end = source.partitions_def.time_window_for_partition_key(period.key).end
        assert period.aged_out is (end <= horizon), period
    assert any(period.aged_out for period in state.late)
    assert any(not period.aged_out for period in state.late)


def test_without_a_source_that_has_a_deadline_the_sensor_says_so(caplog):
    sensor = deadlines_sensor([])
    with instance_for_test() as instance, caplog.at_level(logging.INFO):
        result = sensor(build_sensor_context(instance=instance, resources={
            "alert_notifier": AlertNotifierResource(database_url="sqlite://")}))
    assert result.skip_reason.skip_message == "no source has a deadline"
