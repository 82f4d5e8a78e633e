"""The alerts' outbox: a table in the warehouse (``alert_outbox``) where every alert is written
before it is posted, and marked sent only once the webhook acknowledged it.

* **Written once.** Each alert carries an idempotency key (what it is about: a run's failure,
  a source's change of shape, a late period); writing a key that is already there does nothing,
  so a sensor that evaluates again (a lost cursor, a retried tick) never doubles an alert.
* **Sent once.** A delivery first takes a lease on the row (``next_attempt_at`` moved past the
  delivery's timeout, in the same transaction that picked it), so two processes delivering at
  once never post one alert twice; a 2xx marks it sent, and nothing sends a sent alert again.
  The key goes with the post (the ``Idempotency-Key`` header and the body's
  ``idempotency_key``): a receiver that saw a post whose answer was lost in transit drops the
  repeat.
* **Never lost.** A failed delivery (refused, timed out, 4xx or 5xx) leaves the row pending,
  tried again after a backoff that doubles up to :data:`MAX_BACKOFF` (a webhook away for an
  hour has its alerts within minutes of its return); nothing gives up. What is pending is
  visible: ``mostovik_alerts_pending`` in the metrics.

Times are the caller's clock (the process delivering), not the database's.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Engine, func, select, update
from sqlalchemy.dialects.postgresql import insert as pg_insert
from sqlalchemy.dialects.sqlite import insert as sqlite_insert

from mostovik_pipelines.warehouse.schema import alert_outbox

FIRST_BACKOFF = timedelta(seconds=15)
MAX_BACKOFF = timedelta(minutes=5)
LEASE = timedelta(seconds=60)
"""How long a delivery in flight keeps others off its row (longer than a post's timeout)."""


@dataclass(frozen=True)
class PendingAlert:
    idempotency_key: str
    body: dict[str, Any]
    attempts: int


def write(engine: Engine, key: str, body: dict[str, Any], now: datetime) -> bool:
    """Keep the alert ``body`` under ``key``, pending; False when the key was there already."""
    insert = pg_insert if engine.dialect.name == "postgresql" else sqlite_insert
    statement = insert(alert_outbox).values(
        idempotency_key=key, kind=body["kind"], source=body.get("source"),
        period=body.get("period"), body=json.dumps(body, ensure_ascii=False, default=str),
        created_at=now, attempts=0, next_attempt_at=now,
    ).on_conflict_do_nothing(index_elements=["idempotency_key"]).returning(
        alert_outbox.c.idempotency_key)
    with engine.begin() as connection:
        return connection.execute(statement).first() is not None


def take_due(engine: Engine, now: datetime, limit: int,
             keys: list[str] | None = None) -> list[PendingAlert]:
    """The pending alerts due for a delivery (or those of ``keys`` that are), oldest first,
    each leased to the caller for :data:`LEASE`."""
    query = (select(alert_outbox.c.idempotency_key, alert_outbox.c.body,
                    alert_outbox.c.attempts)
             .where(alert_outbox.c.sent_at.is_(None), alert_outbox.c.next_attempt_at <= now)
             .order_by(alert_outbox.c.created_at, alert_outbox.c.idempotency_key).limit(limit))
    if keys is not None:
        query = query.where(alert_outbox.c.idempotency_key.in_(keys))
    if engine.dialect.name == "postgresql":
        query = query.with_for_update(skip_locked=True)
    with engine.begin() as connection:  # SQLite: BEGIN IMMEDIATE, one writer at a time
        rows = connection.execute(query).all()
        if rows:
            connection.execute(update(alert_outbox).where(
                alert_outbox.c.idempotency_key.in_([row[0] for row in rows]))
                .values(next_attempt_at=now + LEASE))
    return [PendingAlert(row[0], json.loads(row[1]), row[2]) for row in rows]


def mark_sent(engine: Engine, key: str, now: datetime, channel: str) -> None:
    with engine.begin() as connection:
        connection.execute(update(alert_outbox).where(
            alert_outbox.c.idempotency_key == key, alert_outbox.c.sent_at.is_(None))
            .values(sent_at=now, channel=channel, attempts=alert_outbox.c.attempts + 1,
                    last_error=None))


def mark_failed(engine: Engine, key: str, now: datetime, attempts: int, error: str) -> datetime:
    """Record a failed delivery (the ``attempts``-th); when the alert is tried again."""
    again = now + backoff(attempts)
    with engine.begin() as connection:
        connection.execute(update(alert_outbox).where(
            alert_outbox.c.idempotency_key == key, alert_outbox.c.sent_at.is_(None))
            .values(attempts=attempts, next_attempt_at=again, last_error=error[:2000]))
    return again


def backoff(attempts: int) -> timedelta:
    """The wait after the ``attempts``-th failed delivery: 15 s doubling, at most 5 minutes."""
    return min(FIRST_BACKOFF * 2 ** max(attempts - 1, 0), MAX_BACKOFF)


def pending_count(engine: Engine) -> int:
    with engine.connect() as connection:
        return connection.execute(select(func.count()).select_from(alert_outbox).where(
            alert_outbox.c.sent_at.is_(None))).scalar_one()


def sent_count(engine: Engine) -> int:
    with engine.connect() as connection:
        return connection.execute(select(func.count()).select_from(alert_outbox).where(
            alert_outbox.c.sent_at.is_not(None))).scalar_one()
