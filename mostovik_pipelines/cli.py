"""The operator's command line: ``mostovik db ...``, ``mostovik materialize``, ``mostovik standin``.

Exit codes: 0 success, 1 a job failed, 2 a usage error (unknown source, bad partition).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Sequence

import click

from mostovik_pipelines.settings import resolved_database_url

EXIT_JOB_FAILED = 1
EXIT_USAGE = 2


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


@main.command()
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8765, show_default=True, type=int)
def standin(host: str, port: int) -> None:
    """Serve the local stand-in for the external sources until interrupted."""
    from mostovik_pipelines.standin import StandinServer

    server = StandinServer(host, port)
    click.echo(f"stand-in sources at {server.url} (CBR: {server.cbr_url})")
    with contextlib.suppress(KeyboardInterrupt):
        server.serve_forever()


@main.command()
@click.option("--source", required=True, help="Source name, e.g. cbr_daily_rates.")
@click.option("--partition", "partitions", multiple=True, help="Partition key; repeatable.")
@click.option("--last", type=int, default=None, help="The N newest partitions.")
def materialize(source: str, partitions: Sequence[str], last: int | None) -> None:
    """Run a source's job for some partitions in this process, one run each, and summarise."""
    sys.exit(_materialize(source, list(partitions), last))


@main.command()
@click.option("--days", default=7, show_default=True)
def demo(days: int) -> None:
    """Start the stand-in, migrate the local warehouse and load the newest daily CBR rates."""
    from mostovik_pipelines.standin import StandinServer
    from mostovik_pipelines.warehouse import migrate

    server = StandinServer().start()
    migrate.upgrade(resolved_database_url())
    click.echo(f"stand-in at {server.url}; warehouse {resolved_database_url()}")
    # The code location reads MOSTOVIK_CBR_URL when it loads, so the runs get a process of their
    # own that starts with the stand-in's address.
    try:
        completed = subprocess.run(
            [sys.executable, "-m", "mostovik_pipelines.cli", "materialize",
             "--source", "cbr_daily_rates", "--last", str(days)],
            env={**os.environ, "MOSTOVIK_CBR_URL": server.cbr_url}, check=False,
        )
    finally:
        server.stop()
    sys.exit(completed.returncode)


def _materialize(source: str, partitions: list[str], last: int | None) -> int:
    from dagster import DagsterInstance

    from mostovik_pipelines.definitions import defs
    from mostovik_pipelines.etl.tracking import JobStatus, summarize_job
    from mostovik_pipelines.sources import ALL_SOURCES

    specs = {spec.name: spec for spec in ALL_SOURCES}
    if source not in specs:
        click.echo(f"unknown source {source!r}; known: {', '.join(sorted(specs))}", err=True)
        return EXIT_USAGE
    known = specs[source].partitions_def.get_partition_keys()
    if last:
        partitions = [*partitions, *known[-last:]]
    unknown = [p for p in partitions if p not in known]
    if unknown or not partitions:
        click.echo(f"{source}: no such partitions {unknown}" if unknown
                   else "give --partition or --last", err=True)
        return EXIT_USAGE

    job = defs.resolve_job_def(f"{source}_job")
    instance = DagsterInstance.get() if os.environ.get("DAGSTER_HOME") else (
        DagsterInstance.ephemeral())
    click.echo(f"{'partition':<12} {'status':<10} {'inserted':>8} {'updated':>8} "
               f"{'unchanged':>9} {'deleted':>8}  run / note")
    failed = 0
    for partition in partitions:
        result = job.execute_in_process(
            partition_key=partition, instance=instance, raise_on_error=False,
            run_config={"loggers": {"console": {"config": {"log_level": "WARNING"}}}},
        )
        summary = summarize_job(instance, result.run_id)
        failed += summary.status is JobStatus.FAILED
        c = summary.counts
        click.echo(f"{partition:<12} {summary.status.value:<10} {c.get('inserted', 0):>8} "
                   f"{c.get('updated', 0):>8} {c.get('unchanged', 0):>9} {c.get('deleted', 0):>8}"
                   f"  {result.run_id[:8]} {summary.note}")
    return EXIT_JOB_FAILED if failed else 0


if __name__ == "__main__":
    main()
