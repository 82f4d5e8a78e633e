"""A run's claim is held exactly while a live process holds it, on both run storages, and dies
with the process that held it."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time

import pytest
from dagster import DagsterInstance

from mostovik_pipelines.etl.run_claims import hold_run_claim, run_claim_held
from mostovik_pipelines_tests.support.processes import local_dagster_home


@pytest.fixture(params=["sqlite", "postgres"])
def home(request, tmp_path, monkeypatch):
    if request.param == "sqlite":
        return str(local_dagster_home(tmp_path))
    home, environment = request.getfixturevalue("production_home")
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    return str(home)


def test_the_postgresql_run_storage_still_tells_its_url(production_home, monkeypatch):
    """run_claims reads ``run_storage.postgres_url``, an attribute of dagster-postgres' run
    storage, not a documented API: pinned here."""
    home, environment = production_home
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    with DagsterInstance.from_config(str(home)) as instance:
        assert instance.run_storage.postgres_url.startswith("postgresql")


def test_a_claim_is_held_while_held_and_nested_holders_share_it(home):
    with DagsterInstance.from_config(home) as instance:
        assert not run_claim_held(instance, "run-a")
        with hold_run_claim(instance, "run-a"):
            with hold_run_claim(instance, "run-a"):
                assert run_claim_held(instance, "run-a")
            assert run_claim_held(instance, "run-a")
            assert not run_claim_held(instance, "run-b")
        assert not run_claim_held(instance, "run-a")


def _hold_forever(home: str, ready) -> None:
    with DagsterInstance.from_config(home) as instance, hold_run_claim(instance, "run-k"):
        ready.set()
        signal.pause()


def test_a_claim_dies_with_its_process(home):
    context = multiprocessing.get_context("spawn")
    ready = context.Event()
    holder = context.Process(target=_hold_forever, args=(home, ready), daemon=True)
    holder.start()
    assert ready.wait(60)
    with DagsterInstance.from_config(home) as instance:
        assert run_claim_held(instance, "run-k")
        os.kill(holder.pid, signal.SIGKILL)
        holder.join(30)
        # PostgreSQL ends the session as soon as the socket closes; poll briefly for it.
        for _ in range(100):
            if not run_claim_held(instance, "run-k"):
                break
            time.sleep(0.05)
        assert not run_claim_held(instance, "run-k")
