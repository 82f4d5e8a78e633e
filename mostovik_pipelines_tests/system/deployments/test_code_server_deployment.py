"""The production layout with one code server (deploy/systemd/mostovik-code-server.service): the
webserver and the daemon load no code, they reach ``dagster code-server start`` over gRPC through
deploy/workspace.yaml, the runs the daemon launches start from that server, and their steps run
on a Celery worker (``MOSTOVIK_EXECUTOR=celery``, Redis as broker), as deploy/README sets it up.

A deploy of new code is what deploy/README's "Deploy new code" says: the new code installed, the
location reloaded as the UI's "Reload" does, the workers restarted (they import the code
themselves). The released code here is a module of the test's own
(the package's definitions, and in the second release one more asset check), so that the test
changes the code without touching the installed package.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from mostovik_pipelines.standin import StandinClient, StandinServer
from mostovik_pipelines_tests.support.celery_workers import REPO, CeleryWorker
from mostovik_pipelines_tests.support.code_server import WORKSPACE, CodeServer, reload_location
from mostovik_pipelines_tests.support.deployments import celery_deployment
from mostovik_pipelines_tests.support.instances import create_instance_storage
from mostovik_pipelines_tests.support.postgres import ThrowawayPostgres
from mostovik_pipelines_tests.support.redis import ThrowawayRedis
from mostovik_pipelines_tests.support.waiting import wait_for_hanging_request
from mostovik_pipelines_tests.support.warehouse import table_rows
from mostovik_pipelines_tests.support.webserver import DagsterServices

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

ASSET = "cbr_daily_rates"
JOB = "cbr_daily_rates_job"
RELEASE_MODULE = "mostovik_release"
NEW_CHECK = "second_release_check"
IN_FLIGHT_PARTITION = "2026-11-03"
NEXT_PARTITION = "2026-11-04"
RATES_PER_DATE = 12

FIRST_RELEASE = """\
from mostovik_pipelines.definitions import defs  # noqa: F401
"""
SECOND_RELEASE = f"""\
from dagster import AssetCheckResult, Definitions, asset_check

from mostovik_pipelines.definitions import defs as released


@asset_check(asset="{ASSET}", description="Added by the second release.")
def {NEW_CHECK}():
    return AssetCheckResult(passed=True)


defs = Definitions.merge(released, Definitions(asset_checks=[{NEW_CHECK}]))
"""


def _release(release_dir: Path, code: str) -> None:
    """Install a release: the module the code server imports, written whole beside its place
    and renamed into it."""
    staged = release_dir / f".{RELEASE_MODULE}.py.new"
    staged.write_text(code)
    staged.replace(release_dir / f"{RELEASE_MODULE}.py")


@pytest.fixture(scope="module")
def deployment(postgres: ThrowawayPostgres, redis_server: ThrowawayRedis,
               standin_server: StandinServer, tmp_path_factory: pytest.TempPathFactory
               ) -> Iterator[tuple[DagsterServices, CeleryWorker, Path]]:
    """The code server and a Celery worker on the first release, then the webserver and the
    daemon on deploy/workspace.yaml, on a fresh production instance and warehouse."""
    work_dir = tmp_path_factory.mktemp("code_server")
    release_dir = work_dir / "release"
    release_dir.mkdir()
    _release(release_dir, FIRST_RELEASE)
    with celery_deployment(postgres, redis_server, standin_server, work_dir, "cs") as (
            home, environment):
        environment["PYTHONPATH"] = os.pathsep.join([str(release_dir), str(REPO)])
        code_server = CodeServer(RELEASE_MODULE, release_dir, work_dir / "code_server.log")
        environment.update(code_server.settings)
        services = DagsterServices(work_dir, home, environment, workspace_file=WORKSPACE,
                                   stopped_schedules=["erp_work_orders_schedule"])
        worker = CeleryWorker("worker-a", work_dir / "worker-a.log")
        try:
            create_instance_storage(home, services.environment)
            worker.start(services.environment, cwd=release_dir).wait_ready()
            code_server.start(services.environment)
            with services as running:
                yield running, worker, release_dir
        finally:
            code_server.stop()
            worker.stop()


def _rates_of(warehouse_url: str, partition: str) -> int:
    return sum(1 for row in table_rows(warehouse_url, ASSET)
               if str(row["partition_date"]) == partition)


def test_a_reload_while_a_run_is_in_flight_finishes_it_and_the_next_run_uses_the_new_code(
        deployment, standin: StandinClient):
    services, worker, release_dir = deployment
    graphql = services.graphql
    warehouse_url = services.environment["MOSTOVIK_DATABASE_URL"]
    assert f"{ASSET}:{NEW_CHECK}" not in graphql.repository_contents().asset_checks
    # The services reach the code server and load no code themselves.
    assert "grpc_server" in services.workspace_file.read_text()

    standin.fault("hang", seconds=300, times=1)
    in_flight = graphql.launch_job_run(JOB, IN_FLIGHT_PARTITION)
    wait_for_hanging_request(standin)

    _release(release_dir, SECOND_RELEASE)
    reload_location(graphql)
    assert f"{ASSET}:{NEW_CHECK}" in graphql.repository_contents().asset_checks
    assert graphql.run(in_flight).status == "STARTED"

    standin.release_hangs()
    finished = graphql.wait_for_run(in_flight)
    assert finished.status == "SUCCESS", graphql.run_errors(in_flight)
    assert _rates_of(warehouse_url, IN_FLIGHT_PARTITION) == RATES_PER_DATE
    # It ran the code it started with: the check of the second release is not in it.
    assert not graphql.check_executions(ASSET, NEW_CHECK, IN_FLIGHT_PARTITION)
    # Its steps ran on the worker.
    assert worker.succeeded_task_ids()

    # The worker imported the first release when it started: the runbook restarts it.
    worker.stop()
    restarted = CeleryWorker(worker.name, worker.log_path.with_name("worker-a-restarted.log"))
    try:
        restarted.start(services.environment, cwd=release_dir).wait_ready()
        following = graphql.launch_job_run(JOB, NEXT_PARTITION)
        finished = graphql.wait_for_run(following)
        assert finished.status == "SUCCESS", graphql.run_errors(following)
        assert restarted.succeeded_task_ids()
    finally:
        restarted.stop()
    assert _rates_of(warehouse_url, NEXT_PARTITION) == RATES_PER_DATE
    executions = graphql.check_executions(ASSET, NEW_CHECK)
    assert [execution["runId"] for execution in executions] == [following], executions
