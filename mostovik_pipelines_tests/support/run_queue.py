"""The daemon that launches queued runs, for tests of a local instance: what an operator's
``mostovik jobs rerun`` needs to see its run start; and the runs its run retries make."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from dagster import DagsterInstance, DagsterRun, RunsFilter

from mostovik_pipelines.core.tags import REASON_TAG, REQUESTED_BY_TAG
from mostovik_pipelines.maintenance.job import PRUNE_SCHEDULE
from mostovik_pipelines.sources import ALL_SOURCES
from mostovik_pipelines_tests.support.graphql import RUN_LIMIT_SECONDS
from mostovik_pipelines_tests.support.waiting import wait_until
from mostovik_pipelines_tests.support.webserver import DagsterServices

EVERY_SCHEDULE = [PRUNE_SCHEDULE, *(f"{spec.name}_schedule" for spec in ALL_SOURCES
                                    if spec.schedule)]


@contextmanager
def run_queue_daemon(environment: Mapping[str, str], work_dir: Path) -> Iterator[DagsterServices]:
    """``dagster-daemon`` (and the webserver that stops the schedules first, so that only the
    test's runs start) on the instance of ``environment["DAGSTER_HOME"]``, for the ``with``
    block."""
    work_dir.mkdir(parents=True, exist_ok=True)
    services = DagsterServices(work_dir, Path(environment["DAGSTER_HOME"]), environment,
                               stopped_schedules=EVERY_SCHEDULE)
    with services as running:
        yield running


def retries_of(instance: DagsterInstance, run_id: str) -> list[DagsterRun]:
    """The runs the daemon's run retries made of ``run_id``."""
    return instance.get_runs(RunsFilter(tags={"dagster/parent_run_id": run_id}))


def the_one_retry(services: DagsterServices, instance: DagsterInstance, run_id: str,
                  signature: tuple[str, str]) -> DagsterRun:
    """The daemon's retry of the failed run ``run_id``, once it has succeeded: its first retry,
    carrying the run's signature (who asked, and why)."""
    [retry] = wait_until(lambda: retries_of(instance, run_id), RUN_LIMIT_SECONDS,
                         f"the daemon's retry of {run_id}", services.log_tails)
    assert retry.tags["dagster/retry_number"] == "1"
    assert (retry.tags[REQUESTED_BY_TAG], retry.tags[REASON_TAG]) == signature
    assert services.graphql.wait_for_run(retry.run_id).status == "SUCCESS", (
        services.graphql.run_errors(retry.run_id))
    return retry


def assert_retried_once(instance: DagsterInstance, run_id: str, retry: DagsterRun) -> None:
    """``retry`` is the one run made of ``run_id``, and nothing was made of it in turn."""
    assert [run.run_id for run in retries_of(instance, run_id)] == [retry.run_id]
    assert retries_of(instance, retry.run_id) == []
