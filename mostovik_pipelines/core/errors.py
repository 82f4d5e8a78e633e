"""The error taxonomy: which failures can pass (transient) and which cannot (permanent).

ADR-011 allows retries only for failures that can pass by themselves. Every op of every source
routes its exceptions through :func:`classify`; nothing else in the project decides whether a
failure is retried.

Unknown exceptions are classified as **permanent**. A retry of an unexplained failure hides
programming errors behind backoff delays and, for a contract change, hammers the source for
nothing; the failed run is visible at once and one click (or ``mostovik jobs rerun``) re-runs
it safely because every load is idempotent. A new transient family is added here, once.
"""

from __future__ import annotations

import errno
import sqlite3
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

import sqlalchemy.exc

if TYPE_CHECKING:
    import psycopg

# SQLSTATEs that are worth another attempt of the whole load transaction.
TRANSIENT_SQLSTATES = {
    "40001": "serialization failure",
    "40P01": "deadlock detected",
    "53300": "too many connections",
    "55P03": "lock not available",
}
UNAVAILABLE_SQLSTATES = {
    "57P01": "admin shutdown",
    "57P02": "crash shutdown",
    "57P03": "cannot connect now",
}
"""The server is going away or not back yet (a restart, a failover): an outage, not a glitch."""
TRANSIENT_SQLSTATE_CLASSES = {"08": "connection exception"}
REFUSED_BY_THE_SERVER = {
    "password authentication failed": "authentication failed",
    "no password supplied": "authentication failed",
    "no pg_hba.conf entry": "authentication failed",
    "does not exist": "no such database or role",
    "unrecognized configuration parameter": "a bad setting",
    "invalid value for parameter": "a bad setting",
}
"""What the server answers a connection it will not serve (libpq gives these no SQLSTATE): a
setting of ours is wrong, and it stays wrong however long we wait."""
TOO_MANY_CLIENTS = ("too many clients", "too many connections",
                    "remaining connection slots are reserved")
OUTAGE_KINDS = frozenset({"database_connection_lost", "broker", "object_store_unreachable"})
"""Kinds of failure that mean a part we stand on is away (the warehouse, the broker or the object
store restarting or failing over): ridden out for as long as that store's outage budget lasts,
not a count of tries (:mod:`.outages`)."""
RUN_RETRY_ONLY_KINDS = frozenset({"run_claim_lost", "store_away"})
"""Transient kinds a step does not retry: the run cannot go on (its claim is lost, a store
stayed away past its outage budget: :mod:`.outages`), a new run may."""

TRANSIENT_ERRNOS = {
    errno.EAGAIN: "resource temporarily unavailable",
    errno.EBUSY: "device or resource busy",
    errno.ETIMEDOUT: "timed out",
    errno.ECONNREFUSED: "connection refused",
    errno.ECONNRESET: "connection reset",
    errno.ECONNABORTED: "connection aborted",
    errno.EHOSTUNREACH: "host unreachable",
    errno.ENETUNREACH: "network unreachable",
    errno.EINTR: "interrupted system call",
    errno.ESTALE: "stale file handle",
}

DISK_FULL_ERRNOS = {
    errno.ENOSPC: "no space left on the device",
    errno.EDQUOT: "disk quota exceeded",
}
"""The landing or op-output disk is full: transient, space can come back (a cleanup, a prune)."""

# Exception modules of the Celery broker stack, matched by name so that the classifier does not
# import the broker client in processes that never use it.
TRANSIENT_BROKER_ERRORS = {
    ("kombu.exceptions", "OperationalError"),
    ("redis.exceptions", "ConnectionError"),
    ("redis.exceptions", "TimeoutError"),
    ("amqp.exceptions", "ConnectionForced"),
}

