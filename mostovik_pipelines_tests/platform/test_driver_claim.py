"""The driver claim, on both run storages: held by the process driving a run with the run's
claim, it dies with that process even while a step the process left elsewhere (a Celery
worker) goes on holding the run's claim."""

from __future__ import annotations

import os
import signal

from dagster import DagsterInstance

from mostovik_pipelines.platform.claims import (
    driver_claim_held,
    hold_driver_claim,
    hold_run_claim,
    run_claim_held,
)
from mostovik_pipelines_tests.support.processes import claim_holder
from mostovik_pipelines_tests.support.waiting import wait_until


def test_the_driver_claim_dies_with_its_driver_while_a_step_elsewhere_holds_the_run_claim(
        dagster_home):
    driver = claim_holder(dagster_home, "run-c", driver=True)
    with DagsterInstance.from_config(dagster_home) as instance:
        assert run_claim_held(instance, "run-c") and driver_claim_held(instance, "run-c")
        # A step on a worker: the run's claim only.
        with hold_run_claim(instance, "run-c"):
            os.kill(driver.pid, signal.SIGKILL)
            driver.join(30)
            wait_until(lambda: not driver_claim_held(instance, "run-c"), 10,
                       "the driver claim free once its driver is killed")
            assert run_claim_held(instance, "run-c")
        assert not run_claim_held(instance, "run-c")


def test_a_step_alone_holds_no_driver_claim_and_a_driver_holds_both(dagster_home):
    with DagsterInstance.from_config(dagster_home) as instance:
        with hold_run_claim(instance, "run-s"):
            assert run_claim_held(instance, "run-s")
            assert not driver_claim_held(instance, "run-s")
        with hold_driver_claim(instance, "run-s"), hold_run_claim(instance, "run-s"):
            assert run_claim_held(instance, "run-s") and driver_claim_held(instance, "run-s")
        assert not run_claim_held(instance, "run-s")
        assert not driver_claim_held(instance, "run-s")
