"""A run's claim: the one signal that a run is alive, and it dies with the process holding it.

The run-status check (:mod:`.runs_in_flight`) must tell a run that is working from one that was
killed, on any host: run storage keeps saying "started" for a run whose process died
(``dagster job execute`` killed, a lost machine), and a host or pid tag means nothing on another
host. So while a run executes, the processes working for it hold a claim named after the run id
in a lock the operating system or the database releases when the process ends:

* with PostgreSQL run storage (production, :file:`deploy/dagster.yaml`): a session-level
  advisory lock, taken shared, on a connection of its own to that database. PostgreSQL releases
  it when the session ends: at once for a killed process, within the connection's TCP keepalive
  window (about 30 s, set below) for a machine that vanished;
* with SQLite run storage (the embedded single-host setup): a shared ``flock`` on
  ``<instance root>/run_claims/<run id>.lock``, released by the kernel when the process exits.

Who holds it: the run's orchestrating process for the whole run (the executor of every job is
wrapped by :func:`holding_run_claim`, so ``dagster job execute``, daemon-launched runs, re-runs
and Celery runs are covered from their first step to their last, queue waits included), and
every step for its own duration (``execute_in_process`` has no executor of ours; a Celery step
holds it on its worker too). Holders take the lock shared; the check takes it exclusively
without waiting and lets go at once: it gets it only when nobody holds the claim.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import psycopg
from dagster import DagsterInstance

KEEPALIVE_SETTINGS = ("SET tcp_keepalives_idle = 10; SET tcp_keepalives_interval = 5; "
                      "SET tcp_keepalives_count = 3")
"""How fast the server notices the claim holder's machine is gone (10 s + 3 x 5 s)."""

_held: dict[str, list] = {}
"""Run id -> [number of holders in this process, the lock handle]: nested holders (a step run
by its own orchestrating process) share one lock."""
_held_guard = threading.Lock()


@contextlib.contextmanager
def hold_run_claim(instance: DagsterInstance, run_id: str) -> Iterator[None]:
    """Hold the run's claim for the duration of the block."""
    with _held_guard:
        entry = _held.get(run_id)
        if entry is None:
            entry = _held[run_id] = [0, _acquire(instance, run_id)]
        entry[0] += 1
    try:
        yield
    finally:
        with _held_guard:
            entry[0] -= 1
            if entry[0] == 0:
                del _held[run_id]
                _release(entry[1])


def run_claim_held(instance: DagsterInstance, run_id: str) -> bool:
    """Whether some live process holds the run's claim now."""
    dsn = _postgres_dsn(instance)
    if dsn is not None:
        with psycopg.connect(dsn, autocommit=True) as connection:
            free = connection.execute("SELECT pg_try_advisory_lock(%s)",
                                      (_lock_key(run_id),)).fetchone()[0]
            if free:
                connection.execute("SELECT pg_advisory_unlock(%s)", (_lock_key(run_id),))
            return not free
    path = _claim_file(instance, run_id)
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def _acquire(instance: DagsterInstance, run_id: str):
    dsn = _postgres_dsn(instance)
    if dsn is not None:
        connection = psycopg.connect(dsn, autocommit=True)
        connection.execute(KEEPALIVE_SETTINGS)
        connection.execute("SELECT pg_advisory_lock_shared(%s)", (_lock_key(run_id),))
        return connection
    path = _claim_file(instance, run_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_SH)
    return (fd, path)


def _release(handle) -> None:
    if isinstance(handle, psycopg.Connection):
        handle.close()
        return
    fd, path = handle
    try:
        # The last holder removes the file, so finished runs leave nothing behind.
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        path.unlink(missing_ok=True)
    except BlockingIOError:
        pass
    finally:
        os.close(fd)


def _lock_key(run_id: str) -> int:
    """A signed 64-bit key: single-key advisory locks never collide with the two-key locks of
    the warehouse's partitions."""
    return int.from_bytes(hashlib.sha256(f"mostovik run {run_id}".encode()).digest()[:8],
                          "big", signed=True)


def _postgres_dsn(instance: DagsterInstance) -> str | None:
    """The run storage's PostgreSQL, as a libpq URL; None for SQLite (or in-memory) storage.
    ``postgres_url`` is an attribute of dagster-postgres' run storage (pinned by a test)."""
    url = getattr(instance.run_storage, "postgres_url", None)
    if not url:
        return None
    from sqlalchemy.engine import make_url

    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


def _claim_file(instance: DagsterInstance, run_id: str) -> Path:
    return Path(instance.root_directory) / "run_claims" / f"{run_id}.lock"