# The S3 client's errors of a store that does not answer, matched by name as the broker's are.
UNREACHABLE_OBJECT_STORE_ERRORS = {
    ("botocore.exceptions", "ConnectionError"),  # refused, DNS, connect timeout
    ("botocore.exceptions", "HTTPClientError"),  # connection closed, read timeout
    # s3fs reads an answer's body itself, past botocore: a body cut half way, a connection the
    # store dropped mid-read, surface as aiohttp's own errors.
    ("aiohttp.client_exceptions", "ClientPayloadError"),
    ("aiohttp.client_exceptions", "ClientConnectionError"),
}
OBJECT_STORE_BUSY_CODES = {"SlowDown", "ServiceUnavailable", "InternalError", "RequestTimeout"}
"""S3 error codes of a store that answers but cannot serve now (s3fs raises them as ``OSError``
with the service's error as the cause)."""


def object_store_unreachable(exc: BaseException) -> bool:
    """Whether ``exc`` says the object store cannot be reached or cannot serve now."""
    if any((cls.__module__, cls.__name__) in UNREACHABLE_OBJECT_STORE_ERRORS
           for cls in type(exc).__mro__):
        return True
    cause = exc.__cause__
    response = getattr(cause, "response", None)
    if isinstance(exc, OSError) and isinstance(response, dict):
        status = response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
        return status >= 500 or response.get("Error", {}).get("Code") in OBJECT_STORE_BUSY_CODES
    return False


def broker_unreachable(exc: BaseException) -> bool:
    """Whether ``exc`` says the Celery broker or result backend cannot be reached now: one of
    :data:`TRANSIENT_BROKER_ERRORS` or a subclass (Redis still loading its data after a restart
    raises one), or a plain :class:`ConnectionError`; or the ``RuntimeError`` Celery raises from
    such an error when its result consumer gives up reconnecting (after about 20 s: "Retry limit
    exceeded ... must be restarted"). That happens before a task is published, and the consumer
    connects afresh on the next call."""
    if type(exc) is RuntimeError and exc.__cause__ is not None:
        return broker_unreachable(exc.__cause__)
    return isinstance(exc, ConnectionError) or any(
        (cls.__module__, cls.__name__) in TRANSIENT_BROKER_ERRORS for cls in type(exc).__mro__)


class PipelineError(Exception):
    """An error the project raises on purpose, already knowing whether it can pass."""

    transient: bool = False
    kind: str = "error"


class TransientError(PipelineError):
    """A failure that can pass by itself: retried with backoff."""

    transient = True
    kind = "transient"


class PermanentError(PipelineError):
    """A failure that another attempt would only repeat: fails the run at once."""

    kind = "permanent"


