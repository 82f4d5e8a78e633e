"""A short, fixed-seed run of the chaos suite (``make chaos`` runs the long one): randomized
kills, faults, duplicates and re-runs, after which every partition must equal a clean run's."""

from __future__ import annotations

import pytest

from mostovik_pipelines.standin import StandinClient
from mostovik_pipelines_tests.chaos import run_chaos
from mostovik_pipelines_tests.chaos.environment import ChaosEnvironment
from mostovik_pipelines_tests.conftest import TEMPLATE_DB

SEED = 20261108
SCENARIOS = 20


@pytest.fixture
def chaos_env(postgres, standin_server):
    env = ChaosEnvironment(postgres=postgres, standin_server=standin_server, template=TEMPLATE_DB)
    yield env
    client = StandinClient(standin_server.url)
    client.clear_faults()
    client.reset_cbr_rates()
    env.close()


@pytest.mark.slow
def test_after_kills_faults_duplicates_and_reruns_the_data_equals_one_clean_run(chaos_env):
    totals = run_chaos(chaos_env, SEED, SCENARIOS, cli_share=0.15)
    assert totals.scenarios == SCENARIOS
    assert sum(totals.kills.values()) >= SCENARIOS // 3
    assert totals.cli_kills >= 1, "no `dagster job execute` process was killed"
    assert totals.differences == 0, "\n".join(totals.failures)
    assert totals.duplicates == 0, "\n".join(totals.failures)
    assert totals.failures == []
