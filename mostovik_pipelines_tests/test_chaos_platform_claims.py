"""A short fixed-seed run of the platform suite's faults of one run's own claim and settings
(``make chaos`` draws them among the others): a holder's claim connection cut while a second run
of its partition starts (as root, for ``ss -K``), and runs started with a wrong run storage
password or database name."""

from __future__ import annotations

import os

import pytest

from mostovik_pipelines_tests.chaos.environment import ChaosEnvironment
from mostovik_pipelines_tests.chaos.platform import PlatformEnvironment, PlatformSuite
from mostovik_pipelines_tests.conftest import TEMPLATE_DB

SEED = 20261207
SCENARIOS = ("claim_cut", "wrong_setting", "wrong_setting")
"""The seed draws the password for the first wrong setting and the database for the second."""

pytestmark = [pytest.mark.slow, pytest.mark.postgres]


@pytest.mark.timeout(1500)
def test_a_cut_claim_and_a_wrong_setting_leave_each_partition_exact_and_nothing_stuck(
    postgres, standin_server
):
    kinds = [k for k in SCENARIOS if k != "claim_cut" or os.geteuid() == 0]
    chaos = ChaosEnvironment(postgres=postgres, standin_server=standin_server,
                             template=TEMPLATE_DB)
    lines: list[str] = []
    try:
        platform = PlatformEnvironment(chaos)
        try:
            suite = PlatformSuite(platform, SEED, log=lines.append)
            for number, kind in enumerate(kinds, 1):
                suite.scenario(number, kind)
        finally:
            platform.close()
    finally:
        chaos.standin.clear_faults()
        chaos.standin.reset_cbr_rates()
        chaos.close()
    totals = suite.totals
    assert totals.scenarios == len(kinds), lines
    assert set(totals.faults) == set(kinds)
    assert totals.failures == [], "\n".join(lines)
    assert (totals.failed_runs, totals.not_once, totals.left_unfinished, totals.differences,
            totals.duplicates) == (0, 0, 0, 0, 0)
    if "claim_cut" in kinds:
        assert totals.runs >= 2, "both runs of the cut claim recorded"
