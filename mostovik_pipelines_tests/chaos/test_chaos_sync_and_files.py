"""Short fixed-seed runs of the reliability suites of the sync and file kinds (the long ones:
``python -m mostovik_pipelines_tests.chaos.sync_scenarios`` and ``.file_scenarios``): after
kills, faults, duplicates, resumes and re-uploads, the ERP table equals the source's oracle and
every delivery report's rows are those of its newest loadable version."""

from __future__ import annotations

import pytest

from mostovik_pipelines_tests.chaos.file_scenarios import run_file_chaos
from mostovik_pipelines_tests.chaos.sync_scenarios import run_sync_chaos
from mostovik_pipelines_tests.conftest import TEMPLATE_DB

SYNC_SEED = 20261201
FILE_SEED = 20261202
SCENARIOS = 10


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_after_kills_faults_duplicates_and_resumes_the_synced_windows_equal_the_source(
    postgres, standin_server
):
    totals = run_sync_chaos(postgres, standin_server, SYNC_SEED, SCENARIOS, windows=3,
                            records=(150, 500), cli_share=0.1, max_steps=2,
                            template=TEMPLATE_DB)
    assert totals.scenarios == SCENARIOS
    assert sum(totals.kills.values()) >= 1, "no run was killed"
    assert totals.resumes_checked >= 1, "no re-run resumed from a checkpoint"
    assert totals.differences == 0, "\n".join(totals.failures)
    assert totals.duplicates == 0, "\n".join(totals.failures)
    assert totals.failures == []


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_after_kills_duplicates_and_racing_re_uploads_each_file_holds_its_newest_version(
    postgres
):
    totals = run_file_chaos(postgres, FILE_SEED, SCENARIOS, lines=(15, 40), cli_share=0.1,
                            reverts=True, template=TEMPLATE_DB)
    assert totals.scenarios == SCENARIOS
    assert sum(totals.kills.values()) >= 1, "no run was killed"
    assert sum(totals.reupload_races.values()) >= 1, "no re-upload raced a run"
    assert totals.differences == 0, "\n".join(totals.failures)
    assert totals.duplicates == 0, "\n".join(totals.failures)
    assert totals.failures == []
