"""The alert notifier: a log line always, the webhook when set, retried when it fails
transiently, and its URL (a secret) never in a log or an alert."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from mostovik_pipelines.framework.retries import RetryPolicy
from mostovik_pipelines.resources.notifier import Alert, AlertNotifierResource
from mostovik_pipelines_tests.support.postgres import free_port
from mostovik_pipelines_tests.support.webhook import WebhookReceiver

FAST = RetryPolicy(max_attempts=3, base_delay_seconds=0.01, max_delay_seconds=0.02)
ALERT = Alert(kind="run_failure", source="cbr_daily_rates", period="2026-11-04",
              job_status="failed", error_class="permanent", error_kind="request_rejected",
              message="cbr_daily_rates [2026-11-04] extract: request rejected: HTTP 404",
              link="http://127.0.0.1:3000/runs/abc", run_id="abc")


@pytest.fixture
def receiver() -> Iterator[WebhookReceiver]:
    with WebhookReceiver() as running:
        yield running


def _notify(notifier: AlertNotifierResource, caplog) -> bool:
    with caplog.at_level(logging.INFO, logger="alerts"):
        return notifier.notify(ALERT, logging.getLogger("alerts"), FAST)


def test_without_a_webhook_an_alert_is_a_log_line(caplog):
    assert _notify(AlertNotifierResource(), caplog)
    assert caplog.messages == [
        "ALERT run_failure: cbr_daily_rates [2026-11-04] failed: cbr_daily_rates [2026-11-04] "
        "extract: request rejected: HTTP 404 (http://127.0.0.1:3000/runs/abc)"]


def test_the_webhook_gets_the_alert_as_json(receiver, caplog):
    assert _notify(AlertNotifierResource(webhook_url=receiver.url), caplog)
    assert receiver.alerts == [{
        "kind": "run_failure", "source": "cbr_daily_rates", "period": "2026-11-04",
        "job_status": "failed", "error_class": "permanent", "error_kind": "request_rejected",
        "message": ALERT.message, "link": ALERT.link, "run_id": "abc",
        "code_location": "mostovik_pipelines", "requested_by": None, "reason": None,
        "text": ALERT.summary()}]


def test_a_transient_failure_is_retried_and_the_alert_sent_once(receiver, caplog):
    receiver.fail_next(503, 429)
    assert _notify(AlertNotifierResource(webhook_url=receiver.url), caplog)
    assert receiver.requests == 3 and len(receiver.alerts) == 1
    assert sum("retrying" in m for m in caplog.messages) == 2
    assert not any(receiver.token in m for m in caplog.messages)


def test_a_refused_alert_is_not_retried_and_stays_in_the_log(receiver, caplog):
    receiver.fail_next(400)
    assert not _notify(AlertNotifierResource(webhook_url=receiver.url), caplog)
    assert receiver.requests == 1 and receiver.alerts == []
    assert "the alert webhook failed after 1 attempt(s) (request_rejected" in caplog.text
    assert ALERT.message in caplog.text
    assert receiver.token not in caplog.text


def test_an_unreachable_webhook_is_retried_then_given_up_without_naming_it(caplog):
    url = f"http://127.0.0.1:{free_port()}/hook/secret-token-123"
    assert not _notify(AlertNotifierResource(webhook_url=url), caplog)
    assert "failed after 3 attempt(s)" in caplog.text
    assert "secret-token-123" not in caplog.text
