"""The taxonomy: which failures are transient and which permanent."""

from __future__ import annotations

import errno
import sqlite3

import httpx
import psycopg
import pytest
import redis
import sqlalchemy.exc

from mostovik_pipelines.core.errors import (
    ConfigurationError,
    DataValidationError,
    SourceContractError,
    SourceRateLimited,
    SourceRequestRejected,
    SourceUnavailable,
    broker_unreachable,
    classify,
)
from mostovik_pipelines_tests.support.redis import ThrowawayRedis


class _PgError(Exception):
    def __init__(self, sqlstate: str) -> None:
        super().__init__(f"sqlstate {sqlstate}")
        self.sqlstate = sqlstate


def _db_error(cls, sqlstate: str | None = None, invalidated: bool = False):
    orig = _PgError(sqlstate) if sqlstate else Exception("server closed the connection")
    return cls("UPDATE ...", {}, orig, connection_invalidated=invalidated)


TRANSIENT = [
    httpx.ConnectError("connection refused"),
    httpx.ReadTimeout("timed out"),
    httpx.RemoteProtocolError("peer closed connection without sending complete message body"),
    SourceUnavailable("HTTP 503", status=503),
    SourceRateLimited("HTTP 429", status=429, retry_after=2),
    _db_error(sqlalchemy.exc.OperationalError, "40001"),
    _db_error(sqlalchemy.exc.OperationalError, "40P01"),
    _db_error(sqlalchemy.exc.OperationalError, "53300"),
    _db_error(sqlalchemy.exc.OperationalError, "57P01"),
    _db_error(sqlalchemy.exc.OperationalError, "08006"),
    _db_error(sqlalchemy.exc.OperationalError),
    _db_error(sqlalchemy.exc.DBAPIError, invalidated=True),
    sqlite3.OperationalError("database is locked"),
    OSError(errno.EBUSY, "busy"),
    OSError(errno.EAGAIN, "try again"),
    TimeoutError("timed out"),
    ConnectionResetError(errno.ECONNRESET, "reset"),
    psycopg.OperationalError("consuming input failed: server closed the connection"),
    psycopg.errors.AdminShutdown("terminating connection due to administrator command"),
    psycopg.errors.SerializationFailure("could not serialize access"),
]

PERMANENT = [
    SourceRequestRejected("HTTP 404", status=404),
    SourceContractError("missing <Value>"),
    DataValidationError("duplicate keys"),
    ConfigurationError("MOSTOVIK_X is not set"),
    httpx.UnsupportedProtocol("no scheme"),
    _db_error(sqlalchemy.exc.IntegrityError, "23505"),
    _db_error(sqlalchemy.exc.ProgrammingError, "42P01"),
    sqlalchemy.exc.ArgumentError("could not parse URL"),
    OSError(errno.ENOENT, "no such file"),
    PermissionError(errno.EACCES, "denied"),
    KeyError("field"),
    ValueError("bad"),
    ZeroDivisionError(),
    psycopg.errors.UniqueViolation("duplicate key"),
    psycopg.errors.InvalidTextRepresentation("invalid input syntax for type numeric"),
]


@pytest.mark.parametrize("exc", TRANSIENT, ids=lambda e: type(e).__name__)
def test_transient(exc):
    assert classify(exc).transient


@pytest.mark.parametrize("exc", PERMANENT, ids=lambda e: type(e).__name__)
def test_permanent(exc):
    assert not classify(exc).transient


def test_unknown_exceptions_are_permanent_by_default():
    class SomethingNew(Exception):
        pass

    verdict = classify(SomethingNew("?"))
    assert (verdict.transient, verdict.kind) == (False, "unknown")


def test_retry_after_is_carried_into_the_verdict():
    assert classify(SourceRateLimited("429", status=429, retry_after=7)).retry_after == 7


def test_celery_giving_up_on_its_result_backend_is_the_broker_unreachable_and_publishes_nothing():
    """A run's orchestrating process submits a step while Redis is away: Celery's result
    consumer retries its reconnection (20 times by default, about 20 s, here twice) and raises
    a ``RuntimeError`` from the connection error, before the task is published. The run rides
    it out as the outage it is and submits again: once Redis is back the consumer connects
    afresh, and the step is queued once."""
    from celery import Celery

    server = ThrowawayRedis().start()
    try:
        app = Celery("probe", broker=server.url(0), backend=server.url(1), set_as_current=False)
        app.conf.result_backend_transport_options = {"retry_policy": {
            "max_retries": 2, "interval_start": 0, "interval_step": 0.1, "interval_max": 0.1}}
        server.crash()
        with pytest.raises(RuntimeError, match="Retry limit exceeded") as gave_up:
            app.send_task("mostovik.probe")
        assert broker_unreachable(gave_up.value)
        assert not broker_unreachable(RuntimeError("a plain bug"))
        server.start()
        app.send_task("mostovik.probe")
        queue = redis.Redis.from_url(server.url(0))
        assert queue.llen("celery") == 1, "the submission that gave up published nothing"
        queue.close()
    finally:
        server.stop()
