"""The fake clock the schedule tests run the real daemon on (support/fake_clock.py) does what they
rely on: a Python process under it reads the fake instant and its waits take real time; the real
``dagster-daemon`` started just before a schedule's tick evaluates that tick on the fake clock,
and the run it launches succeeds, stamped in run storage with fake times; stopped and started
again hours later, it evaluates the next tick due and catches up none in between."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import UTC, date, datetime, timedelta
from pathlib import Path

import pytest
from dagster import DagsterRunStatus
from dagster._core.scheduler.instigation import TickStatus

from mostovik_pipelines.standin import StandinServer
from mostovik_pipelines_tests.support.fake_clock import (
    MOSCOW,
    SITE_DIR,
    FakeClockDaemon,
    code_location_environment,
    fake_clock_environment,
    fake_clock_instance,
    run_times,
    schedule_ticks,
    wait_for_runs_done,
    wait_for_tick,
)
from mostovik_pipelines_tests.support.waiting import PROCESS_START_MARGIN_SECONDS

SCHEDULE = "erp_work_orders_schedule"
"""Hourly at :05 Moscow time; no other schedule of the code location is due near 23:05 or 03:05."""
STARTED_AT = datetime(2026, 11, 10, 23, 4, 50, tzinfo=MOSCOW)
TICK = datetime(2026, 11, 10, 23, 5, tzinfo=MOSCOW)
RESTARTED_AT = datetime(2026, 11, 11, 3, 4, 50, tzinfo=MOSCOW)
NEXT_TICK = datetime(2026, 11, 11, 3, 5, tzinfo=MOSCOW)
WAITS = """
import json, threading, time
from datetime import UTC, datetime
now = datetime.now(UTC).timestamp()
began = time.monotonic()
time.sleep(0.2)
slept = time.monotonic() - began
began = time.monotonic()
set_ = threading.Event().wait(0.2)
waited = time.monotonic() - began
print(json.dumps({"now": now, "slept": slept, "waited": waited, "set": set_,
                  "sleep": time.sleep.__module__}))
"""


def _run_python(code: str, environment: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env=environment, capture_output=True,
                          text=True, timeout=PROCESS_START_MARGIN_SECONDS)


def test_a_python_process_on_the_fake_clock_reads_it_and_waits_in_real_time():
    at = datetime(2026, 11, 10, 23, 59, 50, tzinfo=MOSCOW)
    faked = _run_python(WAITS, {**dict(os.environ), **fake_clock_environment(at)})
    assert faked.returncode == 0, faked.stderr
    seen = json.loads(faked.stdout)
    # The clock read ``at`` when the offset was taken; the process took a moment to start.
    assert at.timestamp() <= seen["now"] < at.timestamp() + PROCESS_START_MARGIN_SECONDS, seen
    assert seen["sleep"] == "sitecustomize", seen
    assert 0.2 <= seen["slept"] < 5 and 0.2 <= seen["waited"] < 5, seen
    assert seen["set"] is False

    # Why the sitecustomize is there: libfaketime alone fails every sleep (issues #390, #426).
    bare = {**fake_clock_environment(at), "PYTHONPATH": ""}
    unmended = _run_python("import time; time.sleep(0.01)", {**dict(os.environ), **bare})
    assert "Invalid argument" in unmended.stderr, (
        "time.sleep works under libfaketime alone now: fake_clock_site/sitecustomize.py may go")

    # Without libfaketime the sitecustomize leaves time.sleep alone.
    real = _run_python(WAITS, {**dict(os.environ), "PYTHONPATH": str(SITE_DIR)})
    assert real.returncode == 0, real.stderr
    seen = json.loads(real.stdout)
    assert seen["sleep"] == "time" and abs(seen["now"] - datetime.now(UTC).timestamp()) < 60


@pytest.mark.slow
@pytest.mark.postgres
def test_the_daemon_on_the_fake_clock_runs_the_ticks_due_then(
        tmp_path: Path, pg_warehouse_url: str, standin_server: StandinServer):
    home = fake_clock_instance(tmp_path)
    environment = code_location_environment(tmp_path, pg_warehouse_url, standin_server)
    with FakeClockDaemon(tmp_path, home, environment) as daemon:
        daemon.start(STARTED_AT)
        first = _the_tick_runs(daemon, TICK)
        assert run_times(daemon.instance, first)[0].date() == date(2026, 11, 10)

        # Stopped, and started again four hours later: the ticks in between are not caught up.
        daemon.restart(RESTARTED_AT)
        second = _the_tick_runs(daemon, NEXT_TICK)
        assert [tick.timestamp for tick in schedule_ticks(daemon.instance, SCHEDULE)] == [
            NEXT_TICK.timestamp(), TICK.timestamp()]
        assert {run.run_id for run in wait_for_runs_done(daemon.instance)} == {first, second}
        # No other schedule was due in either phase.
        for other in ("cbr_daily_rates_schedule", "cbr_metal_prices_schedule",
                      "prune_storage_daily"):
            assert schedule_ticks(daemon.instance, other) == [], other


def _the_tick_runs(daemon: FakeClockDaemon, due: datetime) -> str:
    """The schedule's tick due at ``due`` launched one run, which succeeded, stamped in run
    storage with the daemon's fake times; its id."""
    tick = wait_for_tick(daemon.instance, SCHEDULE, due, diagnostics=daemon.log_tail)
    assert tick.timestamp == due.timestamp() and tick.status == TickStatus.SUCCESS, tick
    [run_id] = tick.run_ids
    wait_for_runs_done(daemon.instance, diagnostics=daemon.log_tail)
    run = daemon.instance.get_run_by_id(run_id)
    assert run is not None and run.status == DagsterRunStatus.SUCCESS, daemon.log_tail()
    assert run.tags["dagster/schedule_name"] == SCHEDULE
    # Whether the schedule asks for one partition or a range, its newest is the tick's day.
    newest = run.tags.get("dagster/partition") or run.tags["dagster/asset_partition_range_end"]
    assert newest == due.date().isoformat(), run.tags
    # Created by the daemon as the tick was evaluated, started and ended by the run's worker.
    created, started, ended = run_times(daemon.instance, run_id)
    assert started is not None and ended is not None
    for instant in (created, started, ended):
        assert due <= instant < due + timedelta(minutes=5), (created, started, ended)
    return run_id
