"""``mostovik tracker rebuild``: after run storage was lost (a dropped database, a restore from
an old backup), record every partition the warehouse's ledger says was loaded, so that the UI's
partition status, the catch-up and ``mostovik jobs list`` agree with the warehouse again
(:mod:`mostovik_pipelines.framework.runs.rebuild`). Nothing is fetched or loaded; a second
rebuild records nothing."""

from __future__ import annotations

import time

import click

from mostovik_pipelines.operator.console import instance_of_home, known_source


@click.group()
def tracker() -> None:
    """The job tracker (Dagster run storage) and the warehouse's ledger."""


@tracker.command("rebuild")
@click.option("--source", help="Only this source (default: every source).")
@click.option("--dry-run", is_flag=True, help="Say what would be recorded; record nothing.")
def rebuild(source: str | None, dry_run: bool) -> None:
    """Record a run-less materialisation, with the loading run's id, the payload's hash and
    the figures, for every partition the ledger names and run storage does not have as
    loaded (DAGSTER_HOME: the instance; MOSTOVIK_DATABASE_URL: the warehouse)."""
    from sqlalchemy import create_engine

    from mostovik_pipelines.core.settings import resolved_database_url
    from mostovik_pipelines.framework.runs.rebuild import rebuild_tracker
    from mostovik_pipelines.sources import ALL_SOURCES

    known_source(source)
    instance = instance_of_home()
    engine = create_engine(resolved_database_url())
    started = time.monotonic()
    try:
        done = rebuild_tracker(instance, engine,
                               [s for s in ALL_SOURCES if source in (None, s.name)],
                               dry_run=dry_run)
    finally:
        engine.dispose()
    for item in done:
        click.echo(item.line(dry_run))
    recorded = sum(len(item.recorded) for item in done)
    click.echo(f"{'would record' if dry_run else 'recorded'} {recorded} partition(s) in "
               f"{time.monotonic() - started:.1f} s")
