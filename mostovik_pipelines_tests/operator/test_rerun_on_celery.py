"""``mostovik jobs rerun`` on the production deployment with the Celery executor: the range's
backfill is launched by the daemon and its steps run on the Celery workers (the deployment of
test_celery_deployment.py: deploy/dagster.yaml on PostgreSQL, Redis, two workers)."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import datetime, timedelta
from pathlib import Path
from zoneinfo import ZoneInfo

import psycopg
import pytest

from mostovik_pipelines.core.tags import REASON_TAG, REQUESTED_BY_TAG
from mostovik_pipelines_tests.support.deployments import step_workers, two_worker_deployment
from mostovik_pipelines_tests.support.postgres import dsn_of
from mostovik_pipelines_tests.support.run_queue import run_queue_daemon

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

MOSTOVIK = str(Path(sys.executable).parent / "mostovik")
MOSCOW = ZoneInfo("Europe/Moscow")
_TUESDAY = (datetime.now(MOSCOW).date()
            - timedelta(days=datetime.now(MOSCOW).weekday() + 42 - 1))
DAYS = [(_TUESDAY + timedelta(days=n)).isoformat() for n in range(3)]


@pytest.fixture(scope="module")
def deployment(postgres, redis_server, standin_server, tmp_path_factory):
    """Two Celery workers on a fresh production deployment of this module's own."""
    with two_worker_deployment(postgres, redis_server, standin_server,
                               tmp_path_factory.mktemp("rerun_on_celery")) as deployment:
        yield deployment


@pytest.mark.timeout(900)
def test_a_range_rerun_runs_its_steps_on_the_celery_workers(deployment):
    environment = deployment.environment
    with run_queue_daemon(environment, deployment.work_dir / "daemon") as services:
        done = subprocess.run(
            [MOSTOVIK, "jobs", "rerun", "--source", "cbr_daily_rates", "--from", DAYS[0],
             "--to", DAYS[-1], "--only", "missing", "--as", "ops", "--reason", "celery check",
             "--json", "--wait"], env=services.environment, cwd=deployment.work_dir,
            capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout + done.stderr
        [plan] = json.loads(done.stdout)["sources"]
        assert plan["runs"] == [DAYS]
        [run] = services.graphql.runs_of_backfill(plan["backfill_id"])
        assert run.status == "SUCCESS"
        assert (run.tags[REQUESTED_BY_TAG], run.tags[REASON_TAG]) == ("ops", "celery check")
    with deployment.instance() as instance:
        workers = step_workers(instance, run.run_id)
    assert workers and {worker.partition("@")[0] for worker in workers.values()} <= {
        "worker-a", "worker-b"}, workers
    with psycopg.connect(dsn_of(deployment.warehouse_url)) as connection:
        counts = dict(connection.execute(
            "SELECT partition_date::text, count(*) FROM cbr_daily_rates "
            "WHERE partition_date = ANY(%s::date[]) GROUP BY partition_date", (DAYS,)).fetchall())
    assert counts == dict.fromkeys(DAYS, 12)
