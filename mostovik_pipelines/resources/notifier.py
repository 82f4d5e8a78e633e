"""Where alerts go: a log line always, and an HTTP webhook when ``MOSTOVIK_ALERT_WEBHOOK_URL`` is
set: a JSON POST of the alert's fields, with the summary line as ``text`` too, which Slack- and
Mattermost-style incoming webhooks show as the message.

The webhook URL is a secret (such URLs carry their token): it is read through ``EnvVar``, never
logged, never put in an alert. An alert holds what an operator needs to act and nothing more:
source, period, job status, the error's class and message (already free of credentials, see
the security tests), a link to the run or asset in the Dagster UI, and for a run someone asked
for, who and why.

A webhook that fails transiently (connection refused, timeout, 429, 5xx) is retried through the
project's one retry policy and classifier; when it still fails, the error is logged with the
alert and the sensor goes on: a lost webhook never repeats the other alerts of its tick.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass

from dagster import ConfigurableResource

from mostovik_pipelines.framework.errors import classify
from mostovik_pipelines.framework.retries import RetryPolicy
from mostovik_pipelines.resources.http import raise_for_status

WEBHOOK_RETRY = RetryPolicy(max_attempts=3, base_delay_seconds=1.0, max_delay_seconds=5.0,
                            retry_after_cap_seconds=5.0)
"""Three attempts within ~10 s: a sensor tick has a minute for all its alerts."""
WEBHOOK_SHOWN = "the alert webhook"
"""How a failing webhook is named in logs: never by its URL."""


@dataclass(frozen=True)
class Alert:
    """One alert: a failed job, a source whose data is stale, or one that changed what it
    sends."""

    kind: str
    """``run_failure``, ``freshness`` or ``source_shape``."""
    source: str | None
    period: str | None
    job_status: str
    """The ADR-016 status (``failed``), ``stale`` for a freshness alert, ``failed`` or
    ``loaded`` for a change of shape (what its partitions do)."""
    error_class: str | None
    """``transient``, ``permanent``, ``unclassified``, or ``freshness``."""
    error_kind: str | None
    message: str
    link: str
    """The run (or the asset) in the Dagster UI."""
    run_id: str | None = None
    code_location: str = "mostovik_pipelines"
    requested_by: str | None = None
    """Who asked for the run, when someone did (an operator's re-run)."""
    reason: str | None = None
    """Why they asked for it."""

    def summary(self) -> str:
        asked = (f" [asked by {self.requested_by or '-'}: {self.reason or '-'}]"
                 if self.requested_by or self.reason else "")
        return (f"ALERT {self.kind}: {self.source or '-'} [{self.period or '-'}] "
                f"{self.job_status}: {self.message}{asked} ({self.link})")


class AlertNotifierResource(ConfigurableResource):
    """Sends alerts: a log line, and a JSON POST to ``webhook_url`` when it is set (configure
    it with ``EnvVar("MOSTOVIK_ALERT_WEBHOOK_URL")``)."""

    webhook_url: str | None = None
    ui_url: str = "http://127.0.0.1:3000"
    """The Dagster UI's address as operators reach it, for the links in alerts."""
    timeout_seconds: float = 5.0

    def run_link(self, run_id: str) -> str:
        return f"{self.ui_url.rstrip('/')}/runs/{run_id}"

    def asset_link(self, asset_key: str) -> str:
        return f"{self.ui_url.rstrip('/')}/assets/{asset_key}"

    def notify(self, alert: Alert, log: logging.Logger, policy: RetryPolicy = WEBHOOK_RETRY,
               ) -> bool:
        """Log the alert and post it to the webhook, if any; whether it was delivered."""
        log.warning(alert.summary())
        if not self.webhook_url:
            return True
        import httpx  # only a sensor that raises an alert posts it

        body = json.dumps({**asdict(alert), "text": alert.summary()},
                          ensure_ascii=False).encode()
        for attempt in range(1, policy.max_attempts + 1):
            try:
                response = httpx.post(self.webhook_url, content=body, timeout=self.timeout_seconds,
                                      headers={"Content-Type": "application/json"})
                raise_for_status(response, WEBHOOK_SHOWN)
                return True
            except Exception as exc:
                verdict = classify(exc)
                # httpx names the URL in some errors: the reason is kept, never the address.
                reason = verdict.reason.replace(self.webhook_url, WEBHOOK_SHOWN)
                if not verdict.transient or attempt == policy.max_attempts:
                    log.error(f"{WEBHOOK_SHOWN} failed after {attempt} attempt(s) "
                              f"({verdict.kind}: {reason}); the alert is only in this log")
                    return False
                wait = policy.wait_seconds(attempt, verdict.retry_after)
                log.warning(f"{WEBHOOK_SHOWN}: attempt {attempt} of {policy.max_attempts} failed "
                            f"({verdict.kind}: {reason}); retrying in {wait:.1f}s")
                time.sleep(wait)
        return False
