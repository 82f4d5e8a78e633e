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

The fence: a holder whose claim connection dropped may have been counted dead meanwhile, and
its partitions taken over. So before each of its writes (the load's transaction, the landing
store, the op outputs) a run calls :func:`ensure_run_claim`: its claim's connection must answer;
a dropped one is taken again within :data:`FENCE_GRACE_SECONDS` of when it last answered (or,
after a database restart, within the restart grace; a database nobody reaches is ridden out as
the run's storage calls ride it out, :mod:`..outages`), else the write fails with
:class:`.errors.RunClaimLost` and the run writes nothing more. The other side of it: a check
counts a run that held its claim dead only once the claim stays free for
:data:`CLAIM_GONE_SECONDS` (:func:`run_claim_gone`), longer than that grace. A first take that
the database refuses for a reason waiting cannot cure (authentication, a missing database, too
many clients, a bad setting) fails at once (:class:`RunClaimRefused`); only the database being
away (refused, reset, timed out) is left to the keeper. docs/architecture.md ("The fence") has
the whole of it.

Who holds it: the run's orchestrating process for the whole run (the executor of every job is
wrapped by :func:`holding_run_claim`, so ``dagster job execute``, daemon-launched runs, re-runs
and Celery runs are covered from their first step to their last, queue waits included), and
every step for its own duration (``execute_in_process`` has no executor of ours; a Celery step
holds it on its worker too). Holders take the lock shared; the check takes it exclusively
without waiting and lets go at once: it gets it only when nobody holds the claim. The process
driving the run also holds a second claim, the run's *driver claim* (:func:`hold_driver_claim`):
a step left running on a Celery worker by a dead orchestrating process holds the run's claim
but not that one, so the dead-run sensor, which looks at the driver claim, sees the run dead.
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

from mostovik_pipelines.core.errors import ConfigurationError, RunClaimLost, classify
from mostovik_pipelines.core.outages import (
    Store,
    StoreAway,
    answered,
    away_for,
    database_of,
    is_away,
    ride_out,
)
from mostovik_pipelines.platform.claim_refusals import connection_settings, refusal_message

KEEPALIVE_SETTINGS = ("SET tcp_keepalives_idle = 10; SET tcp_keepalives_interval = 5; "
                      "SET tcp_keepalives_count = 3")
"""How fast the server notices the claim holder's machine is gone (10 s + 3 x 5 s)."""
KEEPER_CHECK_SECONDS = 2.0
"""How often a claim's keeper checks that its connection, and so the claim, is still there."""
RECONNECT_SECONDS = 1.0
"""How often a keeper whose connection was lost tries to connect again."""
FENCE_GRACE_SECONDS = 8.0
"""How long a holder may be without its claim (a dropped connection) and still take it again and
go on writing; past it, it writes nothing more (:func:`ensure_run_claim`). A keeper takes a
dropped claim again within a check and a reconnect (about 3 s)."""
CLAIM_GONE_SECONDS = FENCE_GRACE_SECONDS + KEEPER_CHECK_SECONDS
"""How long a check must find a claim free before it counts the run dead
(:func:`run_claim_gone`): longer than a holder may be without it and still write."""
CLIENT_TIMEOUTS = {"keepalives": 1, "keepalives_idle": 5, "keepalives_interval": 2,
                   "keepalives_count": 2, "tcp_user_timeout": 5000}
"""A holder cut off from the database notices it within seconds, not the system's default TCP
timeouts (minutes): its check of the claim fails instead of hanging."""
LEASE_SECONDS = 3.0
"""How long after its claim's connection last answered (counted from when the question was sent)
a holder writes without asking again (:meth:`_ClaimKeeper.ensure_held`). Another run counts this
one dead only once its claim has stayed free for :data:`CLAIM_GONE_SECONDS`, and the claim was
held when that answer was given, so no run can act on its partitions before
``CLAIM_GONE_SECONDS - LEASE_SECONDS`` (7 s) after the lease ends: a write the lease let through
commits well inside that margin. The keeper renews it every :data:`KEEPER_CHECK_SECONDS`, so a
ranged run's writes (two a partition) rarely ask themselves; a lost claim ends it at once."""
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


@contextlib.contextmanager
def hold_driver_claim(instance: DagsterInstance, run_id: str) -> Iterator[None]:
    """Hold the run's claim and its driver claim for the duration of the block: what the
    process driving the run holds (the executor's orchestrating process, or an in-process run).
    A step in another process (on a Celery worker, a multiprocess child) holds only the run's
    claim, and goes on holding it when the process that submitted it dies: the run is dead all
    the same (nobody submits its next step), which the driver claim tells
    (:func:`driver_claim_held`), while the run's claim still keeps its partitions from another
    run until that step ends (:mod:`.in_flight`). On PostgreSQL the driver claim is one more
    connection, held by the orchestrating process only."""
    with hold_run_claim(instance, run_id), hold_run_claim(instance, _driver_claim(run_id)):
        yield


