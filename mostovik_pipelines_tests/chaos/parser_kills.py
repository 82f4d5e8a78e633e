"""Where the parser suite kills a run, or crashes the warehouse under it.

Kill points are observed from outside, without hooks in production code:

* ``extract``: the source hangs the request; the run's extract step has started;
* ``landed``: the run's fetch record is in the landing store (extract done, transform next);
* ``transform``: a few milliseconds after ``landed``;
* ``load``: the suite holds the partition's advisory lock, so the load waits inside its
  transaction; killed there;
* ``load_mid``: as ``load``, but the lock is released and the kill lands a moment later, in the
  middle of the load's statements;
* event boundaries (:data:`EVENTS`): right after the run's event appears in the event log, from
  ``run_start`` (before the first step) to ``after_commit`` (the materialisation written right
  after the load commits);
* ``between``: a random moment up to 50 ms after one of those events;
* ``random``: after a random delay.
"""

from __future__ import annotations

import random
import time

import psycopg
from dagster import DagsterEventType, DagsterRunStatus

from mostovik_pipelines.core.outages import Store, budget_seconds
from mostovik_pipelines.framework.load.lock import partition_lock_keys
from mostovik_pipelines_tests.chaos.environment import (
    SOURCE,
)
from mostovik_pipelines_tests.chaos.harness import (
    RunHandle,
    a_load_waits_for_a_lock,
    wait_until,
)
from mostovik_pipelines_tests.chaos.parser_judge import TABLE

EVENTS = {
    "run_start": (DagsterEventType.RUN_START, None),
    "extract_start": (DagsterEventType.STEP_START, "extract"),
    "extract_output": (DagsterEventType.STEP_OUTPUT, "extract"),
    "extract_success": (DagsterEventType.STEP_SUCCESS, "extract"),
    "transform_start": (DagsterEventType.STEP_START, "transform"),
    "transform_success": (DagsterEventType.STEP_SUCCESS, "transform"),
    "load_start": (DagsterEventType.STEP_START, "load"),
    "after_commit": (DagsterEventType.ASSET_MATERIALIZATION, None),
}
"""Kill points right after an event of the run: its type, and the op of its step."""
KILL_POINTS = ("extract", "landed", "transform", "load", "load_mid", *EVENTS, "between",
               "random")
RUN_KILL_POINTS = (*EVENTS, "between", "random")
"""Kill points of ranged runs and re-executions: they watch no one partition's landing or lock."""
CRASH_POINTS = ("extract", "landed", "transform", *EVENTS, "between", "random")
"""Where the warehouse may crash instead of the run being killed: not inside the load, where the
suite itself holds a connection to the warehouse."""
WAREHOUSE_CRASH_SHARE = 0.3
"""Scenarios whose first kill is a crash of the warehouse instead (``pg_ctl -m immediate``, back
1-4 s later, far within the warehouse's outage budget): every run rides it out, warm and
``dagster job execute`` alike, and a run that fails on it is a finding whatever the data ends
as. Decided apart from the scenario's other choices."""


class ParserKills:
    """Kills and warehouse crashes, for :class:`.scenarios.ChaosSuite`: it counts into the
    suite's totals and notes the scenario's killed runs for the liveness check."""
    def _kill_at(self, rng: random.Random, handle: RunHandle, point: str) -> bool:
        if point in ("load", "load_mid"):
            startup = 30 if handle.kind == "cli" else 10
            return self._kill_in_load(rng, handle, point, startup)
        return self._deliver(handle, point) if self._reach(rng, handle, point) else False

    def _crash_warehouse_at(self, rng: random.Random, handle: RunHandle,
                            point: str) -> float | None:
        """Crash the warehouse server once the run reaches ``point``, and start it again 1-4 s
        later; how long it was down, or None if the run ended first."""
        if not self._reach(rng, handle, point):
            return None
        seconds = rng.uniform(1.0, 4.0)
        self.env.postgres.down_for(seconds)
        self.totals.warehouse_crashes[point] += 1
        return seconds

    def _judge_the_crash(self, partition: str, seconds: float, handles: list[RunHandle],
                         statuses: list[DagsterRunStatus | None]) -> None:
        """A fault shorter than its budget is ridden out: a run (not killed) that failed on the
        warehouse's crash is a finding, whatever the data (its re-runs settle that)."""
        budget = budget_seconds(Store.WAREHOUSE)
        for handle, status in zip(handles, statuses, strict=True):
            if handle.killed or status == DagsterRunStatus.SUCCESS or seconds >= budget:
                continue
            failure = self.env.failure_on_the_warehouse(handle)
            if failure:
                self.totals.failed_within_budget += 1
                self._fail(f"a {handle.kind} run of {partition} failed on a warehouse crash of "
                           f"{seconds:.1f} s, within the {budget:.0f} s it rides out: {failure}; "
                           f"see {handle.log_path}")

    def _reach(self, rng: random.Random, handle: RunHandle, point: str) -> bool:
        """Wait until the run is at ``point`` (not one inside the load); False if it ended
        or never got there."""
        env = self.env
        startup = 30 if handle.kind == "cli" else 10
        if point == "extract":
            reached = wait_until(lambda: env.has_event(
                handle, DagsterEventType.STEP_START, f"{SOURCE}.extract_"), handle, startup)
            if reached:
                time.sleep(rng.uniform(0.05, 0.5))
        elif point in ("landed", "transform"):
            reached = wait_until(lambda: env.landed_by(handle), handle, startup, 0.003)
            if reached and point == "transform":
                time.sleep(rng.uniform(0, 0.03))
        elif point in EVENTS or point == "between":
            event_type, op = EVENTS[rng.choice(list(EVENTS)) if point == "between" else point]
            step = f"{SOURCE}.{op}_" if op else None
            reached = wait_until(lambda: env.has_event(handle, event_type, step), handle,
                                 startup, 0.005)
            if reached and point == "between":
                time.sleep(rng.uniform(0, 0.05))
        else:
            delay = rng.uniform(0, 4.0 if handle.kind == "cli" else 1.0)
            wait_until(lambda: False, handle, delay, 0.02)  # the delay, or the run's end
            reached = handle.alive()
        return reached

    def _kill_in_load(self, rng: random.Random, handle: RunHandle, point: str,
                      startup: float) -> bool:
        table_key, partition_key = partition_lock_keys(TABLE, handle.partition)
        with psycopg.connect(self.env.postgres.dsn(self.env.database),
                             autocommit=True) as holder:
            holder.execute("SELECT pg_advisory_lock(%s, %s)", (table_key, partition_key))
            try:
                reached = wait_until(lambda: a_load_waits_for_a_lock(holder), handle, startup, 0.01)
                if reached and point == "load":
                    return self._deliver(handle, point)
            finally:
                holder.execute("SELECT pg_advisory_unlock(%s, %s)", (table_key, partition_key))
            if reached:
                time.sleep(rng.uniform(0, 0.02))
                return self._deliver(handle, point)
        return False

    def _deliver(self, handle: RunHandle, point: str) -> bool:
        if not handle.kill():
            return False
        self.totals.kills[point] += 1
        self._killed_in_scenario = True
        self._killed_runs += [run_id for run_id in [self.env.run_id_of(handle)] if run_id]
        self._probe = None
        if handle.kind == "cli":
            self.totals.cli_kills += 1
            self._cli_kill_in_scenario = True
        return True
