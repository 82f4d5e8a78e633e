"""The alert notifier and its outbox: an alert is a row of the warehouse before it is posted,
marked sent only once the webhook acknowledged it, and delivered again with backoff until it
is; each carries an idempotency key, so the same alert is written and sent once, and a receiver
can drop a repeat whose acknowledgement was lost. A webhook away for an hour loses none and
doubles none. Its URL (a secret) is never in a log, an alert or the outbox."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import select

from mostovik_pipelines.resources import alert_outbox
from mostovik_pipelines.resources.notifier import Alert, AlertNotifierResource
from mostovik_pipelines.resources.warehouse import warehouse_engine
from mostovik_pipelines.warehouse.schema import alert_outbox as outbox_table
from mostovik_pipelines_tests.support.webhook import WebhookReceiver

ALERT = Alert(kind="run_failure", source="cbr_daily_rates", period="2026-11-04",
              job_status="failed", error_class="permanent", error_kind="request_rejected",
              message="cbr_daily_rates [2026-11-04] extract: request rejected: HTTP 404",
              link="http://127.0.0.1:3000/runs/abc", run_id="abc")
START = datetime(2026, 11, 4, 16, 30, tzinfo=UTC)
TICK = timedelta(seconds=15)
"""The ``alert_outbox`` sensor's interval."""


@pytest.fixture
def receiver() -> Iterator[WebhookReceiver]:
    with WebhookReceiver() as running:
        yield running


def _alert(n: int) -> Alert:
    return Alert(kind="run_failure", source="cbr_daily_rates", period=f"2026-11-0{n}",
                 job_status="failed", error_class="transient", error_kind="source_unavailable",
                 message=f"alert {n}", link=f"http://127.0.0.1:3000/runs/run-{n}",
                 run_id=f"run-{n}")


def _rows(url: str) -> list[dict]:
    with warehouse_engine(url).connect() as connection:
        return [dict(row._mapping) for row in connection.execute(select(outbox_table))]


def test_without_a_webhook_an_alert_is_a_log_line_kept_in_the_outbox(
        sqlite_warehouse_url, caplog):
    with caplog.at_level(logging.INFO, logger="alerts"):
        assert AlertNotifierResource(database_url=sqlite_warehouse_url).notify(
            ALERT, logging.getLogger("alerts"))
    assert caplog.messages == [
        "ALERT run_failure: cbr_daily_rates [2026-11-04] failed: cbr_daily_rates [2026-11-04] "
        "extract: request rejected: HTTP 404 (http://127.0.0.1:3000/runs/abc)"]
    [row] = _rows(sqlite_warehouse_url)
    assert (row["idempotency_key"], row["channel"]) == (
        "run_failure:cbr_daily_rates:abc:2026-11-04", "log")
    assert row["sent_at"] is not None


def test_the_webhook_gets_the_alert_as_json_with_its_idempotency_key_once(
        warehouse_url, receiver):
    notifier = AlertNotifierResource(database_url=warehouse_url, webhook_url=receiver.url)
    log = logging.getLogger("alerts")
    assert notifier.notify(ALERT, log)
    assert receiver.alerts == [{
        "kind": "run_failure", "source": "cbr_daily_rates", "period": "2026-11-04",
        "job_status": "failed", "error_class": "permanent", "error_kind": "request_rejected",
        "message": ALERT.message, "link": ALERT.link, "run_id": "abc",
        "code_location": "mostovik_pipelines", "requested_by": None, "reason": None,
        "subject": None, "idempotency_key": "run_failure:cbr_daily_rates:abc:2026-11-04",
        "text": ALERT.summary()}]
    # The same alert again (a sensor evaluated twice, a lost cursor): written and sent once.
    assert notifier.notify(ALERT, log)
    assert notifier.deliver_pending(log, START + timedelta(days=1)) == (0, 0)
    assert receiver.requests == 1 and len(_rows(warehouse_url)) == 1


