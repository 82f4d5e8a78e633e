"""``mostovik demo``: every kind of job once, against the local stand-in for the external
sources and the local SQLite warehouse, recorded in the Dagster instance of ``DAGSTER_HOME``.

Each source of ``ALL_SOURCES`` runs as its job type runs:

* a parser or sync source (CBR rates and metal prices, ERP work orders): its newest days, in one
  run over their range (a run's fixed cost paid once, not once a day);
* a file source (material delivery reports): the sample files of ``demo_inbox/<source>/`` are
  dropped into its inbox and its inbox sensor is evaluated once on the instance, as the daemon
  evaluates it after a cursor reset (every file in the inbox hashed): the partitions (file
  versions) it asks for are added, and each run it requests is run here under the sensor's run
  key, unless a run of that sensor already has the key, which the daemon would skip too. One
  sample has a row that validation rejects: that file loads partial, the row goes to
  ``quarantined_rows``.

A table per source shows each partition's figures. A second demo changes nothing: every line
reads 0 inserted, 0 updated, 0 deleted; a sample file whose bytes were loaded before is skipped,
naming the run that loaded them.

The sources read their URLs when the code location loads, so the runs happen in a process of
their own (``python -m mostovik_pipelines.operator.demo``) started with the stand-in's addresses.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click

from mostovik_pipelines.core.settings import resolved_database_url
from mostovik_pipelines.operator.local_runs import (
    EXIT_JOB_FAILED,
    run_in_process,
    standin_environment,
    summary_header,
    summary_line,
    summary_lines,
    summary_width,
)

if TYPE_CHECKING:
    from dagster import DagsterInstance, Definitions

    from mostovik_pipelines.framework.spec import SourceSpec

SAMPLE_FILES = Path(__file__).parent / "demo_inbox"
"""``<source>/<file>``: the files the demo drops into each file source's inbox."""


def run_demo(days: int, sync_days: int) -> int:
    """Start the stand-in, then run every source in a process that has its addresses; the exit
    code: 0, or 1 when a job failed."""
    from mostovik_pipelines.standin import StandinServer

    server = StandinServer().start()
    click.echo(f"stand-in at {server.url}; warehouse {resolved_database_url()}")
    try:
        return subprocess.run(
            [sys.executable, "-m", "mostovik_pipelines.operator.demo", str(days), str(sync_days)],
            env={**os.environ, **standin_environment(server.url)}, check=False,
        ).returncode
    finally:
        server.stop()


def run_every_source(days: int, sync_days: int) -> int:
    """Migrate the warehouse and run each source, printing its table; 1 when a job failed."""
    from dagster import DagsterInstance

    from mostovik_pipelines.definitions import defs
    from mostovik_pipelines.framework.spec import JobType
    from mostovik_pipelines.platform.tracking import JobStatus
    from mostovik_pipelines.sources import ALL_SOURCES
    from mostovik_pipelines.warehouse import migrate

    migrate.upgrade(resolved_database_url())
    instance = DagsterInstance.get() if os.environ.get("DAGSTER_HOME") else (
        DagsterInstance.ephemeral())
    newest = {JobType.PARSER: days, JobType.SYNC: sync_days}
    failed = False
    for spec in ALL_SOURCES:
        click.echo(f"\n{spec.name} ({spec.job_type} job)")
        if spec.job_type is JobType.FILE:
            failed |= _run_sample_files(spec, defs, instance)
            continue
        partitions = spec.partitions_def.get_partition_keys()[-newest[spec.job_type]:]
        job = run_in_process(instance, defs.resolve_job_def(f"{spec.name}_job"), partitions)
        failed |= job.status is JobStatus.FAILED
        width = summary_width(partitions)
        click.echo("\n".join([summary_header(width), *summary_lines(job, partitions, width)]))
    return EXIT_JOB_FAILED if failed else 0


def _run_sample_files(spec: SourceSpec, defs: Definitions, instance: DagsterInstance) -> bool:
    """Drop the source's sample files into its inbox, evaluate its sensor and run the runs it
    requests as the daemon would; whether one failed."""
    from dagster import DagsterRun, RunsFilter, build_sensor_context

    from mostovik_pipelines.core.dagster_compat import RUN_KEY_TAG
    from mostovik_pipelines.framework.assets.resource_keys import source_resource_key
    from mostovik_pipelines.platform.tracking import JobStatus, load_job

    source_job = defs.resolve_job_def(f"{spec.name}_job")
    sensor = next(s for s in defs.sensors if s.has_jobs and s.job_name == source_job.name)
    inbox = Path(spec.resource.inbox_dir)
    inbox.mkdir(parents=True, exist_ok=True)
    for sample in sorted((SAMPLE_FILES / spec.name).glob("*")):
        # Written aside and renamed, as an upload lands: the sensor never sees half a file.
        (inbox / f"{sample.name}.part").write_bytes(sample.read_bytes())
        os.replace(inbox / f"{sample.name}.part", inbox / sample.name)

    context = build_sensor_context(instance=instance,
                                   resources={source_resource_key(spec): spec.resource})
    context.log.setLevel(logging.WARNING)  # the versions it found are the table below
    result = sensor(context)
    for request in result.dynamic_partitions_requests:
        instance.add_dynamic_partitions(request.partitions_def_name, list(request.partition_keys))
    width = summary_width([request.partition_key for request in result.run_requests])
    click.echo(summary_header(width))
    failed = False
    for request in result.run_requests:
        launched = {**DagsterRun.tags_for_sensor(sensor), RUN_KEY_TAG: request.run_key}
        earlier = instance.get_run_records(RunsFilter(tags=launched), limit=1)
        if earlier:
            run_id = earlier[0].dagster_run.run_id
            click.echo(summary_line(
                request.partition_key, width, "skipped", {}, run_id,
                f"not run again: same bytes as this run "
                f"({load_job(instance, run_id, [spec]).status})"))
            continue
        job = run_in_process(instance, source_job, [request.partition_key],
                             {**request.tags, **launched})
        failed |= job.status is JobStatus.FAILED
        click.echo("\n".join(summary_lines(job, [request.partition_key], width)))
    return failed


if __name__ == "__main__":
    sys.exit(run_every_source(int(sys.argv[1]), int(sys.argv[2])))
