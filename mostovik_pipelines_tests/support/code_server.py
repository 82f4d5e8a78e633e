"""The one code server of the production layout (deploy/systemd/mostovik-code-server.service) for
tests: ``dagster code-server start`` on 127.0.0.1, in a session of its own, serving a module's
``defs`` as the code location the webserver and the daemon reach over gRPC
(deploy/workspace.yaml), and the UI's reload of that location.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
from collections.abc import Mapping
from pathlib import Path

from mostovik_pipelines_tests.support.graphql import LOCATION_NAME, DagsterGraphQL, GraphQLError
from mostovik_pipelines_tests.support.graphql_queries import RELOAD_LOCATION_MUTATION
from mostovik_pipelines_tests.support.postgres import free_port
from mostovik_pipelines_tests.support.processes import DAGSTER, stop_session
from mostovik_pipelines_tests.support.waiting import PROCESS_START_MARGIN_SECONDS, wait_until

WORKSPACE = Path(__file__).resolve().parents[2] / "deploy" / "workspace.yaml"
PORT_SETTING = "MOSTOVIK_CODE_SERVER_PORT"
STARTED_LINE = "Started Dagster code server"


class CodeServer:
    """``dagster code-server start`` of ``module``'s ``defs``, imported from ``working_dir``,
    with its log under ``log_path``; the port is in :attr:`settings` as the env file names it."""

    def __init__(self, module: str, working_dir: Path, log_path: Path) -> None:
        self.module = module
        self.working_dir = working_dir
        self.log_path = log_path
        self.port = free_port()
        self.settings = {PORT_SETTING: str(self.port)}
        self._process: subprocess.Popen | None = None

    def start(self, environment: Mapping[str, str],
              timeout: float = PROCESS_START_MARGIN_SECONDS) -> CodeServer:
        """Start it and return once it has loaded the code and serves."""
        command = [DAGSTER, "code-server", "start", "-h", "127.0.0.1", "-p", str(self.port),
                   "-m", self.module, "-a", "defs", "-d", str(self.working_dir),
                   "--location-name", LOCATION_NAME]
        with self.log_path.open("ab") as log:
            self._process = subprocess.Popen(
                command, env={**os.environ, **environment, **self.settings},
                cwd=self.working_dir, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True)
        def serving() -> bool:
            if self._process.poll() is not None:
                raise AssertionError(f"code server exited with {self._process.returncode}:\n"
                                     f"{self.log()[-3000:]}")
            return STARTED_LINE in self.log()

        wait_until(serving, timeout, "the code server serving", lambda: self.log()[-3000:])
        return self

    @property
    def group(self) -> int:
        """Its process group (its session): the server and the run workers it started."""
        assert self._process is not None, "not started"
        return self._process.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def kill(self) -> None:
        """SIGKILL to its whole session: the server, its server process and the run workers it
        started."""
        if self._process is not None and self._process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._process.pid, signal.SIGKILL)
            self._process.wait(timeout=30)

    def exited(self) -> bool:
        """Whether it was started and has ended since."""
        return self._process is not None and self._process.poll() is not None

    def stop(self, grace: float = 10) -> None:
        """SIGTERM to its session, SIGKILL to whatever is left after ``grace`` seconds."""
        stop_session(self._process, grace)


def reload_location(graphql: DagsterGraphQL) -> None:
    """Reload the code location as the UI's "Reload" button does; fails unless it loaded."""
    result = graphql.execute(RELOAD_LOCATION_MUTATION, {"location": graphql.location_name})[
        "reloadRepositoryLocation"]
    loaded = (result.get("__typename") == "WorkspaceLocationEntry"
              and (result.get("locationOrLoadError") or {}).get("__typename")
              == "RepositoryLocation")
    if not loaded:
        raise GraphQLError(f"reload of {graphql.location_name} failed: {result}")