def test_a_webhook_away_for_an_hour_loses_none_and_doubles_none(
        warehouse_url, receiver, caplog):
    """Three alerts raised while the webhook is away for an hour, the outbox drained at every
    tick of its sensor: each is tried with backoff (never more than one post per five
    minutes), none is given up, and within a backoff of the webhook's return each has arrived
    exactly once."""
    notifier = AlertNotifierResource(database_url=warehouse_url, webhook_url=receiver.url)
    log = logging.getLogger("alerts")
    receiver.down = True
    raised = {START: _alert(1), START + timedelta(minutes=10): _alert(2),
              START + timedelta(minutes=59): _alert(3)}
    back = START + timedelta(hours=1)
    now = START
    with caplog.at_level(logging.INFO, logger="alerts"):
        while now < back:
            if now in raised:
                assert not notifier.notify(raised[now], log, now)
            notifier.deliver_pending(log, now)
            now += TICK
        assert receiver.alerts == []
        assert alert_outbox.pending_count(warehouse_engine(warehouse_url)) == 3
        # Backoff: at most a post per alert per five minutes (15 s doubling, capped), not one
        # per tick.
        assert receiver.requests <= 3 * (60 // 5 + 4), receiver.requests
        posts_while_away = receiver.requests

        receiver.down = False
        while now < back + alert_outbox.MAX_BACKOFF + TICK:
            notifier.deliver_pending(log, now)
            now += TICK
    assert receiver.delivered() == {alert.idempotency_key: 1 for alert in raised.values()}
    assert receiver.requests == posts_while_away + 3
    assert alert_outbox.pending_count(warehouse_engine(warehouse_url)) == 0
    assert all(row["sent_at"] is not None and row["channel"] == "webhook"
               for row in _rows(warehouse_url))
    assert receiver.token not in caplog.text
    assert all(receiver.token not in row["body"] and receiver.token not in (
        row["last_error"] or "") for row in _rows(warehouse_url))


def test_an_acknowledgement_lost_in_transit_is_sent_again_under_the_same_key(
        sqlite_warehouse_url, receiver):
    """The webhook kept the post but its answer came after the sender's timeout: the alert
    stays pending and goes again with the same idempotency key, which a receiver that honours
    keys (as this one counts) takes as the same alert."""
    notifier = AlertNotifierResource(database_url=sqlite_warehouse_url,
                                     webhook_url=receiver.url, timeout_seconds=0.5)
    log = logging.getLogger("alerts")
    receiver.ack_late(1, seconds=2.0)
    assert not notifier.notify(ALERT, log, START)
    assert notifier.deliver_pending(log, START + alert_outbox.FIRST_BACKOFF) == (1, 0)
    assert [alert["idempotency_key"] for alert in receiver.alerts] == [
        ALERT.idempotency_key] * 2
    assert receiver.delivered() == {ALERT.idempotency_key: 2}
    assert notifier.deliver_pending(log, START + timedelta(hours=1)) == (0, 0)


def test_two_processes_draining_at_once_post_an_alert_once(pg_warehouse_url, receiver):
    """The alert's row is leased to the first taker: a second drain at the same moment (another
    sensor, the notify of another process) finds nothing due."""
    notifier = AlertNotifierResource(database_url=pg_warehouse_url, webhook_url=receiver.url)
    log = logging.getLogger("alerts")
    receiver.down = True
    assert not notifier.notify(ALERT, log, START)
    receiver.down = False
    receiver.ack_late(1, seconds=1.0)
    due = START + alert_outbox.FIRST_BACKOFF
    results: list[tuple[int, int]] = []
    drains = [threading.Thread(target=lambda: results.append(notifier.deliver_pending(log, due)))
              for _ in range(4)]
    for drain in drains:
        drain.start()
    for drain in drains:
        drain.join()
    assert sorted(results) == [(0, 0), (0, 0), (0, 0), (1, 0)]
    assert receiver.delivered() == {ALERT.idempotency_key: 1}


def test_a_refused_alert_stays_pending_and_its_url_is_never_named(
        sqlite_warehouse_url, receiver, caplog):
    notifier = AlertNotifierResource(database_url=sqlite_warehouse_url,
                                     webhook_url=receiver.url)
    receiver.fail_next(400)
    with caplog.at_level(logging.INFO, logger="alerts"):
        assert not notifier.notify(ALERT, logging.getLogger("alerts"), START)
    [row] = _rows(sqlite_warehouse_url)
    assert row["sent_at"] is None and row["attempts"] == 1
    assert "request_rejected" in row["last_error"]
    assert "it stays in the outbox" in caplog.text and receiver.token not in caplog.text
