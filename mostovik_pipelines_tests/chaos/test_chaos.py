"""A short, fixed-seed run of the chaos suite (``make chaos`` runs the long one): randomized
kills, warehouse crashes, faults, duplicates, re-runs, ranged runs and re-executions of older
runs, after which every
partition must equal its expected state and no dead run may hold a partition."""

from __future__ import annotations

import random
import threading
import time

import psycopg
import pytest

from mostovik_pipelines.framework.quality.quarantine import replace_quarantine
from mostovik_pipelines.framework.spec import RejectedRow
from mostovik_pipelines.resources.warehouse import warehouse_engine
from mostovik_pipelines.standin import StandinClient
from mostovik_pipelines_tests.chaos import run_chaos
from mostovik_pipelines_tests.chaos.environment import ChaosEnvironment
from mostovik_pipelines_tests.chaos.parser_source import CODES, UNREADABLE_VALUES, SourceModel
from mostovik_pipelines_tests.conftest import TEMPLATE_DB
from mostovik_pipelines_tests.support.postgres import dsn_of

SEED = 20261108
SCENARIOS = 12


@pytest.fixture
def chaos_env(postgres, standin_server):
    env = ChaosEnvironment(postgres=postgres, standin_server=standin_server, template=TEMPLATE_DB)
    yield env
    client = StandinClient(standin_server.url)
    client.clear_faults()
    client.reset_cbr_rates()
    env.close()


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_after_kills_faults_duplicates_reruns_and_reexecutions_the_data_is_as_expected(chaos_env):
    totals = run_chaos(chaos_env, SEED, SCENARIOS, cli_share=0.15)
    assert totals.scenarios == SCENARIOS
    assert sum(totals.kills.values()) >= SCENARIOS // 3
    assert totals.kills["run_start"] >= 1, "no run was killed before its first step"
    assert totals.cli_kills >= 1, "no `dagster job execute` process was killed"
    assert sum(totals.warehouse_crashes.values()) >= 1, "the warehouse never crashed"
    assert totals.reexecutions_of_older_runs >= 1, "no older run was re-executed"
    assert totals.ranged_failed_partitions >= 1, "no ranged run had a failing partition"
    assert totals.differences == 0, "\n".join(totals.failures)
    assert totals.duplicates == 0, "\n".join(totals.failures)
    assert totals.blocked == 0, "\n".join(totals.failures)
    assert totals.failures == []


def test_the_source_model_keeps_each_date_loadable_and_reports_its_unreadable_currency():
    """What the judge's kept rows rest on: a change says exactly when a currency turns
    unreadable, stays unreadable with another value, or is readable (or gone) again."""
    model, rng, day = SourceModel(), random.Random(5), "2026-11-20"
    values: dict[str, str] = {}
    removed: set[str] = set()
    seen = set()
    for _ in range(400):
        before = model.bad.get(day)
        change = model.random_change(rng, day, force_unreadable=rng.random() < 0.3)
        values.update(change.values)
        removed.update(change.remove)
        unreadable = {c for c in CODES if c not in removed and values.get(c) in UNREADABLE_VALUES}
        after = model.bad.get(day)
        assert len(removed) <= 2
        assert unreadable == ({after} if after else set())
        assert change.readable_again == (before if before is not None and after != before
                                         else None)
        assert change.unreadable is None or change.unreadable == after != before
        if before is not None and before == after:
            assert change.again == (before in change.values)
        else:
            assert not change.again
        seen.update(k for k in ("unreadable", "readable_again", "again") if getattr(change, k))
    assert seen == {"unreadable", "readable_again", "again"}


def test_two_loads_replacing_one_partitions_quarantine_at_once_keep_each_row_once(
    pg_warehouse_url
):
    """The moment two runs of one partition meet after their loads: both replace the partition's
    quarantine at once. (Found by this suite: the quarantine was replaced without a lock, and
    each run kept its own copy of the rejected row.)"""
    engine = warehouse_engine(pg_warehouse_url)
    rejected = [RejectedRow(3, "<Valute>...</Valute>", "Value 'n/a' is not a decimal")]
    replace_quarantine(engine, "cbr_daily_rates", "2026-11-04", "run-0", rejected)
    dsn = dsn_of(pg_warehouse_url)
    with psycopg.connect(dsn) as blocker, psycopg.connect(dsn, autocommit=True) as observer:
        # Hold the stored row so that both replacements are under way at once: inside their
        # DELETE, or one of them waiting for the other's lock.
        blocker.execute("SELECT 1 FROM quarantined_rows FOR UPDATE")
        runs = [threading.Thread(target=replace_quarantine, args=(
            engine, "cbr_daily_rates", "2026-11-04", run_id, rejected)) for run_id in "AB"]
        for run in runs:
            run.start()
        deadline = time.monotonic() + 30
        while observer.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
            "AND datname = current_database()").fetchone()[0] < 2:
            assert time.monotonic() < deadline, "the replacements never met"
            time.sleep(0.02)
        blocker.rollback()
        for run in runs:
            run.join(30)
        kept = observer.execute(
            "SELECT run_id FROM quarantined_rows WHERE partition_key = '2026-11-04'").fetchall()
    assert len(kept) == 1, f"the partition's one rejected row is kept {len(kept)} times: {kept}"
