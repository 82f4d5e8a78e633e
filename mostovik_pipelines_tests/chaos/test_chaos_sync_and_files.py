"""Short fixed-seed runs of the reliability suites of the sync and file kinds (the long ones:
``python -m mostovik_pipelines_tests.chaos.sync_scenarios`` and ``.file_scenarios``): after
kills, faults, duplicates, resumes and re-uploads, the ERP table equals the source's oracle and
every delivery report's rows are those of its newest loadable version."""

from __future__ import annotations

import random
from datetime import date, timedelta
from urllib.parse import parse_qs

import pytest

from mostovik_pipelines.standin import StandinClient
from mostovik_pipelines_tests.chaos.file_scenarios import run_file_chaos
from mostovik_pipelines_tests.chaos.sync_judge import token_cursor
from mostovik_pipelines_tests.chaos.sync_scenarios import SyncSuite, run_sync_chaos, sync_workspace
from mostovik_pipelines_tests.chaos.sync_source import EPOCH, instant
from mostovik_pipelines_tests.conftest import TEMPLATE_DB
from mostovik_pipelines_tests.support.waiting import (
    PROCESS_START_MARGIN_SECONDS,
    wait_for_hanging_request,
    wait_until,
)

SYNC_SEED = 20261201
FILE_SEED = 20261202
SYNC_SCENARIOS = 7
FILE_SCENARIOS = 10


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_after_kills_faults_duplicates_and_resumes_the_synced_windows_equal_the_source(
    postgres, standin_server
):
    totals = run_sync_chaos(postgres, standin_server, SYNC_SEED, SYNC_SCENARIOS, windows=3,
                            records=(150, 500), cli_share=0.1, max_steps=2,
                            template=TEMPLATE_DB)
    assert totals.scenarios == SYNC_SCENARIOS
    assert sum(totals.kills.values()) >= 1, "no run was killed"
    assert totals.resumes_checked >= 1, "no re-run resumed from a checkpoint"
    assert totals.differences == 0, "\n".join(totals.failures)
    assert totals.duplicates == 0, "\n".join(totals.failures)
    assert totals.failures == []


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_sync_suite_stamps_changes_after_the_pages_a_killed_run_landed(
    postgres, standin_server
):
    """A `dagster job execute` run of a window killed in its extract, pages 1-2 of 3 landed and
    none committed; the suite's source changes (tombstones, restores, late updates) and its
    settling runs. The next run takes the landed pages up instead of asking again (a killed
    window resumes after its last landed page), so a change is stamped after their last item,
    as a real clock would: a change stamped among them is a history no ERP can write, and the
    judge then blames the sync for a version it could never have been sent (seed 1465361718
    found it: a tombstone at 12:43 behind a killed run's page 11 of 2026-11-30)."""
    workspace = sync_workspace(postgres, standin_server, TEMPLATE_DB)
    standin = StandinClient(standin_server.url)
    try:
        suite = SyncSuite(workspace, standin, 7, windows=2, records=(300, 300),
                          today=date(2026, 11, 20), log=lambda _line: None)
        window = suite.windows[-1]
        start, end = suite.bounds[window]
        match = f"updated_to={(date.fromisoformat(window) + timedelta(days=1)).isoformat()}"
        standin.fault("hang", route="erp", page=3, seconds=300, match=match)
        doomed = suite._start(window, cli=True)
        [held] = wait_for_hanging_request(standin, match)
        wait_until(lambda: suite._landed_by(doomed, window) >= 2, PROCESS_START_MARGIN_SECONDS,
                   "pages 1-2 landed")
        assert doomed.kill()
        standin.release_hangs()
        rng = random.Random(7)
        suite._book(window, [doomed], [workspace.finish(doomed, rng)], None, 0.0, [])
        cursor = token_cursor(parse_qs(held["query"])["page_token"][0])
        read_up_to = EPOCH + timedelta(microseconds=cursor[0])  # page 2's last item

        before = {item["id"]: item for item in standin.erp_window_state(start, end)}
        suite._read_records()
        for round_ in range(30):
            suite._change_source(random.Random(round_), [])
        changed = {item["id"]: instant(item["updated_at"])
                   for item in standin.erp_window_state(start, end)
                   if before.get(item["id"], {}).get("version") != item["version"]}
        assert changed, "no change was stamped in the killed run's window"
        behind = {key: moment for key, moment in changed.items() if moment <= read_up_to}
        assert not behind, f"changes stamped among the landed pages (up to {read_up_to}): "\
                           f"{sorted(behind.items())[:3]}"

        standin.forget_requests()
        suite._settle(rng, [])
        asked = [request["page"] for request in standin.requests("erp")
                 if match in request["query"]]
        assert asked and min(asked) == 3, f"the settling run asked for pages {asked}"
        assert suite._judge() == []
        assert suite.totals.failures == []
    finally:
        standin.clear_faults()
        standin.reset_erp()
        workspace.close()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_after_kills_duplicates_and_racing_re_uploads_each_file_holds_its_newest_version(
    postgres
):
    totals = run_file_chaos(postgres, FILE_SEED, FILE_SCENARIOS, lines=(15, 40), cli_share=0.1,
                            reverts=True, template=TEMPLATE_DB)
    assert totals.scenarios == FILE_SCENARIOS
    assert sum(totals.kills.values()) >= 1, "no run was killed"
    assert sum(totals.reupload_races.values()) >= 1, "no re-upload raced a run"
    assert totals.differences == 0, "\n".join(totals.failures)
    assert totals.duplicates == 0, "\n".join(totals.failures)
    assert totals.failures == []
