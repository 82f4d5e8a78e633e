"""The real ``dagster-webserver`` and ``dagster-daemon`` for tests.

:class:`DagsterServices` starts both, in sessions of their own, on a DAGSTER_HOME (e.g. the
production instance of :func:`~mostovik_pipelines_tests.support.instances.production_instance`),
serving this project's code location from a workspace file, and kills both whole process groups
(their code servers and the run workers the daemon launched included) when it exits. Its
``graphql`` is the client of :mod:`.graphql`.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any
from unittest import mock

import httpx
import yaml
from dagster import DagsterInstance

from mostovik_pipelines_tests.support import dagster_daemon
from mostovik_pipelines_tests.support.graphql import LOCATION_NAME, DagsterGraphQL
from mostovik_pipelines_tests.support.instances import create_instance_storage
from mostovik_pipelines_tests.support.postgres import free_port
from mostovik_pipelines_tests.support.processes import DAGSTER, REPO

BIN = Path(DAGSTER).parent
LOG_TAIL_CHARS = 4000
SUPERVISOR_RESTART_SECONDS = 5.0
"""deploy/systemd's ``RestartSec`` for the webserver and the daemon."""
ANSI_COLOUR = re.compile(r"\x1b\[[0-9;]*m")


DAEMON_UNIT = REPO / "deploy" / "systemd" / "mostovik-daemon.service"


def daemon_unit_environment() -> dict[str, str]:
    """The ``Environment=`` settings of the deployment's daemon unit: the tests' daemon runs
    with them, as systemd starts it."""
    return dict(line.removeprefix("Environment=").split("=", 1)
                for line in DAEMON_UNIT.read_text().splitlines()
                if line.startswith("Environment="))


