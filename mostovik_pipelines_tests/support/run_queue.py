"""The daemon that launches queued runs, for tests of a local instance: what an operator's
``mostovik jobs rerun`` needs to see its run start."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

from mostovik_pipelines.maintenance.job import PRUNE_SCHEDULE
from mostovik_pipelines.sources import ALL_SOURCES
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
