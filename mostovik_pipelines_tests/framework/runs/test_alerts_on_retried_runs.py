"""A failed run whose retry comes gets no alert yet, at the real alert webhook, also when the
daemon's retry pass gave it up (``dagster/will_retry`` false: its code server was away as the
pass came) and the dead_runs sensor makes its retry (framework/runs/missed_retries.py); a run no
retry comes for is alerted."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import date

import pytest
from dagster import DagsterInstance

from mostovik_pipelines.core.dagster_compat import run_failed_unexpectedly
from mostovik_pipelines.sources import ALL_SOURCES
from mostovik_pipelines_tests.support.locations import code_location_for
from mostovik_pipelines_tests.support.webhook import WebhookReceiver, evaluate_run_failure_alerts

FAILING_DAY = date(2024, 3, 6)
RETRIES = {"run_retries": {"enabled": True, "max_retries": 1,
                           "retry_on_asset_or_op_failure": False}}


@pytest.fixture
def webhook() -> Iterator[WebhookReceiver]:
    with WebhookReceiver() as receiver:
        yield receiver


def test_a_run_given_up_by_the_retry_pass_is_not_alerted_a_step_failure_is(
    sqlite_warehouse_url, standin_server, standin, tmp_path, webhook
):
    job = code_location_for(sqlite_warehouse_url, standin_server, tmp_path,
                            ALL_SOURCES).resolve_job_def("cbr_daily_rates_job")
    with DagsterInstance.ephemeral(settings=RETRIES) as instance:
        given_up = instance.create_run_for_job(job, tags={"dagster/partition": "2024-03-05"})
        run_failed_unexpectedly(instance, given_up, "its process is gone")
        instance.add_run_tags(given_up.run_id, {"dagster/will_retry": "false"})  # as the pass
        evaluate_run_failure_alerts(instance, given_up.run_id, webhook, sqlite_warehouse_url)

        standin.fault("status", status=404, times=10, match=f"date_req={FAILING_DAY:%d/%m/%Y}")
        step_failed = job.execute_in_process(partition_key=FAILING_DAY.isoformat(),
                                             instance=instance, raise_on_error=False).run_id
        standin.clear_faults()
        evaluate_run_failure_alerts(instance, step_failed, webhook, sqlite_warehouse_url)

    webhook.wait_for(lambda alert: alert["run_id"] == step_failed)
    assert [alert for alert in webhook.alerts if alert["run_id"] == given_up.run_id] == []
