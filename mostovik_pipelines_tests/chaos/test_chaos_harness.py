"""The one harness of the chaos suites, and the table ``make chaos`` judges by: a killed run is
either recorded as failed or left "started" on purpose, and any other unfinished run counts as
stuck; a finding under any fault fails the table."""

from __future__ import annotations

import re

import pytest
from dagster import DagsterRunStatus

from mostovik_pipelines_tests.chaos import __main__ as chaos_main
from mostovik_pipelines_tests.chaos.environment import ChaosEnvironment
from mostovik_pipelines_tests.chaos.outage_cases import MARKER, TESTS
from mostovik_pipelines_tests.chaos.tally import ALL, Tally
from mostovik_pipelines_tests.conftest import TEMPLATE_DB
from mostovik_pipelines_tests.support.waiting import PROCESS_START_MARGIN_SECONDS, wait_until

PARTITION = "2026-11-05"


@pytest.mark.postgres
def test_a_killed_run_is_stuck_until_recorded_failed_or_left_started_on_purpose(
        postgres, standin_server, standin):
    standin.fault("hang", seconds=300, match="date_req=05/11/2026")
    env = ChaosEnvironment(postgres, standin_server, template=TEMPLATE_DB)
    try:
        handles = [env.start_warm(PARTITION), env.start_warm(PARTITION)]
        for handle in handles:
            wait_until(lambda h=handle: env.status_of(h) == DagsterRunStatus.STARTED,
                       PROCESS_START_MARGIN_SECONDS, "a warm run started")
        left, failed = handles
        for handle in handles:
            assert handle.kill()
            handle.wait(timeout=30)
        assert sorted(env.stuck_runs()) == sorted(env.run_id_of(h) for h in handles)

        env.leave_started(left)
        env.mark_dead_run_failed(failed)
        assert env.stuck_runs() == []
        assert env.status_of(left) == DagsterRunStatus.STARTED
        assert env.status_of(failed) == DagsterRunStatus.FAILURE
    finally:
        standin.release_hangs()
        env.close()


def test_the_table_counts_a_scenario_once_per_fault_and_fails_on_any_finding():
    tally = Tally()
    tally.record("sync", {"kill at committed", "source 429"})
    tally.record("sync", set())
    assert not tally.failed()
    tally.record("file", {"kill at load"}, stuck=1)
    tally.settle("parser", "final sweep", differences=2)

    assert tally.lines[("sync", ALL)]["scenarios"] == 2
    assert tally.lines[("sync", "kill at committed")]["scenarios"] == 1
    assert tally.lines[("sync", "none")]["scenarios"] == 1
    assert tally.lines[("file", "kill at load")]["stuck"] == 1
    assert tally.lines[("parser", "final sweep")]["differences"] == 2
    assert tally.failed()
    table = tally.table()
    assert "kill at committed" in table and "all kinds" in table


LONG_OUTAGE_CASES = {
    "core/test_retries.py::test_a_warehouse_outage_of_a_minute_at_the_start_of_a_run_is_"
    "ridden_out",
    "system/daemon/test_run_storage_outage_while_queued.py::test_a_run_storage_outage_of_60_s_as_the_daemon_"
    "launches_a_queued_run_is_ridden_out",
    "system/deployments/test_production_instance.py::test_a_run_storage_restart_under_a_live_run_is_ridden_out_"
    "and_lets_no_duplicate_in",
    "system/deployments/test_production_instance.py::test_a_run_storage_away_past_the_90_s_budget_under_a_live_"
    "run_fails_it_writing_nothing",
    "system/deployments/test_celery_deployment.py::test_a_broker_crash_while_steps_run_and_wait_on_celery_fails_"
    "no_run_and_loses_no_step",
}


def test_every_make_chaos_runs_the_long_outage_cases_that_make_test_leaves_out():
    """The 60 s and past-budget outage cases are ``make chaos``'s: its default run includes the
    ``outages`` suite, which selects exactly these by their marker, and ``make test`` leaves
    out only that marker."""
    assert "outages" in chaos_main.parse([]).suites
    marked = set()
    for path in TESTS.rglob("test_*.py"):
        lines = path.read_text().splitlines()
        for number, line in enumerate(lines):
            if line.strip() == f"@pytest.mark.{MARKER}":
                name = next(re.match(r"def (\w+)\(", later).group(1)
                            for later in lines[number + 1:] if later.startswith("def "))
                marked.add(f"{path.relative_to(TESTS)}::{name}")
    assert marked == LONG_OUTAGE_CASES
    makefile = (TESTS.parent / "Makefile").read_text()
    test_target = makefile.split("\ntest:", 1)[1].split("\n\n", 1)[0]
    assert f"-m 'not {MARKER}'" in test_target
