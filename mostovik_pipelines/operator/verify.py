"""``mostovik verify``: does the table still hold exactly what the source says for a range of
periods? Read-only: nothing is written to the warehouse, run storage or the landing store
(:mod:`mostovik_pipelines.framework.verification`).

Exit codes: 0 every partition matches; 1 any differs (or is not loaded, or could not be
verified); 2 a usage error (unknown source or partition, a range that ends before it starts).
"""

from __future__ import annotations

import json
import os
import sys

import click

from mostovik_pipelines.operator.console import EXIT_JOB_FAILED, EXIT_USAGE, fail, known_source


@click.command("verify")
@click.option("--source", required=True, help="The source, e.g. cbr_daily_rates.")
@click.option("--from", "first", required=True, help="The range's first partition key.")
@click.option("--to", "last", required=True, help="The range's last partition key.")
@click.option("--against", type=click.Choice(["landed", "source"]), default="source",
              show_default=True,
              help="source: ask the source again (nothing landed); landed: the payload the "
                   "stored rows came from (no request leaves the machine).")
@click.option("--json", "as_json", is_flag=True)
def verify(source: str, first: str, last: str, against: str, as_json: bool) -> None:
    """Compare each partition of --source from --from to --to with what the source says, parsed
    and validated as a load would: keys missing, keys extra, values that differ (stored and
    source value), rows the source still sends that a load quarantines. Writes nothing."""
    from sqlalchemy import create_engine

    from mostovik_pipelines.core.settings import landing_dir, resolved_database_url
    from mostovik_pipelines.framework.verification.verify import verify_partition
    from mostovik_pipelines.operator.selection import RangeRefused, range_keys
    from mostovik_pipelines.resources import LandingStoreResource
    from mostovik_pipelines.sources import ALL_SOURCES

    known_source(source)
    spec = next(s for s in ALL_SOURCES if s.name == source)
    instance = _instance()
    if instance is None and not _time_partitioned(spec):
        fail(EXIT_USAGE, f"{source}'s partitions are file versions, which the Dagster instance "
                         "lists: set DAGSTER_HOME")
    try:
        keys = range_keys(instance, spec, first, last)
    except RangeRefused as refused:
        fail(EXIT_USAGE, str(refused))
    engine = create_engine(resolved_database_url())
    landing = LandingStoreResource(base_dir=landing_dir())
    verdicts = []
    try:
        for key in keys:
            verdict = verify_partition(engine, spec, key, against, resource=spec.resource,
                                       landing=landing, instance=instance)
            verdicts.append(verdict)
            if not as_json:
                for line in verdict.lines():
                    click.echo(line)
    finally:
        engine.dispose()
    agreeing = sum(v.agrees for v in verdicts)
    if as_json:
        click.echo(json.dumps({
            "source": source, "against": against, "from": first, "to": last,
            "agrees": agreeing == len(verdicts),
            "partitions": [v.as_dict() for v in verdicts]}, indent=1, ensure_ascii=False))
    else:
        compared = "the source" if against == "source" else "the landed payloads"
        click.echo(f"{source}: {len(verdicts)} partition(s) against {compared}: "
                   f"{agreeing} match, {len(verdicts) - agreeing} do not")
    if agreeing != len(verdicts):
        sys.exit(EXIT_JOB_FAILED)


def _instance():
    """The Dagster instance, when DAGSTER_HOME names one (only file sources need it: the
    instance lists their versions)."""
    if not os.environ.get("DAGSTER_HOME"):
        return None
    from dagster import DagsterInstance

    return DagsterInstance.get()


def _time_partitioned(spec) -> bool:
    from dagster import TimeWindowPartitionsDefinition

    return isinstance(spec.partitions_def, TimeWindowPartitionsDefinition)
