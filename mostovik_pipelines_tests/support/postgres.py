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
import threading
import time
from pathlib import Path

from mostovik_pipelines_tests.support.machine import (
    SERVER_USER,
    ensure_server_user,
    refuse_server_in_quick_check,
    require_binary,
)

SUPERUSER = "mostovik"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ThrowawayPostgres:
    def __init__(self, server_user: str = SERVER_USER, max_connections: int = 300) -> None:
        self.server_user = server_user
        self.max_connections = max_connections
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
        refuse_server_in_quick_check("PostgreSQL")
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
            f"-c max_connections={self.max_connections}", "-c shared_buffers=256MB",
        ])
        self.resume()
        return self

    def pause(self) -> None:
        """Stop the server as a crash or failover does (``pg_ctl -m immediate``), keeping its
        data: every connection drops, new ones are refused until :meth:`resume`."""
        self._run(require_binary("pg_ctl"), "-D", str(self.data), "-m", "immediate", "-w", "stop")

    def down_for(self, seconds: float) -> None:
        """An outage of ``seconds``: :meth:`pause`, then :meth:`resume` (also if interrupted).
        The wait is the fault's own length, not a wait for something to happen."""
        self.pause()
        try:
            time.sleep(seconds)
        finally:
            self.resume()

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


def cut_claim_connections(observer, port: int, run_id: str | None = None) -> list[int]:
    """Cut, as a network fault does, the sockets of the sessions holding a run's claim (a shared
    advisory lock) on the server at ``port``, and only those: ``ss -K`` (root) kills the
    client's end of each (found by its port, ``client_port`` in pg_stat_activity) and the server
    sees the session end. Every other connection, and new ones, go on. With ``run_id``, only the
    session holding that run's claim (not its driver claim, a connection of its own). The cut
    sessions' pids; ``observer`` is an autocommit connection to the same server."""
    only_run = ""
    parameters: tuple = ()
    if run_id is not None:
        # Imported here: the servers' support stays free of the package (the benchmarks use it).
        from mostovik_pipelines.platform.claims import _lock_key

        # pg_locks shows a bigint advisory key as its high and low 32 bits, objsubid 1.
        key = _lock_key(run_id) & 0xFFFF_FFFF_FFFF_FFFF
        only_run = " AND l.classid = %s AND l.objid = %s AND l.objsubid = 1"
        parameters = (key >> 32, key & 0xFFFF_FFFF)
    rows = observer.execute(
        "SELECT a.pid, a.client_port FROM pg_locks l JOIN pg_stat_activity a USING (pid) "
        "WHERE l.locktype = 'advisory' AND l.mode = 'ShareLock' AND l.granted" + only_run,
        parameters).fetchall()
    for _, client_port in rows:
        subprocess.run(["ss", "-K", "dst", "127.0.0.1", "dport", "=", str(port),
                        "sport", "=", str(client_port)], check=True, capture_output=True)
    return [pid for pid, _ in rows]


class PartitionableLink:
    """A TCP relay on 127.0.0.1 to a server's ``port``, for the processes that should be cut
    off from it alone: :meth:`cut` closes every relayed connection and refuses new ones (the
    holder is partitioned from the database), while everyone connecting to ``port`` directly
    goes on as before."""

    def __init__(self, port: int) -> None:
        self.target = port
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._sockets: list[socket.socket] = []
        self._guard = threading.Lock()
        threading.Thread(target=self._accept, args=(self._listener,), daemon=True).start()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # cut
            server = socket.create_connection(("127.0.0.1", self.target))
            with self._guard:
                self._sockets += [client, server]
            for source, sink in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    @staticmethod
    def _pump(source: socket.socket, sink: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                sink.sendall(data)
        with contextlib.suppress(OSError):
            sink.shutdown(socket.SHUT_WR)

    def heal(self) -> None:
        """Relay new connections again, on the same port (the route is back)."""
        self._listener = socket.create_server(("127.0.0.1", self.port))
        threading.Thread(target=self._accept, args=(self._listener,), daemon=True).start()

    def cut(self) -> None:
        """Drop every relayed connection at once and refuse new ones from now on."""
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accepting thread
        self._listener.close()
        with self._guard:
            for sock in self._sockets:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()
