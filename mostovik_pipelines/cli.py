"""The operator's command line: ``mostovik db ...``, ``mostovik materialize``,
``mostovik prune``, ``mostovik stores check``, ``mostovik standin``, ``mostovik demo``, and
``mostovik jobs ...``
(:mod:`mostovik_pipelines.operator`). Exit codes: :mod:`mostovik_pipelines.operator.console`.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Sequence

import click

from mostovik_pipelines.core.settings import resolved_database_url
from mostovik_pipelines.metrics.command import metrics
from mostovik_pipelines.operator.commands import jobs
from mostovik_pipelines.operator.console import fail as _fail
from mostovik_pipelines.operator.console import instance_of_home as _instance
from mostovik_pipelines.operator.local_runs import (
    EXIT_JOB_FAILED,
    EXIT_USAGE,
    run_in_process,
    standin_environment,
    summary_header,
    summary_lines,
    summary_width,
)
from mostovik_pipelines.operator.tracker import tracker
from mostovik_pipelines.operator.verify import verify


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
    HTTP source, and sample delivery reports through the inbox sensor
    (mostovik_pipelines.operator.demo)."""
    from mostovik_pipelines.operator.demo import run_demo

    sys.exit(run_demo(days, sync_days))


def _materialize(source: str, partitions: list[str], last: int | None) -> int:
    from dagster import DagsterInstance

    from mostovik_pipelines.definitions import defs
    from mostovik_pipelines.platform.tracking import JobStatus
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
    from mostovik_pipelines.core.errors import ConfigurationError
    from mostovik_pipelines.core.settings import landing_dir, storage_dir
    from mostovik_pipelines.definitions import defs
    from mostovik_pipelines.maintenance.prune import prune as prune_stores
    from mostovik_pipelines.resources.stores import store_path

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
def stores() -> None:
    """The stores the deployment writes: landing, op outputs, inbox and archive."""


@stores.command("check")
@click.option("--create", is_flag=True, help="Create a missing directory or bucket first.")
def stores_check(create: bool) -> None:
    """Write, read back and remove a probe in every store, with this environment's settings
    (deploy/README.md, "Install"); exit 1 naming the setting of a store that fails."""
    from mostovik_pipelines.operator.stores import check_store, configured_stores

    failed = 0
    for store in configured_stores():
        try:
            created = check_store(store, create)
        except Exception as error:  # any failure of a store is reported, by its setting
            failed += 1
            click.echo(f"{store.name:<30} {store.location}  FAILED ({store.setting}): "
                       f"{type(error).__name__}: {error}")
            continue
        click.echo(f"{store.name:<30} {store.location}  ok" + (f" ({created})" if created
                                                               else ""))
    if failed:
        sys.exit(EXIT_JOB_FAILED)


main.add_command(jobs)
main.add_command(metrics)
main.add_command(verify)
main.add_command(tracker)

if __name__ == "__main__":
    main()
