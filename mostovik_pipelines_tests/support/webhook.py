"""A local alert webhook: an HTTP server on 127.0.0.1 that keeps every JSON body posted to its
secret path, and can answer the next posts with a failure (to see them retried), be away for a
while (every post answered 503), or acknowledge a post too late for the sender (its answer lost
in transit). Like a receiver that honours idempotency keys, it tells a repeated key from a new
alert (:meth:`WebhookReceiver.delivered`)."""

from __future__ import annotations

import json
import secrets
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class WebhookReceiver:
    """``url`` carries a random token in its path, as real incoming webhooks do: a test can
    check that the token (a secret) never shows anywhere."""

    def __init__(self) -> None:
        self.token = secrets.token_hex(12)
        self.alerts: list[dict[str, Any]] = []
        self.requests = 0
        self.down = False
        """While set, every post is answered 503 (the webhook away)."""
        self._failures: list[int] = []
        self._late_acks = 0
        self.late_ack_seconds = 0.0
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                late = 0.0
                with receiver._lock:
                    receiver.requests += 1
                    status = receiver._failures.pop(0) if receiver._failures else 200
                    if receiver.down:
                        status = 503
                    if status == 200 and self.path == f"/hook/{receiver.token}":
                        receiver.alerts.append(json.loads(body))
                        if receiver._late_acks:
                            receiver._late_acks -= 1
                            late = receiver.late_ack_seconds
                    elif status == 200:
                        status = 404
                if late:
                    time.sleep(late)  # kept, but the sender has given up waiting for the answer
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/hook/{self.token}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> WebhookReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def fail_next(self, *statuses: int) -> None:
        """Answer the next posts with these statuses, one each."""
        with self._lock:
            self._failures.extend(statuses)

    def ack_late(self, times: int, seconds: float) -> None:
        """Keep the next ``times`` posts but answer each only after ``seconds``."""
        with self._lock:
            self._late_acks += times
            self.late_ack_seconds = seconds

    def delivered(self) -> dict[str, int]:
        """How many times each alert (by its idempotency key) was received."""
        counts: dict[str, int] = {}
        with self._lock:
            for alert in self.alerts:
                key = alert.get("idempotency_key", "")
                counts[key] = counts.get(key, 0) + 1
        return counts

    def wait_for(self, matching: Callable[[dict[str, Any]], bool], timeout: float = 60,
                 ) -> list[dict[str, Any]]:
        """The alerts received that match, once there is at least one; fails after ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                found = [alert for alert in self.alerts if matching(alert)]
            if found:
                return found
            if time.monotonic() > deadline:
                raise AssertionError(f"no matching alert in {timeout:.0f} s; received: "
                                     f"{self.alerts}")
            time.sleep(0.5)


def evaluate_run_failure_alerts(instance: Any, run_id: str, webhook: WebhookReceiver,
                                database_url: str) -> None:
    """The ``run_failure_alerts`` sensor evaluated on the failed run ``run_id``, as the daemon
    would, with its alerts sent to ``webhook`` through the outbox in the warehouse at
    ``database_url``."""
    from dagster import DagsterEventType, build_run_status_sensor_context

    from mostovik_pipelines.framework.runs.alerts import alert_sensors
    from mostovik_pipelines.resources.notifier import AlertNotifierResource
    from mostovik_pipelines.sources import ALL_SOURCES

    [sensor] = [s for s in alert_sensors(ALL_SOURCES) if s.name == "run_failure_alerts"]
    [failure] = instance.get_records_for_run(
        run_id, of_type=DagsterEventType.RUN_FAILURE).records
    sensor(build_run_status_sensor_context(
        "run_failure_alerts", failure.event_log_entry.dagster_event, instance,
        instance.get_run_by_id(run_id),
        resources={"alert_notifier": AlertNotifierResource(
            database_url=database_url, webhook_url=webhook.url)},
    ).for_run_failure())
