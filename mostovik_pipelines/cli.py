"""The operator's command line: ``mostovik jobs ...``, ``mostovik db ...``,
``mostovik materialize``, ``mostovik prune``, ``mostovik standin``, ``mostovik demo``.

Exit codes, for scripts: 0 success; 1 a job failed (or, for ``jobs list --stuck``, stuck jobs
were found); 2 a usage error (unknown source, bad period, no DAGSTER_HOME); 3 unknown run id.
Errors go to stderr, results to stdout (``--json`` for machines).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Sequence

import click

from mostovik_pipelines.local_runs import (
    EXIT_JOB_FAILED,
    EXIT_NOT_FOUND,
    EXIT_USAGE,
    run_in_process,
    standin_environment,
    summary_header,
    summary_lines,
    summary_width,
)
from mostovik_pipelines.metrics.command import metrics
from mostovik_pipelines.settings import resolved_database_url


@click.group()
def main() -> None:
    """Mostovik back-office pipelines."""


@main.group()
def db() -> None:
    """The warehouse schema."""


@db.command("upgrade")
@click.option("--revision", default="head", show_default=True)
def db_upgrade(revision: str) -> None:
    """Apply the warehouse migrations (MOSTOVIK_DATABASE_URL, default the local SQLite file)."""
    from mostovik_pipelines.warehouse import migrate

    migrate.upgrade(resolved_database_url(), revision)
    click.echo(f"warehouse at revision {migrate.current_revision(resolved_database_url())}")


@db.command("forget-digests")
@click.option("--table", default=None, help="One target table; default all.")
def db_forget_digests(table: str | None) -> None:
    """Make the next load of every partition compare the stored rows instead of trusting the
    digest of its last load: after writes the tables' triggers could not see (a restore with
    --disable-triggers, session_replication_role = replica, DDL outside the migrations)."""
    from sqlalchemy import create_engine

    from mostovik_pipelines.framework.load.ledger import forget_digests

    engine = create_engine(resolved_database_url())
    try:
        with engine.begin() as connection:
            forgotten = forget_digests(connection, table)
    finally:
        engine.dispose()
    click.echo(f"forgot the content digests of {forgotten} partition load(s)")


@main.command()
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8765, show_default=True, type=int)
@click.option("--print-env", is_flag=True,
              help="Print NAME=URL for every source with a stand-in endpoint, and exit.")
def standin(host: str, port: int, print_env: bool) -> None:
    """Serve the local stand-in for the external sources until interrupted."""
    from mostovik_pipelines.standin import StandinServer

    if print_env:
        for name, url in standin_environment(f"http://{host}:{port}").items():
            click.echo(f"{name}={url}")
        return
    server = StandinServer(host, port)
    click.echo(f"stand-in sources at {server.url}:")
    for name, url in standin_environment(server.url).items():
        click.echo(f"  {name}={url}")
    with contextlib.suppress(KeyboardInterrupt):
        server.serve_forever()


@main.command("new-source")
@click.argument("name")
@click.option("--type", "job_type", type=click.Choice(["parser", "sync", "file"]),
              help="parser: a daily HTTP fetch; sync: paged incremental sync; file: an inbox.")
@click.option("--migration-only", is_flag=True,
              help="Write the source's migration again from its declared table (while it is "
                   "the newest migration).")
def new_source(name: str, job_type: str | None, migration_only: bool) -> None:
    """Scaffold source NAME: its folder (declaration, partitions, parsing, stand-in endpoint),
    test, bad-input corpus and migration, passing their tests as written
    (docs/adding-a-source.md)."""
    from mostovik_pipelines.scaffold import ScaffoldRefused, new_source, source_migration
    from mostovik_pipelines.warehouse.freeze import MigrationRefused

    if not migration_only and job_type is None:
        _fail(EXIT_USAGE, "give --type parser, sync or file (or --migration-only)")
    try:
        written = [source_migration(name)] if migration_only else new_source(name, job_type)
    except (ScaffoldRefused, MigrationRefused) as refused:
        _fail(EXIT_USAGE, str(refused))
    for item in written:
        click.echo(str(item))
    if not migration_only:
        click.echo(f"next: declare {name}'s table in mostovik_pipelines/sources/{name}/"
                   f"source.py, parse its payload in parse.py, serve its format in standin.py "
                   f"(file sources: none), then `mostovik new-source {name} --migration-only` "
                   "and `make test`")


@main.command()
@click.option("--source", required=True, help="Source name, e.g. cbr_daily_rates.")
@click.option("--partition", "partitions", multiple=True, help="Partition key; repeatable.")
@click.option("--last", type=int, default=None, help="The N newest partitions.")
def materialize(source: str, partitions: Sequence[str], last: int | None) -> None:
    """Run a source's job for some partitions in this process, one run each, and summarise."""
    sys.exit(_materialize(source, list(partitions), last))


@main.command()
@click.option("--days", default=7, show_default=True,
              help="The newest N days of each parser source.")
@click.option("--sync-days", default=3, show_default=True,
              help="The newest N daily windows of each sync source.")
