"""The driver claim, on both run storages: held by the process driving a run with the run's
claim, it dies with that process even while a step the process left elsewhere (a Celery
worker) goes on holding the run's claim."""

from __future__ import annotations

import multiprocessing
import os
import signal

import pytest
from dagster import DagsterInstance

from mostovik_pipelines.framework.runs.claims import (
    driver_claim_held,
    hold_driver_claim,
    hold_run_claim,
    run_claim_held,
)
from mostovik_pipelines_tests.support.processes import local_dagster_home
from mostovik_pipelines_tests.support.waiting import wait_until


@pytest.fixture(params=["sqlite", "postgres"])
def home(request, tmp_path, monkeypatch):
    if request.param == "sqlite":
        return str(local_dagster_home(tmp_path))
    home, environment = request.getfixturevalue("production_home")
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    return str(home)


def _drive_forever(home: str, ready) -> None:
    with DagsterInstance.from_config(home) as instance, hold_driver_claim(instance, "run-c"):
        ready.set()
        signal.pause()


def test_the_driver_claim_dies_with_its_driver_while_a_step_elsewhere_holds_the_run_claim(home):
    context = multiprocessing.get_context("spawn")
    ready = context.Event()
    driver = context.Process(target=_drive_forever, args=(home, ready), daemon=True)
    driver.start()
    assert ready.wait(60)
    with DagsterInstance.from_config(home) as instance:
        assert run_claim_held(instance, "run-c") and driver_claim_held(instance, "run-c")
        # A step on a worker: the run's claim only.
        with hold_run_claim(instance, "run-c"):
            os.kill(driver.pid, signal.SIGKILL)
            driver.join(30)
            wait_until(lambda: not driver_claim_held(instance, "run-c"), 10,
                       "the driver claim free once its driver is killed")
            assert run_claim_held(instance, "run-c")
        assert not run_claim_held(instance, "run-c")


def test_a_step_alone_holds_no_driver_claim_and_a_driver_holds_both(home):
    with DagsterInstance.from_config(home) as instance:
        with hold_run_claim(instance, "run-s"):
            assert run_claim_held(instance, "run-s")
            assert not driver_claim_held(instance, "run-s")
        with hold_driver_claim(instance, "run-s"), hold_run_claim(instance, "run-s"):
            assert run_claim_held(instance, "run-s") and driver_claim_held(instance, "run-s")
        assert not run_claim_held(instance, "run-s")
        assert not driver_claim_held(instance, "run-s")
