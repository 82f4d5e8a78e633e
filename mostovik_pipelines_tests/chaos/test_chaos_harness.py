"""The one harness of the chaos suites, and the table ``make chaos`` judges by: a killed run is
either recorded as failed or left "started" on purpose, and any other unfinished run counts as
stuck; a finding under any fault fails the table."""

from __future__ import annotations

import pytest
from dagster import DagsterRunStatus

from mostovik_pipelines_tests.chaos.environment import ChaosEnvironment
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
