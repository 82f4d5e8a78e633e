"""The production deployment with its stores in object storage: deploy/dagster.yaml on
PostgreSQL, Redis as Celery broker, two Celery workers, and the landing store and the op
outputs as ``s3://`` URLs on an S3 API server (moto's, on 127.0.0.1). Each worker and the
orchestrating runs have a working directory, a DAGSTER_HOME and local state of their own: they
share nothing but the databases, the broker and the buckets, as workers on separate machines.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from dagster import DagsterRunStatus, RunsFilter

from mostovik_pipelines.standin import StandinServer
from mostovik_pipelines_tests.support.deployments import (
    CBR_JOB,
    JOB,
    PARTITION_TAG,
    WORKERS,
    Deployment,
    business_rows,
    celery_deployment,
    load_cleanly,
    step_workers,
)
from mostovik_pipelines_tests.support.instances import create_instance_storage
from mostovik_pipelines_tests.support.object_store import S3ApiServer, why_no_s3_api
from mostovik_pipelines_tests.support.postgres import ThrowawayPostgres
from mostovik_pipelines_tests.support.redis import ThrowawayRedis
from mostovik_pipelines_tests.support.waiting import PROCESS_START_MARGIN_SECONDS

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

BACKFILL = ["2026-11-02", "2026-11-03", "2026-11-04", "2026-11-05"]
LANDING_URL = "s3://mostovik-landing/raw"
STORAGE_URL = "s3://mostovik-outputs/runs"


@pytest.fixture(scope="module")
def s3_server() -> Iterator[S3ApiServer]:
    if reason := why_no_s3_api():
        pytest.skip(reason)
    server = S3ApiServer().start()
    try:
        for bucket in ("mostovik-landing", "mostovik-outputs"):
            server.bucket(bucket)
        yield server
    finally:
        server.close()


def _machine(work_dir: Path, name: str, home: Path, environment: dict[str, str]
             ) -> tuple[Path, dict[str, str]]:
    """A working directory of its own for ``name``, as on a machine of its own: a copy of the
    instance's configuration and its own local state; the stores are the buckets."""
    own = work_dir / name
    (own / "dagster_home").mkdir(parents=True)
    shutil.copy(home / "dagster.yaml", own / "dagster_home" / "dagster.yaml")
    return own, {
        **environment,
        "DAGSTER_HOME": str(own / "dagster_home"),
        "MOSTOVIK_DAGSTER_ARTIFACT_DIR": str(own / "artifacts"),
        "MOSTOVIK_DAGSTER_LOG_DIR": str(own / "compute_logs"),
        "MOSTOVIK_DATA_DIR": str(own / "data"),
    }


@pytest.fixture(scope="module")
def deployment(
    postgres: ThrowawayPostgres, redis_server: ThrowawayRedis, standin_server: StandinServer,
    s3_server: S3ApiServer, tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Deployment]:
    work_dir = tmp_path_factory.mktemp("celery_on_s3")
    (work_dir / "setup").mkdir()
    with celery_deployment(postgres, redis_server, standin_server, work_dir / "setup", "s3",
                           broker_db=2) as (home, shared):
        shared.update({
            **s3_server.environment,
            "MOSTOVIK_CBR_TIMEOUT_SECONDS": str(PROCESS_START_MARGIN_SECONDS * 3),
            "MOSTOVIK_LANDING_DIR": LANDING_URL,
            "MOSTOVIK_STORAGE_DIR": STORAGE_URL,
        })
        orchestrator_dir, orchestrator = _machine(work_dir, "orchestrator", home, shared)
        deployment = Deployment(home, orchestrator_dir, orchestrator,
                                shared["MOSTOVIK_DATABASE_URL"],
                                secrets=[redis_server.password, postgres.password,
                                         s3_server.secret])
        try:
            create_instance_storage(home, orchestrator)
            deployment.start_workers(lambda name: _machine(work_dir, name, home, shared))
            deployment.machines = [work_dir / name for name in ("orchestrator", *WORKERS)]
            yield deployment
        finally:
            deployment.stop()


def test_a_backfill_over_two_workers_sharing_only_the_buckets_equals_the_in_process_result(
    deployment, s3_server, standin, standin_server, pg_warehouse_url, tmp_path
):
    processes = [deployment.start_run(*CBR_JOB, **{PARTITION_TAG: partition})
                 for partition in BACKFILL]
    codes = [deployment.finish(process) for process in processes]
    assert codes == [0] * len(BACKFILL), "\n".join(deployment.outputs[-4:])[-5000:]

    with deployment.instance() as instance:
        runs = instance.get_runs(RunsFilter(job_name=JOB, tags={PARTITION_TAG: BACKFILL}))
        assert {run.status for run in runs} == {DagsterRunStatus.SUCCESS}
        placements = [host for run in runs for host in step_workers(instance, run.run_id).values()]
        run_ids = {run.run_id for run in runs}
    # A step's output was written on one machine and read on another: only through the bucket.
    assert {host for host in placements} == {w.hostname for w in deployment.workers.values()}
    outputs = s3_server.buckets.objects("mostovik-outputs")
    assert {key.split("/")[1] for key in outputs} == run_ids
    landed = s3_server.buckets.objects("mostovik-landing")
    for partition in BACKFILL:
        assert any(key.startswith(f"raw/cbr_daily_rates/{partition}/fetches/") for key in landed)
    # No machine kept a store of its own on its disk.
    for machine in deployment.machines:
        assert not [p for p in machine.rglob("*") if p.name in ("landing", "storage")], machine

    load_cleanly(pg_warehouse_url, standin_server, tmp_path, BACKFILL)
    assert business_rows(deployment.warehouse_url) == business_rows(pg_warehouse_url)
    texts = deployment.outputs + [w.log() for w in deployment.workers.values()]
    for secret in deployment.secrets:
        assert not any(secret in text for text in texts)


def test_the_daily_prune_on_the_deployment_removes_the_runs_outputs_from_the_bucket(
    deployment, s3_server
):
    """The prune job, run as the schedule runs it, reaches the buckets through the same
    settings: the successful runs' op outputs go (grace 0), every partition's latest payload
    stays."""
    landed_before = s3_server.buckets.objects("mostovik-landing")
    assert s3_server.buckets.objects("mostovik-outputs")
    process = deployment.start_run("-m", "mostovik_pipelines", "-j", "prune_storage_job",
                                   settings={"MOSTOVIK_RETENTION_GRACE_DAYS": "0"})
    assert deployment.finish(process) == 0, deployment.outputs[-1][-3000:]
    assert not s3_server.buckets.objects("mostovik-outputs")
    assert s3_server.buckets.objects("mostovik-landing") == landed_before
    with deployment.instance() as instance:
        (run,) = instance.get_runs(RunsFilter(job_name="prune_storage_job"))
        assert run.status == DagsterRunStatus.SUCCESS
        logged = [entry.user_message for entry in instance.all_logs(run.run_id)]
    assert any(message.startswith("op outputs: removed") for message in logged), logged
