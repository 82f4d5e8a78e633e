"""An alert about a run someone asked for names who and why (the run's ``mostovik/requested_by``
and ``mostovik/reason`` tags), in its fields and its text, at the real alert webhook; a run
nobody signed says nothing of the kind."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import date

import pytest
from dagster import DagsterInstance

from mostovik_pipelines.core.tags import REASON_TAG, REQUESTED_BY_TAG
from mostovik_pipelines.sources import ALL_SOURCES
from mostovik_pipelines_tests.support.locations import code_location_for
from mostovik_pipelines_tests.support.webhook import WebhookReceiver, evaluate_run_failure_alerts

FAILING_DAY = date(2024, 3, 5)
WHO = "a.petrova"
WHY = "source was down 4-8 March, ticket OPS-112"


@pytest.fixture
def webhook() -> Iterator[WebhookReceiver]:
    with WebhookReceiver() as receiver:
        yield receiver


def _failed_run(job, instance: DagsterInstance, standin, tags: dict[str, str]) -> str:
    """A run of the CBR job for :data:`FAILING_DAY` that fails (the source answers 404)."""
    standin.fault("status", status=404, times=10, match=f"date_req={FAILING_DAY:%d/%m/%Y}")
    result = job.execute_in_process(partition_key=FAILING_DAY.isoformat(), instance=instance,
                                    raise_on_error=False, tags=tags)
    standin.clear_faults()
    assert not result.success
    return result.run_id


def _alert_for(instance: DagsterInstance, run_id: str, webhook: WebhookReceiver,
               warehouse_url: str) -> dict:
    """The run-failure sensor evaluated on the failed run, as the daemon would; its alert."""
    evaluate_run_failure_alerts(instance, run_id, webhook, warehouse_url)
    [alert] = webhook.wait_for(lambda alert: alert["run_id"] == run_id)
    return alert


def test_an_alert_about_a_signed_run_names_who_asked_for_it_and_why(
    sqlite_warehouse_url, standin_server, standin, tmp_path, webhook
):
    job = code_location_for(sqlite_warehouse_url, standin_server, tmp_path,
                            ALL_SOURCES).resolve_job_def("cbr_daily_rates_job")
    with DagsterInstance.ephemeral() as instance:
        signed = _failed_run(job, instance, standin, {REQUESTED_BY_TAG: WHO, REASON_TAG: WHY})
        unsigned = _failed_run(job, instance, standin, {})
        signed_alert = _alert_for(instance, signed, webhook, sqlite_warehouse_url)
        unsigned_alert = _alert_for(instance, unsigned, webhook, sqlite_warehouse_url)

    assert (signed_alert["requested_by"], signed_alert["reason"]) == (WHO, WHY)
    assert f"asked by {WHO}: {WHY}" in signed_alert["text"]
    assert (signed_alert["source"], signed_alert["period"]) == (
        "cbr_daily_rates", FAILING_DAY.isoformat())
    assert (unsigned_alert["requested_by"], unsigned_alert["reason"]) == (None, None)
    assert "asked by" not in unsigned_alert["text"]

