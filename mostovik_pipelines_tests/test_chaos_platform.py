"""A short fixed-seed run of the chaos suite's faults of the parts we stand on (``make chaos``
runs the long one): the warehouse, the run storage, the broker, the daemon and (as root) the
landing disk, each brought down under runs launched from the UI of the production deployment,
then a run's claim connection cut (as root) and a run with a wrong run storage setting;
every run must ride it out, each partition materialised once and exact."""

from __future__ import annotations

import os

import pytest

from mostovik_pipelines_tests.chaos.platform import KINDS, LONG_KINDS, run_platform_chaos
from mostovik_pipelines_tests.conftest import TEMPLATE_DB
from mostovik_pipelines_tests.support.disk import why_no_small_disk

SEED = 20261202
OUTAGE_SECONDS = (3.0, 12.0)

pytestmark = [pytest.mark.slow, pytest.mark.postgres]


@pytest.mark.timeout(1500)
def test_each_part_we_stand_on_restarted_under_live_runs_is_ridden_out_to_exact_data(
    postgres, standin_server
):
    # The run storage away past the budget (over 90 s) is make chaos's; make test has it on
    # `dagster job execute` (test_production_instance.py).
    kinds = [kind for kind in KINDS if (kind != "disk_full" or why_no_small_disk() is None)
             and (kind != "claim_cut" or os.geteuid() == 0) and kind not in LONG_KINDS]
    totals = run_platform_chaos(postgres, standin_server, SEED, len(kinds),
                                outage_seconds=OUTAGE_SECONDS, template=TEMPLATE_DB,
                                long_faults=False)
    assert totals.scenarios == len(kinds)
    assert set(totals.faults) == set(kinds), totals.faults
    if "disk_full" in kinds:
        assert totals.disk_full_hits >= 1, "no write met the full disk"
    assert totals.failed_runs == 0, "\n".join(totals.failures)
    assert totals.not_once == 0, "\n".join(totals.failures)
    assert totals.left_unfinished == 0, "\n".join(totals.failures)
    assert totals.differences == 0, "\n".join(totals.failures)
    assert totals.duplicates == 0, "\n".join(totals.failures)
    assert totals.failures == []
