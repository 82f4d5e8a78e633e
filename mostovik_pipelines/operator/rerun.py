"""``mostovik jobs rerun``: a range of partitions picked by state, one period, or one run,
each submitted to the run queue.

A range (``--source S --from A --to B --only missing|failed|differing|all --reason WHY``) is
planned by :mod:`.selection`, printed with ``--dry-run``, else submitted to the run queue as
one backfill per source (:mod:`.submission`); ``--wait`` follows the backfills to the end and
judges each partition by its final outcome: a run the daemon retried counts by its retry, so a
dead run retried to success is a success. Every run asked for is signed with who (``--as``,
else the OS user) and why (:mod:`.signature`).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence

import click

from mostovik_pipelines.operator.console import (
    EXIT_JOB_FAILED,
    EXIT_NOT_FOUND,
    EXIT_USAGE,
    fail,
    instance_of_home,
    known_source,
)
from mostovik_pipelines.operator.selection import Only, RangeRefused
from mostovik_pipelines.operator.signature import operator_name, signed_tags


@click.command("rerun")
@click.argument("run_id", required=False)
@click.option("--source", "sources", multiple=True,
              help="A source; repeatable with --from/--to (a range), once with --period.")
@click.option("--period", help="The partition key to run again.")
@click.option("--from", "first", help="The range's first partition key.")
@click.option("--to", "last", help="The range's last partition key.")
@click.option("--only", type=click.Choice([o.value for o in Only]),
              help="missing: never loaded; failed: latest run failed, cancelled or partial; "
                   "differing: its latest verification found it differs from the source; "
                   "all: every partition of the range.")
@click.option("--dry-run", is_flag=True,
              help="Print the partitions and runs the re-run would submit, and why; submit "
                   "nothing.")
@click.option("--wait", is_flag=True,
              help="Follow the submitted run or backfills to the end (a run the daemon retries, "
                   "to its retry's end); exit 1 if a partition's last run failed.")
@click.option("--json", "as_json", is_flag=True)
@click.option("--as", "requested_by", help="Who asks for the re-run (default: the OS user).")
@click.option("--reason", help="Why: required for a range, optional for one period or run.")
@click.option("--full-resync", is_flag=True,
              help="With --period, a paged source: ignore an interrupted sync's progress.")
def rerun(run_id: str | None, sources: Sequence[str], period: str | None, first: str | None,
          last: str | None, only: str | None, dry_run: bool, wait: bool, as_json: bool,
          requested_by: str | None, reason: str | None, full_resync: bool) -> None:
    """Re-run RUN_ID from its failure, a fresh run for --source and --period, or the
    partitions of --source from --from to --to that --only selects: each submitted to the run
    queue (the daemon launches it), printing the run or backfill id."""
    ranged = bool(first or last or only)
    if ranged and (run_id or period or full_resync):
        fail(EXIT_USAGE, "a range (--from, --to, --only) takes no RUN_ID, --period or "
                         "--full-resync")
    if ranged:
        _rerun_range(sources, first, last, only, dry_run, wait, as_json,
                     operator_name(requested_by), reason)
        return
    if bool(run_id) == bool(sources or period) or (sources and (len(sources) != 1 or not period)):
        fail(EXIT_USAGE, "give a RUN_ID, or --source and --period, or --source with --from, "
                         "--to and --only")
    if dry_run:
        fail(EXIT_USAGE, "--dry-run is for a range (--from, --to, --only)")
    _rerun_one(run_id, sources[0] if sources else None, period, full_resync,
               signed_tags(operator_name(requested_by), reason), wait)


def _rerun_range(sources: Sequence[str], first: str | None, last: str | None, only: str | None,
                 dry_run: bool, wait: bool, as_json: bool, requested_by: str,
                 reason: str | None) -> None:
    from mostovik_pipelines.operator.selection import plan_rerun
    from mostovik_pipelines.operator.submission import follow, submit_plan
    from mostovik_pipelines.sources import ALL_SOURCES

    if not (sources and first and last and only):
        fail(EXIT_USAGE, "a range needs --source, --from, --to and --only")
    if not (reason and reason.strip()):
        fail(EXIT_USAGE, "a range needs --reason: why it is re-run (signed on every run)")
    for source in sources:
        known_source(source)
    instance = instance_of_home()
    specs = {spec.name: spec for spec in ALL_SOURCES}
    try:
        plans = [plan_rerun(instance, specs[source], first, last, Only(only))
                 for source in dict.fromkeys(sources)]
    except RangeRefused as refused:
        fail(EXIT_USAGE, str(refused))
    tags = signed_tags(requested_by, reason)
    backfills: dict[str, str] = {}
    if not dry_run:
        backfills = {plan.source: submit_plan(instance, plan, tags)
                     for plan in plans if plan.selected}
    if as_json:
        click.echo(json.dumps({"dry_run": dry_run, "tags": tags, "sources": [
            {**plan.as_dict(), "backfill_id": backfills.get(plan.source)} for plan in plans]},
            indent=1))
    else:
        for plan in plans:
            for line in plan.lines():
                click.echo(line)
            if plan.source in backfills:
                click.echo(f"  submitted: backfill {backfills[plan.source]}")
            elif not dry_run:
                click.echo("  nothing to submit")
    if not wait or not backfills:
        return
    ended = follow(instance, [(backfills[plan.source], specs[plan.source], list(plan.selected))
                              for plan in plans if plan.source in backfills],
                   report=lambda line: click.echo(line, err=as_json))
    if not all(progress.succeeded for progress in ended):
        sys.exit(EXIT_JOB_FAILED)


def _rerun_one(run_id: str | None, source: str | None, period: str | None, full_resync: bool,
               tags: dict[str, str], wait: bool) -> None:
    from mostovik_pipelines.operator.submission import follow_run
    from mostovik_pipelines.platform.recovery import (
        queue_rerun_from_failure,
        queue_rerun_partition,
    )
    from mostovik_pipelines.platform.tracking import JobNotFound, JobStatus, load_job
    from mostovik_pipelines.sources import ALL_SOURCES

    instance = instance_of_home()
    try:
        if run_id:
            new_run_id = queue_rerun_from_failure(instance, run_id, tags)
        else:
            known_source(source)
            spec = next(s for s in ALL_SOURCES if s.name == source)
            if period not in spec.partitions_def.get_partition_keys(
                    dynamic_partitions_store=instance):
                fail(EXIT_USAGE, f"{source} has no period {period!r}")
            new_run_id = queue_rerun_partition(instance, source, period,
                                               full_resync=full_resync, tags=tags)
    except JobNotFound as missing:
        fail(EXIT_NOT_FOUND, str(missing))
    except ValueError as refused:
        fail(EXIT_USAGE, str(refused))
    if not wait:
        click.echo(f"{new_run_id} queued")
        return
    last_run_id = follow_run(instance, new_run_id,
                             report=lambda line: click.echo(line, err=True))
    job = load_job(instance, last_run_id, ALL_SOURCES)
    click.echo(f"{last_run_id} {job.status.value}")
    if job.status is JobStatus.FAILED:
        sys.exit(EXIT_JOB_FAILED)