class DagsterServices:
    """``dagster-webserver`` and ``dagster-daemon`` on ``dagster_home``, serving this project's
    code location, with logs and the workspace file under ``work_dir``; a context manager.

    ``environment`` is added to this process's environment for both (and so for their code
    servers and run workers): the instance's settings and the code location's ``MOSTOVIK_*``.
    ``code_location_module``'s ``defs`` is the location served (the project's by default).
    """

    def __init__(self, work_dir: Path, dagster_home: Path, environment: Mapping[str, str],
                 *, location_name: str = LOCATION_NAME,
                 stopped_schedules: Sequence[str] = (),
                 workspace_file: Path | None = None,
                 code_location_module: str = "mostovik_pipelines") -> None:
        self.work_dir = work_dir
        self.given_workspace = workspace_file
        """A workspace file to serve (e.g. deploy/workspace.yaml: a code server over gRPC)
        instead of the package loaded by each service."""
        self.code_location_module = code_location_module
        self.stopped_schedules = tuple(stopped_schedules)
        self.dagster_home = dagster_home
        self.environment = {**os.environ, **environment, "DAGSTER_HOME": str(dagster_home)}
        self.location_name = location_name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.workspace_file = work_dir / "workspace.yaml"
        self.webserver_log = work_dir / "webserver.log"
        self.daemon_log = work_dir / "daemon.log"
        self.graphql = DagsterGraphQL(f"{self.url}/graphql", location_name=location_name,
                                      diagnostics=self.log_tails)
        self._processes: dict[str, subprocess.Popen] = {}
        self._left_behind: list[int] = []
        """Process groups of killed processes: what they left running (code servers, run
        workers) is ended with the services."""
        self._daemon_started_at = 0.0
        """When the running daemon was started: only its heartbeats since count as healthy (a
        killed daemon's last heartbeats still read as healthy for a while)."""

    @contextlib.contextmanager
    def instance(self) -> Iterator[DagsterInstance]:
        """The instance the services run on, as an operator's tools in this process open it."""
        with (mock.patch.dict(os.environ, self.environment),
              DagsterInstance.from_config(str(self.dagster_home)) as instance):
            yield instance

    def __enter__(self) -> DagsterServices:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self, timeout: float = 180, *, daemon: bool = True) -> None:
        """Start both (the webserver alone without ``daemon``: the UI, nothing ticking), then
        wait until the code location is loaded and every daemon the instance requires is
        healthy. The ``stopped_schedules`` are stopped in the UI before the daemon starts, so
        none of them ever ticks."""
        self._write_workspace()
        create_instance_storage(self.dagster_home, self.environment)
        self._start_webserver()
        deadline = time.monotonic() + timeout
        if not daemon:
            self._wait_for_location(deadline)
            return
        if self.stopped_schedules:
            self._wait_for_location(deadline)
            for name in self.stopped_schedules:
                self.graphql.stop_schedule(name)
        self._start_daemon()
        self._wait_for_location(deadline)
        self._wait_for_daemons(deadline)

    @property
    def daemon_group(self) -> int:
        """The running daemon's process group: the daemon, its code servers and the run
        processes they spawned."""
        return self._processes["daemon"].pid

    def kill_daemon(self, with_its_group: bool = False) -> list[int]:
        """SIGKILL to the daemon process alone, as a crash: the code servers it started and
        the runs they launched go on until they notice. ``with_its_group``: to the daemon, its
        code servers and the run workers they started, as a lost host or systemd's stop of the
        unit (its whole control group) ends them. Returns the ids of the processes killed."""
        process = self._processes.pop("daemon")
        killed = processes_in_group(process.pid) if with_its_group else [process.pid]
        if with_its_group:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
        else:
            process.kill()
        process.wait(timeout=10)
        self._left_behind.append(process.pid)
        return killed

    def start_daemon(self, timeout: float = 180) -> None:
        """A new daemon, as systemd restarts one; returns once every daemon is healthy."""
        self._start_daemon()
        self.wait_healthy(timeout)

    def wait_healthy(self, timeout: float = 180) -> None:
        """Returns once every daemon the instance requires reports healthy to the webserver,
        with a heartbeat of the daemon running now."""
        self._wait_for_daemons(time.monotonic() + timeout)

    def revive(self, restart_seconds: float = SUPERVISOR_RESTART_SECONDS) -> list[str]:
        """What the deployment's supervisor does (``Restart=on-failure``, ``RestartSec=5`` in
        deploy/systemd): the webserver or daemon found exited is started again after
        ``restart_seconds``. Returns the names of those started again."""
        revived = []
        for name, process in list(self._processes.items()):
            if process.poll() is None:
                continue
            time.sleep(restart_seconds)
            self._left_behind.append(process.pid)
            if name == "daemon":
                self._start_daemon()
            else:
                self._start_webserver()
            revived.append(name)
        return revived

    def _start_daemon(self) -> None:
        self._daemon_started_at = time.time()
        self._start("daemon", [
            sys.executable, dagster_daemon.__file__, "run", "--workspace", str(self.workspace_file),
        ], self.daemon_log, daemon_unit_environment())

    def _start_webserver(self) -> None:
        self._start("webserver", [
            str(BIN / "dagster-webserver"), "--host", "127.0.0.1", "--port", str(self.port),
            "--workspace", str(self.workspace_file),
        ], self.webserver_log)

    def stop(self, grace: float = 10) -> None:
        """SIGTERM to both process groups, SIGKILL to whatever is left after ``grace`` seconds:
        the webserver, the daemon, their code servers and any run worker still going."""
        # An open keep-alive connection would hold up the webserver's graceful shutdown.
        self.graphql.close()
        for process in self._processes.values():
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for process in self._processes.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
        for process in self._processes.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            if process.poll() is None:
                process.wait(timeout=10)
        for group in self._left_behind:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)
        self._processes.clear()
        self._left_behind.clear()

    def log_tails(self, chars: int = LOG_TAIL_CHARS) -> str:
        """The end of both logs, for failure messages."""
        return "\n".join(
            f"--- {path.name} (last {chars} chars) ---\n"
            + (ANSI_COLOUR.sub("", path.read_text(errors="replace"))[-chars:]
               if path.exists() else "(no log)")
            for path in (self.webserver_log, self.daemon_log)
        )

    def _write_workspace(self) -> None:
        if self.given_workspace is not None:
            self.workspace_file.write_text(self.given_workspace.read_text())
            return
        self.workspace_file.write_text(yaml.safe_dump({"load_from": [{"python_module": {
            "module_name": self.code_location_module,
            "attribute": "defs",
            "location_name": self.location_name,
            "working_directory": str(REPO),
        }}]}))

    def _start(self, name: str, command: list[str], log_path: Path,
               unit_environment: Mapping[str, str] | None = None) -> None:
        with log_path.open("ab") as log:
            self._processes[name] = subprocess.Popen(
                command, env={**self.environment, **(unit_environment or {})},
                cwd=self.work_dir, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True,
            )

    def _check_alive(self, waiting_for: str) -> None:
        for name, process in self._processes.items():
            if process.poll() is not None:
                raise AssertionError(f"dagster {name} exited with {process.returncode} while "
                                     f"waiting for {waiting_for}\n{self.log_tails()}")

    def _wait_for_location(self, deadline: float) -> None:
        status = "not answering"
        while True:
            self._check_alive(f"code location {self.location_name}")
            with contextlib.suppress(httpx.TransportError):
                status = self.graphql.location_statuses().get(self.location_name, "missing")
                if status == "LOADED":
                    error = self.graphql.location_load_error()
                    if error is not None:
                        raise AssertionError(
                            f"code location {self.location_name} failed to load:\n{error}\n"
                            f"{self.log_tails()}")
                    return
            if time.monotonic() > deadline:
                raise AssertionError(f"code location {self.location_name} not loaded in time "
                                     f"(webserver: {status})\n{self.log_tails()}")
            time.sleep(0.5)

    def _wait_for_daemons(self, deadline: float) -> None:
        unhealthy: dict[str, Any] = {}
        while True:
            self._check_alive("healthy daemons")
            statuses = self.graphql.daemon_statuses()
            unhealthy = {kind: status for kind, status in statuses.items()
                         if status["required"] and not (
                             status["healthy"]
                             and (status["lastHeartbeatTime"] or 0.0) >= self._daemon_started_at)}
            if statuses and not unhealthy:
                return
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"daemons not healthy in time: {json.dumps(unhealthy, indent=1)[:3000]}\n"
                    f"{self.log_tails()}")
            time.sleep(1)


def processes_in_group(group: int) -> list[int]:
    """The ids of the live processes of process group ``group``."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            # pid (comm) state ppid pgrp ...: comm may hold spaces, so split after its ")".
            fields = stat.read_text().rpartition(")")[2].split()
            if int(fields[2]) == group:
                members.append(int(stat.parent.name))
    return sorted(members)