def demo(days: int, sync_days: int) -> None:
    """Every kind of job once, on the stand-in and the local warehouse: the newest days of each
    HTTP source, and sample delivery reports through the inbox sensor (mostovik_pipelines.demo)."""
    from mostovik_pipelines.demo import run_demo

    sys.exit(run_demo(days, sync_days))


def _materialize(source: str, partitions: list[str], last: int | None) -> int:
    from dagster import DagsterInstance

    from mostovik_pipelines.definitions import defs
    from mostovik_pipelines.framework.runs.tracking import JobStatus
    from mostovik_pipelines.sources import ALL_SOURCES

    specs = {spec.name: spec for spec in ALL_SOURCES}
    if source not in specs:
        click.echo(f"unknown source {source!r}; known: {', '.join(sorted(specs))}", err=True)
        return EXIT_USAGE
    instance = DagsterInstance.get() if os.environ.get("DAGSTER_HOME") else (
        DagsterInstance.ephemeral())
    known = specs[source].partitions_def.get_partition_keys(dynamic_partitions_store=instance)
    if last:
        partitions = [*partitions, *known[-last:]]
    unknown = [p for p in partitions if p not in known]
    if unknown or not partitions:
        click.echo(f"{source}: no such partitions {unknown}" if unknown
                   else "give --partition or --last", err=True)
        return EXIT_USAGE

    source_job = defs.resolve_job_def(f"{source}_job")
    width = summary_width(partitions)
    click.echo(summary_header(width))
    failed = 0
    for partition in partitions:
        job = run_in_process(instance, source_job, [partition])
        failed += job.status is JobStatus.FAILED
        for line in summary_lines(job, [partition], width):
            click.echo(line)
    return EXIT_JOB_FAILED if failed else 0


@main.command()
@click.option("--dry-run", is_flag=True, help="Report what would be removed; remove nothing.")
def prune(dry_run: bool) -> None:
    """Apply the retention policy now, as the daily prune_storage_job does: old op outputs,
    landed payloads and runs (README, "Retention"); prints what it removes per store."""
    from mostovik_pipelines.definitions import defs
    from mostovik_pipelines.framework.errors import ConfigurationError
    from mostovik_pipelines.maintenance.prune import prune as prune_stores
    from mostovik_pipelines.resources.stores import store_path
    from mostovik_pipelines.settings import landing_dir, storage_dir

    try:
        report = prune_stores(
            _instance(), landing_dir=store_path(landing_dir()),
            op_output_dir=store_path(storage_dir()),
            check_keys=list(defs.resolve_asset_graph().asset_check_keys), dry_run=dry_run)
    except ConfigurationError as refused:
        _fail(EXIT_USAGE, str(refused))
    for line in report.lines():
        click.echo(line)


@main.group()
def jobs() -> None:
    """Background jobs (Dagster runs of the sources): list, show, re-run."""


def _instance():
    from dagster import DagsterInstance

    if not os.environ.get("DAGSTER_HOME"):
        _fail(EXIT_USAGE, "DAGSTER_HOME is not set: point it at the Dagster instance to read")
    return DagsterInstance.get()


def _fail(code: int, message: str):
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


def _known_source(source: str | None) -> None:
    from mostovik_pipelines.sources import ALL_SOURCES

    names = sorted(spec.name for spec in ALL_SOURCES)
    if source is not None and source not in names:
        _fail(EXIT_USAGE, f"unknown source {source!r}; known: {', '.join(names)}")


@jobs.command("list")
@click.option("--source", help="Only this source.")
@click.option("--type", "job_type", type=click.Choice(["parser", "sync", "file"]))
@click.option("--status", type=click.Choice(["pending", "running", "completed", "failed",
                                             "partial"]))
@click.option("--from", "period_from", help="Periods from this partition key on.")
@click.option("--to", "period_to", help="Periods up to this partition key.")
@click.option("--since", type=click.DateTime(), help="Jobs created since (UTC).")
@click.option("--limit", default=50, show_default=True)
@click.option("--stuck", is_flag=True, help="Jobs running longer than their source allows.")
@click.option("--waiting", is_flag=True,
              help="Failed jobs whose partitions wait for an operator (failed for a permanent "
                   "reason, or cancelled: nothing asks for them again automatically).")
