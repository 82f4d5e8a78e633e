"""Runs in this process, for a laptop and CI: one run of a source's job over some partitions,
holding its claim as a run worker would, and the table of figures `mostovik materialize` and
`mostovik demo` print; and the settings that point every source at the local stand-in."""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dagster import DagsterInstance, JobDefinition

    from mostovik_pipelines.platform.tracking import Job

EXIT_JOB_FAILED = 1
EXIT_USAGE = 2
EXIT_NOT_FOUND = 3
"""The exit codes of `mostovik` for scripts (see :mod:`mostovik_pipelines.cli`)."""


def standin_environment(base_url: str) -> dict[str, str]:
    """The settings that point every source with a stand-in endpoint at the stand-in serving
    at ``base_url``, each source's own ``url_setting``."""
    from mostovik_pipelines.sources import ALL_SOURCES
    from mostovik_pipelines.standin.endpoint import discover_endpoints

    endpoints = discover_endpoints()
    return {spec.url_setting: f"{base_url}{endpoints[spec.name].path}" for spec in ALL_SOURCES
            if spec.url_setting and spec.name in endpoints}


def run_in_process(instance: DagsterInstance, source_job: JobDefinition,
                   partitions: Sequence[str], tags: Mapping[str, str] | None = None) -> Job:
    """One run of ``source_job`` in this process for ``partitions`` (consecutive keys: more than
    one is a run over their range), and its job view."""
    from mostovik_pipelines.core.tags import RANGE_END_TAG, RANGE_START_TAG
    from mostovik_pipelines.platform.claims import hold_driver_claim
    from mostovik_pipelines.platform.tracking import load_job
    from mostovik_pipelines.sources import ALL_SOURCES

    tags = dict(tags or {})
    if len(partitions) > 1:
        tags.update({RANGE_START_TAG: partitions[0], RANGE_END_TAG: partitions[-1]})
    run_id = str(uuid.uuid4())
    # In-process runs have no executor of ours: this process drives the run, and holds its
    # claims.
    with hold_driver_claim(instance, run_id):
        source_job.execute_in_process(
            partition_key=partitions[0] if len(partitions) == 1 else None, tags=tags,
            instance=instance, raise_on_error=False, run_id=run_id,
            run_config={"loggers": {"console": {"config": {"log_level": "WARNING"}}}},
        )
    return load_job(instance, run_id, ALL_SOURCES)


SUMMARY_FIGURES = ("inserted", "updated", "unchanged", "deleted", "rejected")


def summary_width(partitions: Sequence[str]) -> int:
    """The width of the partition column of a summary table of ``partitions``."""
    return max(map(len, ["partition", *partitions]))


def summary_header(width: int) -> str:
    return (f"{'partition':<{width}}  {'status':<9} "
            + " ".join(f"{name:>9}" for name in SUMMARY_FIGURES) + "  run / note")


def summary_line(partition: str, width: int, status: str, figures: Mapping[str, int],
                 run_id: str, note: str) -> str:
    return (f"{partition:<{width}}  {status:<9} "
            + " ".join(f"{figures.get(name, 0):>9}" for name in SUMMARY_FIGURES)
            + f"  {run_id[:8]} {note}").rstrip()


def summary_lines(job: Job, partitions: Sequence[str], width: int) -> list[str]:
    """A line per partition of ``job``: its figures once loaded (partial: rows were
    quarantined), else skipped with the reason (not available yet), or failed with the error."""
    from mostovik_pipelines.platform.tracking import JobStatus

    error = job.errors[0].message if job.errors else ""
    lines = []
    for partition in partitions:
        figures = job.per_partition.get(partition)
        if figures is not None:
            status = "partial" if figures.get("rejected") else "completed"
            note = "rejected rows are in quarantined_rows" if figures.get("rejected") else ""
        else:
            status = "failed" if job.status is JobStatus.FAILED else "skipped"
            note = job.left_out.get(partition) or error
        lines.append(summary_line(partition, width, status, figures or {}, job.run_id, note))
    return lines
