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

A claim on PostgreSQL lives on one connection, and the database can drop it while the process
lives (a restart, a failover, a network cut): a keeper thread checks the connection every
:data:`KEEPER_CHECK_SECONDS` and, when it is gone, connects again and takes the claim again as
soon as the database answers. A claim taken while the database is away (a step starting during
a restart, its storage calls riding it out) is taken the same way, by the keeper, once it
answers. Until then the claim looks free, so for
:data:`RETAKE_GRACE_SECONDS` after the database (re)started a free claim taken before that start
proves nothing and the check counts it as held: every live holder has taken it again by then.

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
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
from dagster import DagsterInstance

KEEPALIVE_SETTINGS = ("SET tcp_keepalives_idle = 10; SET tcp_keepalives_interval = 5; "
                      "SET tcp_keepalives_count = 3")
"""How fast the server notices the claim holder's machine is gone (10 s + 3 x 5 s)."""
KEEPER_CHECK_SECONDS = 2.0
"""How often a claim's keeper checks that its connection, and so the claim, is still there."""
RECONNECT_SECONDS = 1.0
"""How often a keeper whose connection was lost tries to connect again."""
RETAKE_GRACE_SECONDS = 15.0
"""How long after the database started a free claim is not trusted as free: a keeper takes its
claim again within a check and a reconnect (about 3 s) of the database answering."""

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


def run_claim_held(instance: DagsterInstance, run_id: str,
                   taken_at: float | None = None) -> bool:
    """Whether some live process holds the run's claim now. ``taken_at`` (epoch seconds): when
    the run took it, its start; a claim taken before the database last started and found free
    within :data:`RETAKE_GRACE_SECONDS` of that start counts as held (being taken again)."""
    dsn = _postgres_dsn(instance)
    if dsn is not None:
        with psycopg.connect(dsn, autocommit=True) as connection:
            free, started, up_seconds = connection.execute(
                "SELECT pg_try_advisory_lock(%s), "
                "extract(epoch FROM pg_postmaster_start_time()), "
                "extract(epoch FROM now() - pg_postmaster_start_time())",
                (_lock_key(run_id),)).fetchone()
            if not free:
                return True
            connection.execute("SELECT pg_advisory_unlock(%s)", (_lock_key(run_id),))
            return (taken_at is not None and taken_at < float(started)
                    and float(up_seconds) < RETAKE_GRACE_SECONDS)
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


class _ClaimKeeper:
    """A claim held on a PostgreSQL connection of its own, taken again on a new connection
    whenever the database drops the old one, until it is released."""

    def __init__(self, dsn: str, run_id: str) -> None:
        self._dsn = dsn
        self._key = _lock_key(run_id)
        self._released = threading.Event()
        self._connection: psycopg.Connection | None = None
        with contextlib.suppress(psycopg.OperationalError):  # away: the keeper takes it
            self._connection = self._take()
        self._thread = threading.Thread(target=self._keep, name=f"claim {run_id}", daemon=True)
        self._thread.start()

    def _take(self) -> psycopg.Connection:
        connection = psycopg.connect(self._dsn, autocommit=True, connect_timeout=10)
        connection.execute(KEEPALIVE_SETTINGS)
        connection.execute("SELECT pg_advisory_lock_shared(%s)", (self._key,))
        return connection

    def _keep(self) -> None:
        while not self._released.wait(KEEPER_CHECK_SECONDS):
            if self._connection is not None:
                try:
                    self._connection.execute("SELECT 1")
                    continue
                except psycopg.Error:
                    self._connection.close()
                    self._connection = None
            while not self._released.is_set():
                try:
                    self._connection = self._take()
                    break
                except psycopg.Error:
                    time.sleep(RECONNECT_SECONDS)
            if self._released.is_set() and self._connection is not None:
                self._connection.close()

    def release(self) -> None:
        self._released.set()
        # A keeper busy reconnecting closes what it gets once it sees the release.
        self._thread.join(timeout=1)
        if self._connection is not None:
            self._connection.close()


def _acquire(instance: DagsterInstance, run_id: str):
    dsn = _postgres_dsn(instance)
    if dsn is not None:
        return _ClaimKeeper(dsn, run_id)
    path = _claim_file(instance, run_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_SH)
    return (fd, path)


def _release(handle) -> None:
    if isinstance(handle, _ClaimKeeper):
        handle.release()
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


def claim_files_dir(instance: DagsterInstance) -> Path:
    """Where the claims of a SQLite instance's runs are files (the retention prune removes the
    ones a killed holder left behind)."""
    return Path(instance.root_directory) / "run_claims"


def _claim_file(instance: DagsterInstance, run_id: str) -> Path:
    return claim_files_dir(instance) / f"{run_id}.lock"