@click.option("--json", "as_json", is_flag=True)
def jobs_list(source, job_type, status, period_from, period_to, since, limit, stuck, waiting,
              as_json) -> None:
    """Jobs, newest first. A failed job whose partitions wait for an operator says so."""
    from datetime import UTC

    from mostovik_pipelines.framework.automation.partition_states import waiting_for_operator
    from mostovik_pipelines.framework.runs.tracking import JobStatus, list_jobs, stuck_jobs
    from mostovik_pipelines.sources import ALL_SOURCES

    _known_source(source)
    instance = _instance()
    if stuck:
        found = stuck_jobs(instance, ALL_SOURCES)
    else:
        found = list_jobs(
            instance, source=source, job_type=job_type,
            status=JobStatus.FAILED if waiting else JobStatus(status) if status else None,
            period_from=period_from, period_to=period_to,
            since=since.replace(tzinfo=UTC) if since else None,
            limit=limit, sources=ALL_SOURCES,
        )
    specs = {spec.name: spec for spec in ALL_SOURCES}
    waits = {job.run_id: waiting_for_operator(instance, specs[job.source], job.partitions,
                                              job.run_id)
             for job in found if job.status is JobStatus.FAILED and job.source in specs}
    if waiting:
        found = [job for job in found if waits.get(job.run_id)]
    if as_json:
        click.echo(json.dumps([{**job.as_dict(), "waiting_for_operator": waits.get(
            job.run_id, [])} for job in found], indent=1, default=str))
    else:
        click.echo(f"{'run':<36}  {'source':<16} {'type':<6} {'period':<23} {'status':<9} "
                   f"{'ins':>5} {'upd':>5} {'del':>5} {'rej':>4}  launched by")
        for job in found:
            t = job.totals
            click.echo(f"{job.run_id:<36}  {job.source or '-':<16} {job.job_type or '-':<6} "
                       f"{job.period:<23} {job.status.value:<9} {t.get('inserted', 0):>5} "
                       f"{t.get('updated', 0):>5} {t.get('deleted', 0):>5} "
                       f"{t.get('rejected', 0):>4}  {job.launched_by}"
                       + (f"; waiting for an operator: {', '.join(waits[job.run_id])}"
                          if waits.get(job.run_id) else ""))
    if stuck and found:
        sys.exit(EXIT_JOB_FAILED)


@jobs.command("show")
@click.argument("run_id")
@click.option("--json", "as_json", is_flag=True)
def jobs_show(run_id: str, as_json: bool) -> None:
    """Everything about one job: status, figures, attempts, context, errors."""
    from mostovik_pipelines.framework.runs.tracking import JobNotFound, load_job
    from mostovik_pipelines.sources import ALL_SOURCES

    try:
        job = load_job(_instance(), run_id, ALL_SOURCES)
    except JobNotFound as missing:
        _fail(EXIT_NOT_FOUND, str(missing))
    data = job.as_dict()
    if as_json:
        click.echo(json.dumps(data, indent=1, default=str))
        return
    for key in ("run_id", "source", "job_type", "period", "status", "result", "run_status",
                "started_at", "ended_at", "duration_seconds", "launched_by", "executor",
                "parent_run_id", "root_run_id", "rerun_of"):
        click.echo(f"{key:<17} {data[key] if data[key] is not None else '-'}")
    click.echo(f"{'totals':<17} {data['totals'] or '-'}")
    for partition, figures in job.per_partition.items():
        click.echo(f"  {partition:<15} {figures}")
    for partition, reason in job.left_out.items():
        click.echo(f"  left out {partition}: {reason}")
    click.echo(f"{'attempts':<17} {data['attempts'] or '-'}")
    click.echo(f"{'processes':<17} {'' if job.processes else '-'}".rstrip())
    for op_name, process in job.processes.items():
        task = job.celery_tasks.get(op_name)
        click.echo(f"  {op_name:<15} {process}" + (f", celery task {task}" if task else ""))
    for error in job.errors:
        click.echo(f"error in {error.op or 'run'} ({error.error_class}"
                   f"{', ' + error.kind if error.kind else ''}): {error.message}")
        for cause in error.causes:
            click.echo(f"  caused by {cause}")


@jobs.command("rerun")
@click.argument("run_id", required=False)
@click.option("--source", help="With --period: a fresh run of this source.")
@click.option("--period", help="The partition key to run again.")
@click.option("--full-resync", is_flag=True,
              help="With --period, a paged source: ignore an interrupted sync's progress.")
def jobs_rerun(run_id: str | None, source: str | None, period: str | None,
               full_resync: bool) -> None:
    """Re-run RUN_ID from its failure, or a fresh run for --source and --period."""
    from mostovik_pipelines.framework.runs.recovery import rerun_from_failure, rerun_partition
    from mostovik_pipelines.framework.runs.tracking import JobNotFound, JobStatus, load_job
    from mostovik_pipelines.sources import ALL_SOURCES

    if bool(run_id) == bool(source or period) or bool(source) != bool(period):
        _fail(EXIT_USAGE, "give a RUN_ID, or both --source and --period")
    instance = _instance()
    if run_id:
        try:
            new_run_id = rerun_from_failure(instance, run_id)
        except JobNotFound as missing:
            _fail(EXIT_NOT_FOUND, str(missing))
        except ValueError as refused:
            _fail(EXIT_USAGE, str(refused))
    else:
        _known_source(source)
        spec = next(s for s in ALL_SOURCES if s.name == source)
        if period not in spec.partitions_def.get_partition_keys(
                dynamic_partitions_store=instance):
            _fail(EXIT_USAGE, f"{source} has no period {period!r}")
        new_run_id = rerun_partition(instance, source, period, full_resync=full_resync)
    job = load_job(instance, new_run_id, ALL_SOURCES)
    click.echo(f"{new_run_id} {job.status.value}")
    if job.status is JobStatus.FAILED:
        sys.exit(EXIT_JOB_FAILED)


main.add_command(metrics)

if __name__ == "__main__":
    main()
