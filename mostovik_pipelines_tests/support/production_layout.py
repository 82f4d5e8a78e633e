"""The runbook's production layout on this machine (deploy/README.md), machine by machine:

* the **orchestrating host**: the one code server (``dagster code-server start``, as
  deploy/systemd/mostovik-code-server.service runs it) serving the installed release, and the
  webserver and the daemon reaching it over gRPC through deploy/workspace.yaml; the runs the
  daemon launches are children of that code server;
* **worker hosts**: a Celery worker each (deploy/bin/mostovik-celery), on a working directory
  of its own;

each host with a DAGSTER_HOME, artifacts, compute logs and data directory of its own, on its own
"local disk" (a directory no other host reads). They share nothing but PostgreSQL (the run
storage, the warehouse), Redis (broker and result backend) and the object store: the landing
store and the op outputs are ``s3://`` buckets of an S3 API server behind a fault front
(:class:`~.object_store_front.S3Front`).

The installed code is a module of the layout's own, :data:`RELEASE_MODULE` (the package's
definitions; a later release adds one asset check), so that a deploy changes the code without
touching the installed package: :meth:`ProductionLayout.deploy` installs a release, reloads the
location as the UI's "Reload" does and restarts the workers, as "Deploy new code" says.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

from dagster import DagsterInstance

from mostovik_pipelines_tests.support.celery_workers import CeleryWorker
from mostovik_pipelines_tests.support.code_server import WORKSPACE, CodeServer, reload_location
from mostovik_pipelines_tests.support.instances import create_instance_storage, production_instance
from mostovik_pipelines_tests.support.object_store_front import S3Front
from mostovik_pipelines_tests.support.postgres import ThrowawayPostgres
from mostovik_pipelines_tests.support.processes import REPO
from mostovik_pipelines_tests.support.redis import ThrowawayRedis
from mostovik_pipelines_tests.support.webserver import SUPERVISOR_RESTART_SECONDS, DagsterServices

RELEASE_MODULE = "mostovik_release"
LANDING_BUCKET = "mostovik-landing"
OUTPUTS_BUCKET = "mostovik-outputs"
WORKER_STOP_SECONDS = 300
"""How long a worker's warm shutdown may take on a restart (its unit gives an hour): its running
step finishes first."""


def release_code(number: int) -> str:
    """The code of release ``number``: the package's definitions, and from the second release on
    one more asset check, ``release_<number>_check``, which passes."""
    if number <= 1:
        return "from mostovik_pipelines.definitions import defs  # noqa: F401\n"
    return f'''\
from dagster import AssetCheckResult, Definitions, asset_check

from mostovik_pipelines.definitions import defs as released


@asset_check(asset="cbr_daily_rates", description="Added by release {number}.")
def release_{number}_check():
    return AssetCheckResult(passed=True)


defs = Definitions.merge(released, Definitions(asset_checks=[release_{number}_check]))
'''


class Host:
    """A machine of the layout: a directory standing for its local disk, and the environment of
    its processes (the shared env file's, with its own DAGSTER_HOME and local directories)."""

    def __init__(self, root: Path, name: str, instance_yaml: Path,
                 shared: Mapping[str, str]) -> None:
        self.name = name
        self.disk = root / name
        home = self.disk / "dagster_home"
        home.mkdir(parents=True)
        shutil.copy(instance_yaml, home / "dagster.yaml")
        self.home = home
        self.environment = {
            **shared,
            "DAGSTER_HOME": str(home),
            "MOSTOVIK_DAGSTER_ARTIFACT_DIR": str(self.disk / "artifacts"),
            "MOSTOVIK_DAGSTER_LOG_DIR": str(self.disk / "compute_logs"),
            "MOSTOVIK_DATA_DIR": str(self.disk / "data"),
        }

    def lose_disk(self) -> None:
        shutil.rmtree(self.disk, ignore_errors=True)


class ProductionLayout:
    """The layout's hosts and processes over the given run storage, Redis and object store;
    ``settings`` are the env file's other lines (the warehouse, the sources); ``buckets`` are
    created besides the two stores'."""

    def __init__(self, root: Path, run_storage: ThrowawayPostgres, redis: ThrowawayRedis,
                 store: S3Front, settings: Mapping[str, str], *,
                 workers: Sequence[str] = ("worker-a", "worker-b"),
                 stopped_schedules: Sequence[str] = (), database: str = "dagster_production",
                 buckets: Sequence[str] = ()) -> None:
        self.root = root
        self.run_storage = run_storage
        self.redis = redis
        self.store = store
        self.release_dir = root / "release"
        self.release_dir.mkdir(parents=True)
        self.release = 1
        self._install(release_code(1))
        instance_home, instance_environment = production_instance(run_storage, database, root)
        self.code_server = CodeServer(RELEASE_MODULE, self.release_dir,
                                      root / "code_server.log")
        self.shared = {
            **instance_environment,
            **store.environment,
            **self.code_server.settings,
            "MOSTOVIK_EXECUTOR": "celery",
            "MOSTOVIK_CELERY_BROKER_URL": redis.url(0),
            "MOSTOVIK_CELERY_BACKEND_URL": redis.url(1),
            "MOSTOVIK_LANDING_DIR": f"s3://{LANDING_BUCKET}/prod",
            "MOSTOVIK_STORAGE_DIR": f"s3://{OUTPUTS_BUCKET}/prod",
            # The release is the installed code, the same on every host; this repository stands
            # for the installed package (the workers import the release from it).
            "PYTHONPATH": os.pathsep.join([str(self.release_dir), str(REPO)]),
            **settings,
        }
        for bucket in (LANDING_BUCKET, OUTPUTS_BUCKET, *buckets):
            store.bucket(bucket)
        instance_yaml = instance_home / "dagster.yaml"
        self._instance_yaml = instance_yaml
        self.orchestrator = Host(root, "orchestrator", instance_yaml, self.shared)
        self.hosts: dict[str, Host] = {}
        self.workers: dict[str, CeleryWorker] = {}
        self.services = DagsterServices(
            self.orchestrator.disk, self.orchestrator.home, self.orchestrator.environment,
            workspace_file=WORKSPACE, stopped_schedules=stopped_schedules)
        self._replacements = 0
        try:
            create_instance_storage(self.orchestrator.home, self.services.environment)
            for name in workers:
                self.start_worker(name, wait=False)
            for worker in self.workers.values():
                worker.wait_ready()
            self.code_server.start(self.services.environment)
            self.services.start()
        except BaseException:
            self.close()
            raise

    @property
    def environment(self) -> dict[str, str]:
        """The orchestrating host's environment: what an operator's ``dagster`` or
        ``mostovik`` command there runs with."""
        return self.services.environment

    def instance(self) -> contextlib.AbstractContextManager[DagsterInstance]:
        return self.services.instance()

    # --- workers ----------------------------------------------------------------------------

    def start_worker(self, name: str, wait: bool = True) -> CeleryWorker:
        """A worker host ``name`` with a new local disk, its worker started."""
        host = Host(self.root, name, self._instance_yaml, self.shared)
        self.hosts[name] = host
        worker = CeleryWorker(name, self.root / f"{name}.log")
        self.workers[name] = worker.start(host.environment, cwd=host.disk)
        if wait:
            worker.wait_ready()
        return worker

    def lose_worker_host(self, name: str) -> str:
        """Worker host ``name`` lost with its local disk (its worker killed, SIGKILL to every
        process of it, and its directory gone); a replacement host with a new name started in
        its place, as an operator does. The replacement's name."""
        self.workers.pop(name).kill()
        self.hosts.pop(name).lose_disk()
        self._replacements += 1
        replacement = f"worker-r{self._replacements}"
        self.start_worker(replacement)
        return replacement

    def restart_workers(self) -> None:
        """Each worker restarted in turn, as ``systemctl restart mostovik-worker@<name>`` does:
        a warm shutdown (no new steps, the running one finished), then a start on the code
        installed now."""
        for name in list(self.workers):
            self.workers[name].stop(timeout=WORKER_STOP_SECONDS)
            log = self.root / f"{name}.log"
            worker = CeleryWorker(name, log)
            self.workers[name] = worker.start(self.hosts[name].environment,
                                              cwd=self.hosts[name].disk)
            worker.wait_ready()

    # --- the code server --------------------------------------------------------------------

    def kill_code_server(self) -> None:
        """The code server's process dies (SIGKILL), and with it every process of its unit (the
        run workers it started): systemd's stop of a unit whose main process died sends SIGKILL
        to what is left of its control group (``KillMode=mixed``)."""
        self.code_server.kill()

    def start_code_server(self) -> None:
        self.code_server.start(self.services.environment)

    def revive(self, restart_seconds: float = SUPERVISOR_RESTART_SECONDS) -> list[str]:
        """What systemd does for every unit of the orchestrating host (``Restart=on-failure``,
        ``RestartSec=5``): a code server, webserver or daemon found exited started again."""
        revived = []
        if self.code_server.exited():
            time.sleep(restart_seconds)
            self.start_code_server()
            revived.append("code server")
        return revived + self.services.revive(restart_seconds)

    def deploy(self) -> int:
        """The next release deployed as deploy/README's "Deploy new code" says: installed,
        the code location reloaded over the UI's GraphQL, the workers restarted. Its number."""
        self.release += 1
        self._install(release_code(self.release))
        reload_location(self.services.graphql)
        self.restart_workers()
        return self.release

    def _install(self, code: str) -> None:
        """The release's module written whole beside its place and renamed into it."""
        staged = self.release_dir / f".{RELEASE_MODULE}.py.new"
        staged.write_text(code)
        staged.replace(self.release_dir / f"{RELEASE_MODULE}.py")

    def log_paths(self) -> list[Path]:
        return [self.services.daemon_log, self.code_server.log_path,
                *(worker.log_path for worker in self.workers.values())]

    def close(self) -> None:
        self.services.stop()
        self.code_server.stop()
        for worker in self.workers.values():
            with contextlib.suppress(Exception):
                worker.stop()


@contextlib.contextmanager
def production_layout(root: Path, run_storage: ThrowawayPostgres, settings: Mapping[str, str],
                      **options) -> Iterator[ProductionLayout]:
    """A :class:`ProductionLayout` with a persistent Redis and an object store of its own,
    all stopped after."""
    redis = ThrowawayRedis(persistent=True).start()
    store = S3Front().start()
    try:
        layout = ProductionLayout(root, run_storage, redis, store, settings, **options)
        try:
            yield layout
        finally:
            layout.close()
    finally:
        store.close()
        redis.stop()
