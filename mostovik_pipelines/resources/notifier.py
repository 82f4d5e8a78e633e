"""Where alerts go: a log line always, the durable outbox (:mod:`.alert_outbox`, a table in the
warehouse), and from there an HTTP webhook when ``MOSTOVIK_ALERT_WEBHOOK_URL`` is set: a JSON POST
of the alert's fields, with the summary line as ``text`` too, which Slack- and Mattermost-style
incoming webhooks show as the message.

:meth:`AlertNotifierResource.notify` is the one way an alert is sent: it writes the alert to the
outbox under its idempotency key (once, however often it is called for the same thing) and
tries to deliver it at once; what the webhook did not acknowledge stays pending and is delivered
by the ``alert_outbox`` sensor (:meth:`AlertNotifierResource.deliver_pending`), with backoff,
until it is. An alert is delivered or pending, never only in a log.

The webhook URL is a secret (such URLs carry their token): it is read through ``EnvVar``, never
logged, never put in an alert or the outbox. An alert holds what an operator needs to act and
nothing more: source, period, job status, the error's class and message (already free of
credentials, see the security tests), a link to the run or asset in the Dagster UI, and for a
run someone asked for, who and why.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict, dataclass
from datetime import UTC, datetime

from dagster import ConfigurableResource

from mostovik_pipelines.core.errors import classify
from mostovik_pipelines.resources import alert_outbox
from mostovik_pipelines.resources.http import raise_for_status
from mostovik_pipelines.resources.warehouse import warehouse_engine

DELIVERIES_PER_TICK = 50
"""Pending alerts the ``alert_outbox`` sensor tries per tick (each post at most its timeout)."""
KEY_LENGTH = 255
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
    subject: str | None = None
    """What the alert is about within its kind and source (a change's fingerprint, a late
    period); by default its run and its period: with them, its idempotency key."""

    @property
    def idempotency_key(self) -> str:
        """The same thing alerted twice has the same key: it is written and sent once."""
        subject = self.subject or ":".join(part for part in (self.run_id, self.period) if part)
        key = f"{self.kind}:{self.source or '-'}:{subject}"
        if len(key) <= KEY_LENGTH:
            return key
        return f"{key[:KEY_LENGTH - 17]}#{hashlib.sha256(key.encode()).hexdigest()[:16]}"

    def body(self) -> dict:
        """What the webhook is posted (the JSON object), the idempotency key with it."""
        return {**asdict(self), "idempotency_key": self.idempotency_key,
                "text": self.summary()}

    def summary(self) -> str:
        asked = (f" [asked by {self.requested_by or '-'}: {self.reason or '-'}]"
                 if self.requested_by or self.reason else "")
        return (f"ALERT {self.kind}: {self.source or '-'} [{self.period or '-'}] "
                f"{self.job_status}: {self.message}{asked} ({self.link})")


class AlertNotifierResource(ConfigurableResource):
    """Sends alerts: a log line, the outbox in the warehouse at ``database_url``, and a JSON POST
    to ``webhook_url`` when it is set (configure both with ``EnvVar``:
    ``MOSTOVIK_DATABASE_URL``, ``MOSTOVIK_ALERT_WEBHOOK_URL``)."""

    database_url: str
    """The warehouse that holds the outbox."""
    webhook_url: str | None = None
    ui_url: str = "http://127.0.0.1:3000"
    """The Dagster UI's address as operators reach it, for the links in alerts."""
    timeout_seconds: float = 5.0

    def run_link(self, run_id: str) -> str:
        return f"{self.ui_url.rstrip('/')}/runs/{run_id}"

    def asset_link(self, asset_key: str) -> str:
        return f"{self.ui_url.rstrip('/')}/assets/{asset_key}"

    def notify(self, alert: Alert, log: logging.Logger, now: datetime | None = None) -> bool:
        """Send ``alert``: log it, keep it in the outbox (once per idempotency key) and try to
        deliver it now; whether it has been delivered (if not, it is pending and the
        ``alert_outbox`` sensor delivers it). An alert already in the outbox is not sent
        again."""
        now = now or datetime.now(UTC)
        engine = warehouse_engine(self.database_url)
        key = alert.idempotency_key
        if not alert_outbox.write(engine, key, alert.body(), now):
            log.info(f"alert {key} is in the outbox already: not sent again")
            return True
        log.warning(alert.summary())
        sent, _ = self._deliver(engine, alert_outbox.take_due(engine, now, 1, keys=[key]),
                                log, now)
        return sent == 1

    def deliver_pending(self, log: logging.Logger, now: datetime | None = None,
                        limit: int = DELIVERIES_PER_TICK) -> tuple[int, int]:
        """Deliver the pending alerts whose backoff has passed, oldest first: (sent, still
        pending among those tried)."""
        now = now or datetime.now(UTC)
        engine = warehouse_engine(self.database_url)
        return self._deliver(engine, alert_outbox.take_due(engine, now, limit), log, now)

    def _deliver(self, engine, pending: list[alert_outbox.PendingAlert], log: logging.Logger,
                 now: datetime) -> tuple[int, int]:
        sent = failed = 0
        for alert in pending:
            if not self.webhook_url:
                alert_outbox.mark_sent(engine, alert.idempotency_key, now, "log")
                sent += 1
                continue
            error = self._post(alert)
            if error is None:
                alert_outbox.mark_sent(engine, alert.idempotency_key, now, "webhook")
                sent += 1
                continue
            failed += 1
            again = alert_outbox.mark_failed(engine, alert.idempotency_key, now,
                                             alert.attempts + 1, error)
            log.warning(f"{WEBHOOK_SHOWN}: delivery {alert.attempts + 1} of alert "
                        f"{alert.idempotency_key} failed ({error}); it stays in the outbox, "
                        f"tried again from {again.isoformat(timespec='seconds')}")
        return sent, failed

    def _post(self, alert: alert_outbox.PendingAlert) -> str | None:
        """Post one alert; None once the webhook acknowledged it (2xx), else why not (the
        webhook's address never in it)."""
        import httpx  # only a process that delivers an alert posts it

        assert self.webhook_url is not None
        try:
            response = httpx.post(
                self.webhook_url, timeout=self.timeout_seconds,
                content=json.dumps(alert.body, ensure_ascii=False).encode(),
                headers={"Content-Type": "application/json",
                         "Idempotency-Key": alert.idempotency_key})
            raise_for_status(response, WEBHOOK_SHOWN)
            return None
        except Exception as exc:
            verdict = classify(exc)
            # httpx names the URL in some errors: the reason is kept, never the address.
            return f"{verdict.kind}: {verdict.reason.replace(self.webhook_url, WEBHOOK_SHOWN)}"
