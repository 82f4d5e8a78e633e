"""A throw-away PostgreSQL server on 127.0.0.1 for the tests.

``initdb`` refuses to run as root, so under root the cluster belongs to a dedicated system user
(set up once by ``support/machine.py``) and every server command runs as that user. The cluster
lives in a temp dir and is deleted when the server stops. It is not durable against the machine
crashing (``fsync`` off: a test server), but it is against the server crashing, as production
is: a commit is written to the operating system before it is acknowledged
(``synchronous_commit`` on), so ``pg_ctl -m immediate`` (:meth:`ThrowawayPostgres.pause`) loses
no committed transaction. With it off, a crash lost a backfill the webserver had just stored.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from mostovik_pipelines_tests.support.machine import (
    SERVER_USER,
    ensure_server_user,
    require_binary,
)

SUPERUSER = "mostovik"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ThrowawayPostgres:
    def __init__(self, server_user: str = SERVER_USER) -> None:
        self.server_user = server_user
        self.port = free_port()
        self.password = secrets.token_urlsafe(16)
        self.root = Path(tempfile.mkdtemp(prefix="mostovik-pg-"))
        self.data = self.root / "data"
        self.socket_dir = self.root / "socket"
        self._as_root = os.geteuid() == 0

    def _run(self, *args: str) -> None:
        command = list(args)
        if self._as_root:
            command = ["runuser", "-u", self.server_user, "--", *command]
        subprocess.run(command, check=True, capture_output=True, text=True)

    def start(self) -> ThrowawayPostgres:
        self.socket_dir.mkdir(parents=True)
        pwfile = self.root / "pwfile"
        pwfile.write_text(self.password)
        if self._as_root:
            ensure_server_user(self.server_user)
            shutil.chown(self.root, self.server_user)
            for path in (self.socket_dir, pwfile):
                shutil.chown(path, self.server_user)
        self._run(require_binary("initdb"), "-D", str(self.data), "-U", SUPERUSER,
                  f"--pwfile={pwfile}", "--auth-local=trust", "--auth-host=scram-sha-256",
                  "-E", "UTF8", "--locale=C.UTF-8")
        self._options = " ".join([
            f"-p {self.port}", f"-k {self.socket_dir}", "-c listen_addresses=127.0.0.1",
            "-c fsync=off", "-c full_page_writes=off",
            "-c max_connections=300", "-c shared_buffers=256MB",
        ])
        self.resume()
        return self

    def pause(self) -> None:
        """Stop the server as a crash or failover does (``pg_ctl -m immediate``), keeping its
        data: every connection drops, new ones are refused until :meth:`resume`."""
        self._run(require_binary("pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop")

    def resume(self) -> None:
        """Start the paused server again, on the same port with the same data."""
        self._run(require_binary("pg_ctl"), "-D", str(self.data), "-o", self._options,
                  "-l", str(self.root / "server.log"), "-w", "-t", "60", "start")

    def stop(self) -> None:
        try:
            # A paused server is stopped already (pg_ctl then says so and exits 1).
            with contextlib.suppress(subprocess.CalledProcessError):
                self.pause()
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    def url(self, database: str = "postgres", driver: str = "psycopg") -> str:
        return (f"postgresql+{driver}://{SUPERUSER}:{self.password}@127.0.0.1:{self.port}/"
                f"{database}")

    def dsn(self, database: str = "postgres") -> str:
        return (f"host=127.0.0.1 port={self.port} user={SUPERUSER} password={self.password} "
                f"dbname={database}")


def dsn_of(url: str) -> str:
    """The libpq connection string of a SQLAlchemy ``postgresql+psycopg://`` URL, for opening a
    plain psycopg connection to the same database (an operator's psql, an observer)."""
    return url.replace("postgresql+psycopg://", "postgresql://", 1)


def backend_waiting_on_a_lock(observer, query_like: str, timeout: float = 60) -> int | None:
    """The pid of another backend waiting on a lock while running a statement that matches
    ``query_like`` (SQL LIKE), polled until ``timeout``; ``observer`` must be in autocommit,
    since pg_stat_activity is a snapshot per transaction."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        row = observer.execute(
            "SELECT pid FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
            "AND query LIKE %s AND pid <> pg_backend_pid()", (query_like,)
        ).fetchone()
        if row:
            return row[0]
        time.sleep(0.05)
    return None