def driver_claim_held(instance: DagsterInstance, run_id: str,
                      taken_at: float | None = None) -> bool:
    """Whether a live process drives the run (holds its driver claim), with the same grace
    after a database restart as :func:`run_claim_held`."""
    return run_claim_held(instance, _driver_claim(run_id), taken_at)


def _driver_claim(run_id: str) -> str:
    return f"{run_id}.driver"


def ensure_run_claim(run_id: str) -> None:
    """The fence, called before every write of a run (the load's transaction before it commits,
    the landing store, the op outputs): return if this process holds the run's claim, or took it
    again within :data:`FENCE_GRACE_SECONDS` of losing it (or within the restart grace of a
    database that restarted; while it cannot be reached, waiting up to the run storage's outage
    budget); else raise :class:`RunClaimLost`. A process that holds no claim for the run (a
    direct call outside a run) is not fenced; a claim file (SQLite) is never lost while its
    process lives."""
    with _held_guard:
        entry = _held.get(run_id)
    if entry is not None and isinstance(entry[1], _ClaimKeeper):
        entry[1].ensure_held()


def lease_left(run_id: str) -> float:
    """Seconds this process may still write for the run without asking whether it holds the
    run's claim (:data:`LEASE_SECONDS`); 0 when it must ask (or holds no claim on PostgreSQL)."""
    with _held_guard:
        entry = _held.get(run_id)
    keeper = entry[1] if entry is not None else None
    if not isinstance(keeper, _ClaimKeeper) or keeper._leased_from is None:
        return 0.0
    return max(0.0, LEASE_SECONDS - (time.monotonic() - keeper._leased_from))


class RunClaimRefused(ConfigurationError):
    """The run storage database refused the claim's connection for a reason waiting will not
    cure (authentication, a missing database, too many clients, a bad setting)."""


