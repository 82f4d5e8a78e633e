"""A run's claim is held exactly while a live process holds it, on both run storages, and dies
with the process that held it."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import psycopg
import pytest
from dagster import DagsterInstance

from mostovik_pipelines.platform.claims import (
    KEEPER_CHECK_SECONDS,
    RECONNECT_SECONDS,
    _postgres_dsn,
    hold_run_claim,
    run_claim_held,
)
from mostovik_pipelines_tests.support.instances import production_instance
from mostovik_pipelines_tests.support.postgres import ThrowawayPostgres
from mostovik_pipelines_tests.support.processes import claim_holder
from mostovik_pipelines_tests.support.waiting import wait_until


def test_the_postgresql_run_storage_still_tells_its_url(production_home, monkeypatch):
    """run_claims reads ``run_storage.postgres_url``, an attribute of dagster-postgres' run
    storage, not a documented API: pinned here."""
    home, environment = production_home
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    with DagsterInstance.from_config(str(home)) as instance:
        assert instance.run_storage.postgres_url.startswith("postgresql")


def test_a_claim_is_held_while_held_and_nested_holders_share_it(dagster_home):
    with DagsterInstance.from_config(dagster_home) as instance:
        assert not run_claim_held(instance, "run-a")
        with hold_run_claim(instance, "run-a"):
            with hold_run_claim(instance, "run-a"):
                assert run_claim_held(instance, "run-a")
            assert run_claim_held(instance, "run-a")
            assert not run_claim_held(instance, "run-b")
        assert not run_claim_held(instance, "run-a")


def test_a_claim_dies_with_its_process(dagster_home):
    holder = claim_holder(dagster_home, "run-k")
    with DagsterInstance.from_config(dagster_home) as instance:
        assert run_claim_held(instance, "run-k")
        os.kill(holder.pid, signal.SIGKILL)
        holder.join(30)
        # PostgreSQL ends the session as soon as the socket closes; poll briefly for it.
        for _ in range(100):
            if not run_claim_held(instance, "run-k"):
                break
            time.sleep(0.05)
        assert not run_claim_held(instance, "run-k")


def _claim_backends(instance: DagsterInstance) -> list[int]:
    """The sessions holding a claim (a shared advisory lock) on the run-storage database."""
    with psycopg.connect(_postgres_dsn(instance), autocommit=True) as connection:
        return [pid for (pid,) in connection.execute(
            "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND mode = 'ShareLock' "
            "AND granted AND database = (SELECT oid FROM pg_database "
            "WHERE datname = current_database())").fetchall()]


def test_a_claim_whose_connection_the_database_drops_is_taken_again(production_home,
                                                                     monkeypatch):
    """An administrator's pg_terminate_backend, a proxy or network cut that drops the session:
    the run lives on, so its claim must too."""
    home, environment = production_home
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    with (DagsterInstance.from_config(str(home)) as instance,
          hold_run_claim(instance, "run-d")):
        (backend,) = _claim_backends(instance)
        with psycopg.connect(_postgres_dsn(instance), autocommit=True) as connection:
            assert connection.execute("SELECT pg_terminate_backend(%s)", (backend,)).fetchone()[0]
        wait_until(lambda: (lambda pids: pids and pids != [backend])(_claim_backends(instance)),
                   KEEPER_CHECK_SECONDS + RECONNECT_SECONDS + 30, "the claim taken again")
        assert run_claim_held(instance, "run-d")
    with DagsterInstance.from_config(str(home)) as instance:
        assert not run_claim_held(instance, "run-d")  # released with its holder


@pytest.fixture
def restartable_run_storage(tmp_path, monkeypatch) -> Iterator[tuple[ThrowawayPostgres,
                                                                     DagsterInstance]]:
    """The production instance on a PostgreSQL of the test's own, which it may pause and
    resume (a restart), with the instance's environment set."""
    run_storage = ThrowawayPostgres().start()
    try:
        home, environment = production_instance(run_storage, "dagster_claims", tmp_path)
        for name, value in environment.items():
            monkeypatch.setenv(name, value)
        with DagsterInstance.from_config(str(home)) as instance:
            yield run_storage, instance
    finally:
        run_storage.stop()


def test_a_claim_is_taken_again_after_a_restart_and_trusted_free_only_after_the_grace(
    restartable_run_storage
):
    run_storage, instance = restartable_run_storage
    taken_at = time.time()
    with hold_run_claim(instance, "run-r"):
        run_storage.pause()
        run_storage.resume()
        # A claim taken before the restart and free now (its holder died, or has not
        # taken it again yet) counts as held within the grace; one taken after does not.
        assert run_claim_held(instance, "run-gone", taken_at=taken_at)
        assert not run_claim_held(instance, "run-gone", taken_at=time.time())
        wait_until(lambda: run_claim_held(instance, "run-r", taken_at=time.time()),
                   KEEPER_CHECK_SECONDS + RECONNECT_SECONDS + 30,
                   "the claim taken again after the restart")
    assert not run_claim_held(instance, "run-r", taken_at=time.time())


def test_a_claim_taken_while_the_database_is_away_is_held_once_it_answers(restartable_run_storage):
    """A step that starts while the run storage restarts (its storage calls ride the outage
    out): taking its claim must not fail the step; it is held as soon as the database answers.
    make chaos found a step failed by it (platform seed 7, scenario 1)."""
    run_storage, instance = restartable_run_storage
    _postgres_dsn(instance)  # the instance's storage, built while the database is up
    run_storage.pause()
    with hold_run_claim(instance, "run-a"):
        run_storage.resume()
        wait_until(lambda: run_claim_held(instance, "run-a", taken_at=time.time()),
                   KEEPER_CHECK_SECONDS + RECONNECT_SECONDS + 30,
                   "the claim taken once the database answers")
    assert not run_claim_held(instance, "run-a", taken_at=time.time())
