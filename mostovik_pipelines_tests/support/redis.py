"""A throw-away Redis server on 127.0.0.1 for the tests: the Celery broker and result backend.

A random password (so the tests can prove it never leaks), its config, log and data in a temp
dir that is deleted when it stops. No persistence by default (``save ''``, ``appendonly no``);
``persistent=True`` is the deployment's set-up (``appendonly yes``, every write synced), so a
server killed with SIGKILL and started again (:meth:`ThrowawayRedis.crash`, then
:meth:`ThrowawayRedis.start`) still holds every queued task and stored result.
"""

from __future__ import annotations

import secrets
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import redis

from mostovik_pipelines_tests.support.machine import refuse_server_in_quick_check, require_binary
from mostovik_pipelines_tests.support.postgres import free_port
from mostovik_pipelines_tests.support.processes import stop_process


class ThrowawayRedis:
    def __init__(self, *, persistent: bool = False) -> None:
        self.persistent = persistent
        self.port = free_port()
        self.password = secrets.token_urlsafe(16)
        self.root = Path(tempfile.mkdtemp(prefix="mostovik-redis-"))
        self._process: subprocess.Popen | None = None

    def start(self, timeout: float = 30) -> ThrowawayRedis:
        refuse_server_in_quick_check("Redis")
        config = self.root / "redis.conf"
        config.write_text("\n".join([
            "bind 127.0.0.1", f"port {self.port}", "save ''",
            *(["appendonly yes", "appendfsync always"] if self.persistent else ["appendonly no"]),
            f"requirepass {self.password}", f"dir {self.root}",
            f"logfile {self.root / 'redis.log'}", "daemonize no",
        ]) + "\n")
        config.chmod(0o600)
        self._process = subprocess.Popen([require_binary("redis-server"), str(config)],
                                         start_new_session=True)
        deadline = time.monotonic() + timeout
        while True:
            try:
                redis.Redis.from_url(self.url()).ping()
                return self
            except redis.exceptions.ConnectionError as error:
                if self._process.poll() is not None or time.monotonic() > deadline:
                    log = self.log()[-2000:]
                    self.stop()
                    raise RuntimeError(f"redis-server did not start: {log}") from error
                time.sleep(0.05)

    def url(self, db: int = 0) -> str:
        return f"redis://:{self.password}@127.0.0.1:{self.port}/{db}"

    def log(self) -> str:
        path = self.root / "redis.log"
        return path.read_text() if path.exists() else ""

    def crash(self) -> None:
        """SIGKILL, as a crashed or OOM-killed server dies; :meth:`start` brings it back on the
        same port with the same data."""
        assert self._process is not None and self._process.poll() is None, "not running"
        self._process.kill()
        self._process.wait(timeout=10)

    def stop(self) -> None:
        try:
            stop_process(self._process, 10)
        finally:
            shutil.rmtree(self.root, ignore_errors=True)
