"""The platform suite's deployment: the runbook's production deployment on this machine, over a
chaos environment's warehouse and stand-in (deploy/dagster.yaml on a PostgreSQL server of its
own, a persistent password-protected Redis, two Celery workers, the webserver and the daemon),
with a small disk for the landing store where it can mount one (as root)."""

from __future__ import annotations

import contextlib
from pathlib import Path

from dagster import DagsterInstance

from mostovik_pipelines import definitions
from mostovik_pipelines_tests.chaos.environment import ChaosEnvironment
from mostovik_pipelines_tests.chaos.platform_host import HELD_SECONDS
from mostovik_pipelines_tests.support.celery_workers import CeleryWorker
from mostovik_pipelines_tests.support.disk import (
    mount_small_disk,
    unmount_small_disk,
    why_no_small_disk,
)
from mostovik_pipelines_tests.support.instances import production_instance
from mostovik_pipelines_tests.support.postgres import ThrowawayPostgres
from mostovik_pipelines_tests.support.redis import ThrowawayRedis
from mostovik_pipelines_tests.support.webserver import DagsterServices

REPO = Path(__file__).resolve().parents[2]


class PlatformEnvironment:
    """The production deployment over a chaos environment's warehouse and stand-in."""

    def __init__(self, chaos: ChaosEnvironment) -> None:
        self.chaos = chaos
        self.root = chaos.root / "platform"
        self.root.mkdir()
        self.run_storage = ThrowawayPostgres().start()
        self.redis = ThrowawayRedis(persistent=True).start()
        self.disk: Path | None = None
        self.disk_refused = why_no_small_disk()
        landing = self.root / "landing"
        if self.disk_refused is None:
            try:
                mount_small_disk(self.root / "landing_disk", size="4m")
                self.disk = self.root / "landing_disk"
                landing = self.disk / "landing"
                landing.mkdir()
            except OSError as error:
                self.disk_refused = str(error)
        self.home, instance_environment = production_instance(
            self.run_storage, "dagster_platform", self.root)
        self.environment = {
            **instance_environment,
            "MOSTOVIK_EXECUTOR": "celery",
            "MOSTOVIK_CELERY_BROKER_URL": self.redis.url(0),
            "MOSTOVIK_CELERY_BACKEND_URL": self.redis.url(1),
            "MOSTOVIK_DATABASE_URL": chaos.url,
            "MOSTOVIK_CBR_URL": chaos.standin_server.cbr_url,
            # A fetch held at the stand-in (the lost host's, the cut claim's) stays held until
            # the scenario lets it go, not until the client's own 30 s.
            "MOSTOVIK_CBR_TIMEOUT_SECONDS": str(HELD_SECONDS),
            "MOSTOVIK_DATA_DIR": str(self.root / "data"),
            "MOSTOVIK_STORAGE_DIR": str(self.root / "shared" / "storage"),
            "MOSTOVIK_LANDING_DIR": str(landing),
            "PYTHONPATH": str(REPO),
        }
        self.workers = [CeleryWorker(name, self.root / f"{name}.log")
                        for name in ("worker-a", "worker-b")]
        self.services = DagsterServices(
            self.root, self.home, self.environment,
            stopped_schedules=[schedule.name for schedule in definitions.defs.schedules or ()])
        try:
            for worker in self.workers:
                worker.start(self.environment, cwd=self.root)
            for worker in self.workers:
                worker.wait_ready()
            self.services.start()
        except BaseException:
            self.close()
            raise

    def instance(self) -> contextlib.AbstractContextManager[DagsterInstance]:
        return self.services.instance()

    def close(self) -> None:
        self.services.stop()
        for worker in self.workers:
            with contextlib.suppress(Exception):
                worker.stop()
        self.redis.stop()
        self.run_storage.stop()
        if self.disk is not None:
            unmount_small_disk(self.disk)
