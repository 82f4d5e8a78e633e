"""``mostovik jobs list / show / rerun``: the operator's view of the jobs and their re-runs."""

from __future__ import annotations

import json
import sys

import click

from mostovik_pipelines.operator.console import (
    EXIT_JOB_FAILED,
    EXIT_NOT_FOUND,
    fail,
    instance_of_home,
    known_source,
)
from mostovik_pipelines.operator.rerun import rerun


@click.group()
def jobs() -> None:
    """Background jobs (Dagster runs of the sources): list, show, re-run."""


jobs.add_command(rerun)


def _signature(job) -> str:
    """Who asked for an operator's run, and why."""
    if not job.requested_by:
        return ""
    return f" ({job.requested_by}" + (f": {job.reason})" if job.reason else ")")


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
              help="What waits for an operator: failed jobs whose partitions failed for a "
                   "permanent reason or were cancelled, and partitions that left their "
                   "source's lookback unloaded (nothing asks for either again).")
@click.option("--json", "as_json", is_flag=True)
def jobs_list(source, job_type, status, period_from, period_to, since, limit, stuck, waiting,
              as_json) -> None:
    """Jobs, newest first. A failed job whose partitions wait for an operator says so."""
    from datetime import UTC

    from mostovik_pipelines.framework.automation.partition_states import waiting_for_operator
    from mostovik_pipelines.platform.tracking import JobStatus, list_jobs, stuck_jobs
    from mostovik_pipelines.sources import ALL_SOURCES

    known_source(source)
    instance = instance_of_home()
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
    if not (stuck or waiting or since) and status in (None, "completed"):
        found = _with_recorded_loads(instance, found, source, job_type, period_from, period_to,
                                     limit)
    specs = {spec.name: spec for spec in ALL_SOURCES}
    waits = {job.run_id: waiting_for_operator(instance, specs[job.source], job.partitions,
                                              job.run_id)
             for job in found if job.status is JobStatus.FAILED and job.source in specs}
    aged_out = []
    if waiting:
        found = [job for job in found if waits.get(job.run_id)]
        aged_out = _aged_out(instance, [spec for spec in ALL_SOURCES
                                        if source in (None, spec.name)])
    if as_json:
        click.echo(json.dumps([*({**job.as_dict(), "waiting_for_operator": waits.get(
            job.run_id, [])} for job in found), *aged_out], indent=1, default=str))
    else:
        click.echo(f"{'run':<36}  {'source':<16} {'type':<6} {'period':<23} {'status':<9} "
                   f"{'ins':>5} {'upd':>5} {'del':>5} {'rej':>4}  launched by")
        for job in found:
            t = job.totals
            click.echo(f"{job.run_id:<36}  {job.source or '-':<16} {job.job_type or '-':<6} "
                       f"{job.period:<23} {job.status.value:<9} {t.get('inserted', 0):>5} "
                       f"{t.get('updated', 0):>5} {t.get('deleted', 0):>5} "
                       f"{t.get('rejected', 0):>4}  {job.launched_by}{_signature(job)}"
                       + (f"; waiting for an operator: {', '.join(waits[job.run_id])}"
                          if waits.get(job.run_id) else ""))
        for entry in aged_out:
            click.echo(f"{entry['source']} {entry['period']}: waiting for an operator: "
                       f"{entry['why']}")
    if stuck and found:
        sys.exit(EXIT_JOB_FAILED)


def _aged_out(instance, specs) -> list[dict]:
    """The periods that left their source's lookback unloaded and wait for nobody's run but an
    operator's (those failed for good are listed with their job)."""
    from datetime import UTC, datetime

    from mostovik_pipelines.framework.automation.deadlines import deadline_state

    now = datetime.now(UTC)
    found = []
    for spec in specs:
        if spec.deadline is None:
            continue
        for period in deadline_state(instance, spec, now).late:
            if period.aged_out and not period.state.waiting_for_operator:
                found.append({
                    "source": spec.name, "period": period.key, "status": "waiting",
                    "run_id": period.state.latest_run, "aged_out": True,
                    "waiting_for_operator": [period.key],
                    "why": f"left the {spec.catch_up.lookback.days}-day lookback unloaded "
                           f"({period.why()})"})
    return found


def _with_recorded_loads(instance, found, source, job_type, period_from, period_to, limit):
    """The runs listed, with the loads the tracker's rebuild recorded from the ledger for
    runs run storage no longer has (their line says so), newest first."""
    from datetime import UTC, datetime

    from mostovik_pipelines.framework.runs.rebuild import recorded_jobs
    from mostovik_pipelines.sources import ALL_SOURCES

    recorded = [job for job in recorded_jobs(instance, ALL_SOURCES, source)
                if job_type in (None, job.job_type)
                and not (period_from and job.partitions[-1] < period_from)
                and not (period_to and job.partitions[0] > period_to)]
    if not recorded:
        return found
    oldest = datetime.min.replace(tzinfo=UTC)
    return sorted([*found, *recorded], key=lambda job: job.started_at or job.ended_at or oldest,
                  reverse=True)[:limit]


@jobs.command("show")
@click.argument("run_id")
@click.option("--json", "as_json", is_flag=True)
def jobs_show(run_id: str, as_json: bool) -> None:
    """Everything about one job: status, figures, attempts, context, errors."""
    from mostovik_pipelines.platform.tracking import JobNotFound, load_job
    from mostovik_pipelines.sources import ALL_SOURCES

    try:
        job = load_job(instance_of_home(), run_id, ALL_SOURCES)
    except JobNotFound as missing:
        fail(EXIT_NOT_FOUND, str(missing))
    data = job.as_dict()
    if as_json:
        click.echo(json.dumps(data, indent=1, default=str))
        return
    for key in ("run_id", "source", "job_type", "period", "status", "result", "run_status",
                "started_at", "ended_at", "duration_seconds", "launched_by", "requested_by",
                "reason", "executor",
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
