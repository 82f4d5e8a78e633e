"""The scheduled verification ticked by the real ``dagster-daemon`` on a fake clock (libfaketime,
support/fake_clock.py), as it runs in production once ``MOSTOVIK_VERIFY_SOURCES`` names a
source: nobody launches it, its schedule does, at its cron time (05:30 Moscow).

The CBR's catch-up loads the lookback; then a row is edited by hand in the warehouse and the
stand-in CBR corrects a day it had published. At the next 05:30 the verification schedule's tick
launches the run (the tick names it in run storage); the two days alert once each, through the
outbox (held there while the webhook is away, delivered by the daemon's ``alert_outbox`` sensor
once it is back), and ``matches_source`` fails on exactly those two days. The 05:30 tick of the
day after, with nothing changed, verifies the same days, finds the same differences, and alerts
nothing new."""

from __future__ import annotations

import pytest
from dagster import DagsterRunStatus
from dagster._core.scheduler.instigation import TickStatus
from sqlalchemy import select, text

from mostovik_pipelines.framework.verification.check import verification_check_key
from mostovik_pipelines.framework.verification.schedule import VERIFY_SOURCES_SETTING
from mostovik_pipelines.resources.alert_outbox import MAX_BACKOFF
from mostovik_pipelines.resources.warehouse import warehouse_engine
from mostovik_pipelines.sources import cbr_daily_rates
from mostovik_pipelines.warehouse.schema import alert_outbox
from mostovik_pipelines_tests.support.fake_clock import schedule_ticks
from mostovik_pipelines_tests.support.schedule_calendar import Calendar, moscow
from mostovik_pipelines_tests.support.waiting import limit_for, wait_until
from mostovik_pipelines_tests.support.warehouse import table_rows

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

CBR = cbr_daily_rates.SOURCE
LOADS = f"{CBR.name}_schedule"
VERIFICATION = f"{CBR.name}_verification"
LOOKBACK_DAYS = 3
EDITED = "2026-11-09"
"""A Monday: its row of USD edited by hand in the warehouse."""
CORRECTED = "2026-11-10"
"""A Tuesday (the CBR's rates of a Tuesday answer for that day alone): corrected at the source
after the load."""


def test_the_verification_schedule_ticked_by_the_daemon_alerts_each_differing_day_once(
        calendar):
    cal = calendar(LOADS, VERIFICATION, lookback={CBR.name: LOOKBACK_DAYS},
                   environment={VERIFY_SOURCES_SETTING: CBR.name})

    # Tue 10 November 12:00: the catch-up loads the lookback's days (tomorrow's not out yet).
    cal.tick(LOADS, moscow("2026-11-10", 12))
    assert {EDITED, CORRECTED} <= _loaded(cal)
    with warehouse_engine(cal.warehouse_url).begin() as connection:
        edited = connection.execute(text(
            "UPDATE cbr_daily_rates SET value = value + 1 "
            "WHERE partition_date = :day AND char_code = 'USD'"), {"day": EDITED}).rowcount
    assert edited == 1
    cal.standin.change_cbr_rates(CORRECTED, {"CNY": "13,1234"})

    # Wed 11 November 05:30, the webhook away: the verification schedule's tick.
    cal.webhook.down = True
    first = _verification_tick(cal, moscow("2026-11-11", 5, 30))
    verified = _verdicts(cal, first)
    # The days whose period closed within the 3-day lookback: 8, 9 and 10 November.
    assert verified == {"2026-11-08": "SUCCEEDED", EDITED: "FAILED", CORRECTED: "FAILED"}
    held = _outbox(cal)
    assert sorted(row["period"] for row in held) == [EDITED, CORRECTED]
    assert all(row["sent_at"] is None for row in held)  # in the outbox, not lost
    assert _alerts(cal) == []

    cal.webhook.down = False  # the daemon's alert_outbox sensor delivers what waits
    interval = int(cal.daemon.environment["MOSTOVIK_ALERT_SENSOR_INTERVAL_SECONDS"])
    wait_until(lambda: all(row["sent_at"] is not None for row in _outbox(cal)),
               MAX_BACKOFF.total_seconds() + limit_for(interval),
               "the verification alerts delivered from the outbox", cal.daemon.log_tail)
    alerts = {alert["period"]: alert for alert in _alerts(cal)}
    assert sorted(alerts) == [EDITED, CORRECTED]
    assert "USD value" in alerts[EDITED]["message"]
    assert "CNY value" in alerts[CORRECTED]["message"]
    assert "'13.1234'" in alerts[CORRECTED]["message"]
    assert all(alert["run_id"] == first for alert in alerts.values())
    delivered = cal.webhook.delivered()
    assert [delivered[alert["idempotency_key"]] for alert in alerts.values()] == [1, 1]

    # Thu 12 November 05:30, nothing changed: the same two days differ, nothing new is said.
    second = _verification_tick(cal, moscow("2026-11-12", 5, 30))
    assert _verdicts(cal, second) == {EDITED: "FAILED", CORRECTED: "FAILED"}
    assert len(_outbox(cal)) == 2
    assert len(_alerts(cal)) == 2


def _verification_tick(cal: Calendar, due) -> str:
    """The verification schedule's tick due at ``due``, run by the daemon: the one run it
    launched, once it succeeded."""
    runs = cal.tick(VERIFICATION, due)
    [tick] = [tick for tick in schedule_ticks(cal.daemon.instance, VERIFICATION)
              if tick.timestamp == due.timestamp()]
    assert tick.status is TickStatus.SUCCESS
    [run] = runs
    assert list(tick.run_ids) == [run.run_id]
    assert run.job_name == f"{CBR.name}_verification_job"
    assert run.tags["dagster/schedule_name"] == VERIFICATION
    assert run.status is DagsterRunStatus.SUCCESS, cal.daemon.log_tail()
    return run.run_id


def _verdicts(cal: Calendar, run_id: str) -> dict[str, str]:
    """The ``matches_source`` evaluations the run recorded, per partition."""
    history = cal.daemon.instance.event_log_storage.get_asset_check_execution_history(
        verification_check_key(CBR), limit=100)
    return {record.partition: record.status.value for record in history
            if record.run_id == run_id}


def _outbox(cal: Calendar) -> list[dict]:
    """The verification alerts kept in the outbox (sent or pending)."""
    with warehouse_engine(cal.warehouse_url).connect() as connection:
        return [dict(row._mapping) for row in connection.execute(
            select(alert_outbox).where(alert_outbox.c.kind == "verification"))]


def _alerts(cal: Calendar) -> list[dict]:
    return [alert for alert in cal.webhook.alerts if alert["kind"] == "verification"]


def _loaded(cal: Calendar) -> set[str]:
    return {row["partition_date"].isoformat()
            for row in table_rows(cal.warehouse_url, "cbr_daily_rates")}