class SourceUnavailable(TransientError):
    """The source answered 5xx or 429, or did not answer in time."""

    kind = "source_unavailable"

    def __init__(self, message: str, *, status: int | None = None,
                 retry_after: float | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.retry_after = retry_after


class SourceRateLimited(SourceUnavailable):
    """HTTP 429: the source asks us to slow down, often with Retry-After."""

    kind = "rate_limited"


class SourceRequestRejected(PermanentError):
    """HTTP 4xx other than 429: our request is wrong or not allowed."""

    kind = "request_rejected"

    def __init__(self, message: str, *, status: int) -> None:
        super().__init__(message)
        self.status = status


class SourceContractError(PermanentError):
    """The payload does not parse or does not have the shape the source promised."""

    kind = "contract_violation"


class SourceShapeChanged(SourceContractError):
    """The source sends other fields, or values of another kind, than its declaration expects
    (:mod:`.quality.shape`): fails the partition until the declaration accepts the change."""

    kind = "shape_changed"


class DataValidationError(PermanentError):
    """The payload parsed but its data breaks an invariant (duplicate keys, bad values)."""

    kind = "validation_error"


class PartitionCheckFailed(PermanentError):
    """A blocking asset check of a loaded partition failed: the warehouse holds data that breaks
    an invariant (duplicate keys, a row outside its partition, a version gone down)."""

    kind = "check_failed"


class ConfigurationError(PermanentError):
    """Missing or invalid configuration: an environment variable, a URL, a resource."""

    kind = "configuration_error"


class PageCursorExpired(TransientError):
    """A paged source no longer honours the token of the next page (HTTP 410): the framework
    fetches that page again with a window narrowed to start after the last item received."""

    kind = "cursor_expired"


class RunClaimLost(TransientError):
    """The run's claim (:mod:`.platform.claims`) was lost and not taken again within the grace:
    another run may already be working on its partitions, so this one stops before it writes.
    Not retried by the step (its claim is gone); a new run of the partitions may take them up."""

    kind = "run_claim_lost"


class ConcurrentRunError(TransientError):
    """Another run holds the same source and partition; it can pass when that run ends."""

    kind = "concurrent_run"


@dataclass(frozen=True)
class Verdict:
    """What :func:`classify` decided about one exception."""

    transient: bool
    kind: str
    reason: str
    retry_after: float | None = None

    @property
    def label(self) -> str:
        return "transient" if self.transient else "permanent"

    @property
    def retried_by_step(self) -> bool:
        """Whether another attempt of the step may pass: a transient failure, except one that
        only another run can get past (:data:`RUN_RETRY_ONLY_KINDS`)."""
        return self.transient and self.kind not in RUN_RETRY_ONLY_KINDS

    @property
    def outage(self) -> bool:
        """A part we stand on is away: ride it out (:data:`OUTAGE_KINDS`)."""
        return self.transient and self.kind in OUTAGE_KINDS


def classify(exc: BaseException) -> Verdict:
    """Decide whether ``exc`` can pass by itself, and why."""
    reason = _describe(exc)
    if isinstance(exc, PipelineError):
        return Verdict(exc.transient, exc.kind, reason, getattr(exc, "retry_after", None))
    # The HTTP client and the driver are looked up, not imported: an error of a library no code
    # imported cannot have been raised, and a process that loads the code location only (the
    # daemon classifying a sensor's failure) does not pay for them.
    httpx = sys.modules.get("httpx")
    psycopg = sys.modules.get("psycopg")
    if httpx and isinstance(exc, httpx.InvalidURL | httpx.UnsupportedProtocol):
        return Verdict(False, "configuration_error", reason)
    if httpx and isinstance(exc, httpx.TimeoutException):
        return Verdict(True, "timeout", reason)
    if httpx and isinstance(exc, httpx.TransportError):
        return Verdict(True, "network", reason)
    if isinstance(exc, sqlalchemy.exc.DBAPIError):
        return _classify_database_error(exc, reason)
    if psycopg and isinstance(exc, psycopg.Error):
        # Raised by the driver itself, unwrapped, on the loader's COPY path.
        return _classify_driver_error(exc, reason, psycopg)
    psycopg2 = sys.modules.get("psycopg2")
    if psycopg2 and isinstance(exc, psycopg2.Error):
        # dagster-postgres' driver, unwrapped where the instance storage opens a connection.
        return _classify_driver_error(exc, reason, psycopg2)
    if isinstance(exc, sqlalchemy.exc.ArgumentError | sqlalchemy.exc.NoSuchModuleError):
        return Verdict(False, "configuration_error", reason)
    if isinstance(exc, sqlite3.OperationalError) and _sqlite_is_busy(exc):
        return Verdict(True, "database_busy", reason)
    if (type(exc).__module__, type(exc).__name__) in TRANSIENT_BROKER_ERRORS:
        return Verdict(True, "broker", reason)
    if object_store_unreachable(exc):
        return Verdict(True, "object_store_unreachable", reason)
    if isinstance(exc, TimeoutError):
        return Verdict(True, "timeout", reason)
    if isinstance(exc, OSError) and exc.errno in DISK_FULL_ERRNOS:
        return Verdict(True, "disk_full", f"{DISK_FULL_ERRNOS[exc.errno]}: {reason}")
    if isinstance(exc, OSError) and exc.errno == errno.EROFS:
        return Verdict(False, "disk_read_only",
                       f"read-only file system (an operator must make it writable): {reason}")
    if isinstance(exc, OSError) and exc.errno in TRANSIENT_ERRNOS:
        return Verdict(True, "os_transient", f"{TRANSIENT_ERRNOS[exc.errno]}: {reason}")
    if isinstance(exc, ConnectionError):
        return Verdict(True, "network", reason)
    return Verdict(False, "unknown", reason)


def _classify_database_error(exc: sqlalchemy.exc.DBAPIError, reason: str) -> Verdict:
    if exc.connection_invalidated:
        return Verdict(True, "database_connection_lost", reason)
    orig = exc.orig
    sqlstate = getattr(orig, "sqlstate", None) or getattr(orig, "pgcode", None)
    if sqlstate in UNAVAILABLE_SQLSTATES:
        return Verdict(True, "database_connection_lost",
                       f"{UNAVAILABLE_SQLSTATES[sqlstate]}: {reason}")
    if sqlstate in TRANSIENT_SQLSTATES:
        return Verdict(True, "database_transient", f"{TRANSIENT_SQLSTATES[sqlstate]}: {reason}")
    if sqlstate and sqlstate[:2] in TRANSIENT_SQLSTATE_CLASSES:
        return Verdict(True, "database_connection_lost", reason)
    if isinstance(orig, sqlite3.OperationalError) and _sqlite_is_busy(orig):
        return Verdict(True, "database_busy", reason)
    if sqlstate is None and isinstance(exc, sqlalchemy.exc.OperationalError) and not isinstance(
        orig, sqlite3.Error
    ):
        # psycopg raises OperationalError without a SQLSTATE when the connection itself broke,
        # and when the server refused to open it.
        return _classify_connection_failure(reason)
    if isinstance(exc, sqlalchemy.exc.IntegrityError):
        return Verdict(False, "integrity_violation", reason)
    return Verdict(False, "database_error", reason)


def _classify_driver_error(exc: psycopg.Error, reason: str, driver) -> Verdict:
    """An error of a PostgreSQL driver (``driver``: psycopg, or psycopg2, whose SQLSTATE is
    ``pgcode``)."""
    sqlstate = getattr(exc, "sqlstate", None) or getattr(exc, "pgcode", None)
    if sqlstate in UNAVAILABLE_SQLSTATES:
        return Verdict(True, "database_connection_lost",
                       f"{UNAVAILABLE_SQLSTATES[sqlstate]}: {reason}")
    if sqlstate in TRANSIENT_SQLSTATES:
        return Verdict(True, "database_transient", f"{TRANSIENT_SQLSTATES[sqlstate]}: {reason}")
    if sqlstate is None and isinstance(exc, driver.OperationalError | driver.InterfaceError):
        return _classify_connection_failure(reason)
    if sqlstate and sqlstate[:2] in TRANSIENT_SQLSTATE_CLASSES:
        return Verdict(True, "database_connection_lost", reason)
    if isinstance(exc, driver.IntegrityError):
        return Verdict(False, "integrity_violation", reason)
    return Verdict(False, "database_error", reason)


def refused_by_the_server(message: str) -> bool:
    """Whether libpq's ``message`` says the server answered and will not serve us (a setting of
    ours, or too many clients) rather than that it is away: waiting does not cure it."""
    return not _classify_connection_failure(message).outage


def _classify_connection_failure(reason: str) -> Verdict:
    """A connection that broke or could not be opened, as libpq says it (no SQLSTATE). Only the
    database being away (refused, reset, timed out, shutting down or starting up) is an
    outage; a server that answers and refuses us is a setting of ours (or too many clients)."""
    message = reason.lower()
    for sign, what in REFUSED_BY_THE_SERVER.items():
        if sign in message:
            return Verdict(False, "configuration_error", f"{what}: {reason}")
    if any(sign in message for sign in TOO_MANY_CLIENTS):
        return Verdict(True, "database_transient", f"too many connections: {reason}")
    return Verdict(True, "database_connection_lost", reason)


def _sqlite_is_busy(exc: sqlite3.Error) -> bool:
    message = str(exc).lower()
    return "database is locked" in message or "database is busy" in message


def _describe(exc: BaseException) -> str:
    message = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__
