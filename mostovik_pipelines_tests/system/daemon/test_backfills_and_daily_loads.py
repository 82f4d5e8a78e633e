"""Backfills never hold up the daily loads: with five years of ERP windows (61 runs) and a CBR
range queued by an operator's re-run, the ERP schedule's next tick still starts its run within
30 s, because the run queue's tag limit keeps a slot of ``max_concurrent_runs`` out of every
backfill's reach (docs/operations.md "Backfills and the daily loads").

The real ``dagster-daemon`` on a fake clock (support/fake_clock.py) on the laptop instance's
queue settings; the stand-in holds every fetch (a ``hang`` fault), so the backfill runs that
start stay running and the others stay queued, the worst case of a long backfill. Read from run
storage, as an operator would: when the tick was due, when its run started, and which backfill
runs were still waiting then. The daemon's submission rate for the backfill (runs a minute, from
the runs' create timestamps) is printed for the operations notes.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
import yaml
from dagster import DagsterRunStatus, RunRecord, RunsFilter

from mostovik_pipelines.sources import cbr_daily_rates, erp_work_orders
from mostovik_pipelines_tests.support.fake_clock import run_times
from mostovik_pipelines_tests.support.processes import REPO
from mostovik_pipelines_tests.support.schedule_calendar import day_after, moscow
from mostovik_pipelines_tests.support.waiting import wait_until

QUEUED = DagsterRunStatus.QUEUED

BACKFILL_TAG = "dagster/backfill"
DAY = "2026-11-20"
TICK = moscow(DAY, 10, 5)
FIRST_WINDOW = "2021-10-01"
"""Five years of ERP windows before the tick's lookback: 61 runs of 31 windows."""
LEAD = timedelta(seconds=120)
"""The daemon's start before the tick: time to submit the backfills and start what may start
(the daemon submits a run every 8 to 20 s on a busy two-core machine)."""
HANGING_AT_LEAST = 3
"""Backfill runs holding a slot with a fetch that never answers, before the tick is due."""
QUEUED_AT_LEAST = 1
"""Backfill runs waiting in the queue behind them, before the tick is due and when the tick's
run starts: the backfill wants more slots than it may have (the daemon goes on submitting)."""
START_LIMIT = timedelta(seconds=30)


def test_every_instance_keeps_run_slots_out_of_the_backfills_reach():
    for settings_file in (REPO / "dagster.yaml", REPO / "deploy" / "dagster.yaml"):
        settings = yaml.safe_load(settings_file.read_text())
        queue = (settings.get("concurrency", {}).get("runs")
                 or settings["run_coordinator"]["config"])
        [backfill_limit] = [limit["limit"] for limit in queue["tag_concurrency_limits"]
                            if limit["key"] == BACKFILL_TAG and "value" not in limit]
        assert 0 < backfill_limit < queue["max_concurrent_runs"], settings_file


@pytest.mark.slow
@pytest.mark.postgres
def test_a_scheduled_tick_starts_its_run_within_30_s_while_a_five_year_backfill_is_queued(
        calendar, standin):
    cal = calendar("erp_work_orders_schedule", lookback={"erp_work_orders": 1},
                   environment={"MOSTOVIK_ERP_START_DATE": FIRST_WINDOW})
    instance = cal.daemon.instance
    for route in ("erp", "cbr"):
        standin.fault("hang", route=route, times=10_000)

    def backfill_runs() -> list[RunRecord]:
        return [record for record in instance.get_run_records(RunsFilter())
                if BACKFILL_TAG in record.dagster_run.tags]

    def queue_the_backfills() -> None:
        rerun = cal.mostovik("jobs", "rerun", "--source", erp_work_orders.SOURCE.name,
                             "--source", cbr_daily_rates.SOURCE.name,
                             "--from", FIRST_WINDOW, "--to", day_after(DAY, -2), "--only", "all",
                             "--as", "operator", "--reason", "five years re-loaded")
        assert rerun.returncode == 0, rerun.stdout + rerun.stderr

        def submitted_and_holding_slots() -> bool:
            queued = [r for r in backfill_runs() if r.dagster_run.status == QUEUED]
            return (len(queued) >= QUEUED_AT_LEAST
                    and len(standin.hanging()) >= HANGING_AT_LEAST)

        wait_until(submitted_and_holding_slots, LEAD.total_seconds(),
                   "the backfills' runs submitted and some holding their slots",
                   cal.daemon.log_tail)
        assert cal.daemon.now() < TICK, "the backfills took past the tick: raise LEAD"

    try:
        [run] = cal.tick("erp_work_orders_schedule", TICK, started_at=TICK - LEAD,
                         before_tick=queue_the_backfills, wait_for_runs=False)
        assert BACKFILL_TAG not in run.tags

        def started():
            return run_times(instance, run.run_id)[1]

        started_at = wait_until(started, 2 * START_LIMIT.total_seconds(),
                                "the tick's run started", cal.daemon.log_tail)
        backfill = backfill_runs()
        creates = sorted(_created(r).timestamp() for r in backfill)
        per_minute = (len(creates) - 1) * 60 / max(creates[-1] - creates[0], 1e-6)
        print(f"\nbackfill: {len(backfill)} runs created in {creates[-1] - creates[0]:.1f} s "
              f"({per_minute:.0f} runs a minute); the tick's run started "
              f"{(started_at - TICK).total_seconds():.1f} s after the tick")
        waiting = [r for r in backfill if _created(r) < started_at
                   and (r.start_time is None or r.start_time > started_at.timestamp())]
        print(f"{len(waiting)} backfill runs were waiting when it started")
        assert len(waiting) >= QUEUED_AT_LEAST, "the backfill was not holding the queue"
        assert started_at - TICK <= START_LIMIT
    finally:
        cal.daemon.stop()
        standin.release_hangs()
        standin.clear_faults()


def _created(record: RunRecord) -> datetime:
    return record.create_timestamp.replace(tzinfo=record.create_timestamp.tzinfo or UTC)