def run_claim_gone(instance: DagsterInstance, run_id: str,
                   taken_at: float | None = None) -> bool:
    """Whether the claim of a run that has held it is free and stays free for
    :data:`CLAIM_GONE_SECONDS`: longer than its holder may take it again in and write on. A
    holder whose connection dropped is given that long before another run acts on its
    partitions."""
    deadline = time.monotonic() + CLAIM_GONE_SECONDS
    while not run_claim_held(instance, run_id, taken_at):
        if time.monotonic() >= deadline:
            return True
        time.sleep(0.5)
    return False


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
    whenever the database drops the old one, until it is released; and the fence: whether the
    holder may still write (:meth:`ensure_held`)."""

    def __init__(self, dsn: str, run_id: str, settings: dict[str, str]) -> None:
        self._dsn = dsn
        self._database = database_of(dsn)
        self._run_id = run_id
        self._key = _lock_key(run_id)
        self._released = threading.Event()
        self._guard = threading.RLock()
        self._connection: psycopg.Connection | None = None
        self._verified_at = time.monotonic()
        """When the claim was last known held (monotonic): its connection answered."""
        self._leased_from: float | None = None
        """When the last question its connection answered was sent (monotonic): the start of
        the lease (:data:`LEASE_SECONDS`); None while the claim is not known held."""
        self._server_started: float | None = None
        self._lost_since: float | None = None
        """Last known held before the claim was lost, until a connection taken again has held
        it through one check: two short gaps close together count as one long one."""
        self._retaken_at: float | None = None
        self._fenced: str | None = None
        try:
            self._take()
        except psycopg.Error as error:
            if not is_away(Store.RUN_STORAGE, error):  # a setting of ours: say so now
                raise RunClaimRefused(refusal_message(classify(error), settings)) from error
            self._lost_since = self._verified_at  # away: the keeper takes it once it answers
            away_for(Store.RUN_STORAGE, self._database, since=self._verified_at)
        self._thread = threading.Thread(target=self._keep, name=f"claim {run_id}", daemon=True)
        self._thread.start()

    def _take(self, timeout: float = 10) -> None:
        connection = psycopg.connect(self._dsn, autocommit=True,
                                     connect_timeout=max(2, int(timeout)), **CLIENT_TIMEOUTS)
        try:
            connection.execute(KEEPALIVE_SETTINGS)
            asked = time.monotonic()
            connection.execute("SELECT pg_advisory_lock_shared(%s)", (self._key,))
            server_clock, started = connection.execute(
                "SELECT extract(epoch FROM clock_timestamp()), "
                "extract(epoch FROM pg_postmaster_start_time())").fetchone()
        except BaseException:
            connection.close()
            raise
        now = time.monotonic()
        if self._lost_since is not None and self._fenced is None and not self._gap_forgiven(
                float(server_clock), float(started)) and now - self._lost_since >= (
                FENCE_GRACE_SECONDS):
            self._fenced = (f"run {self._run_id} lost its claim for "
                            f"{now - self._lost_since:.0f} s, past the {FENCE_GRACE_SECONDS:.0f} s "
                            "it may be taken again in: another run may have taken over its "
                            "partitions")
        answered(Store.RUN_STORAGE, self._database)
        self._connection = connection
        self._retaken_at = now if self._lost_since is not None else None
        self._verified_at = now
        self._leased_from = asked
        self._server_started = float(started)

    def _gap_forgiven(self, server_clock: float, started: float) -> bool:
        """A claim lost because the database restarted (or never taken because it was away),
        taken within the restart's grace: until then every check counts it held
        (:func:`run_claim_held`). A gap without a restart is a cut, and forgiven only if short."""
        if self._server_started is not None and started == self._server_started:
            return False
        return server_clock - started < RETAKE_GRACE_SECONDS

    def _verify(self) -> bool:
        """Whether the claim's connection still answers (so the claim is held); a connection
        that does not is closed and the claim counted lost from when it last answered."""
        if self._connection is None:
            self._leased_from = None
            return False
        asked = time.monotonic()
        try:
            self._connection.execute("SELECT 1")
        except psycopg.Error:
            self._leased_from = None
            self._connection.close()
            self._connection = None
            if self._lost_since is None:
                self._lost_since = self._verified_at
            away_for(Store.RUN_STORAGE, self._database, since=self._verified_at)
            return False
        now = time.monotonic()
        if self._retaken_at is not None and now - self._retaken_at >= KEEPER_CHECK_SECONDS / 2:
            self._lost_since = self._retaken_at = None  # held through a check: healed
        self._verified_at = now
        self._leased_from = asked
        return True

    def _keep(self) -> None:
        while not self._released.wait(KEEPER_CHECK_SECONDS):
            with self._guard:
                if self._verify():
                    continue
            while not self._released.is_set():
                with self._guard:
                    if self._released.is_set() or self._connection is not None:
                        break
                    try:
                        self._take(timeout=FENCE_GRACE_SECONDS / 2)
                        break
                    except psycopg.Error:
                        pass
                time.sleep(RECONNECT_SECONDS)
        with self._guard:
            if self._connection is not None:
                self._connection.close()
                self._connection = None

    def ensure_held(self) -> None:
        """Return if the claim is held, or taken again in time; else raise
        :class:`RunClaimLost`: this process must not write for the run any more.

        A claim that cannot be taken again now is ridden out as the run's storage calls ride out
        its database (:func:`.outages.ride_out`, the run storage's budget, on the clock they
        share, counted from when the claim last answered): nobody can count the run dead while
        nobody reaches the database. Once taken again, :meth:`_take` decides: within the grace
        of the loss, or of a restart of the database, the run goes on; else it is fenced
        (others reached the database meanwhile). Within the lease (:data:`LEASE_SECONDS`) of
        its connection's last answer, the claim is known held without asking again."""
        with self._guard:
            if (self._fenced is None and self._leased_from is not None
                    and time.monotonic() - self._leased_from < LEASE_SECONDS):
                return
            if self._fenced is None and not self._verify():
                try:
                    ride_out(Store.RUN_STORAGE, self._take_unless_held, target=self._database,
                             since=self._lost_since)
                except StoreAway as gone:
                    self._fenced = (f"run {self._run_id} lost its claim and could not take it "
                                    f"again: {gone}; another run may take over its partitions")
            if self._fenced is not None:
                raise RunClaimLost(f"{self._fenced}; nothing more is written by this run")

    def _take_unless_held(self) -> None:
        if self._fenced is None and self._connection is None:
            self._take(timeout=FENCE_GRACE_SECONDS / 2)

    def release(self) -> None:
        self._released.set()
        # A keeper busy reconnecting closes what it gets once it sees the release.
        self._thread.join(timeout=1)
        with self._guard:
            if self._connection is not None:
                self._connection.close()
                self._connection = None


def _acquire(instance: DagsterInstance, run_id: str):
    dsn = _postgres_dsn(instance)
    if dsn is not None:
        return _ClaimKeeper(dsn, run_id, connection_settings(instance))
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
