"""The platform suite's deployment: the runbook's production layout on this machine
(:mod:`..support.production_layout`) over a chaos environment's warehouse and stand-in: the one
code server, the webserver and the daemon over deploy/workspace.yaml on an orchestrating host,
two Celery worker hosts, deploy/dagster.yaml on a PostgreSQL server of its own, a persistent
password-protected Redis, and the landing store and op outputs in buckets of an S3 API server
behind a fault front; the hosts share nothing else."""

from __future__ import annotations

import contextlib
from pathlib import Path

from dagster import DagsterInstance

from mostovik_pipelines import definitions
from mostovik_pipelines_tests.chaos.environment import ChaosEnvironment
from mostovik_pipelines_tests.chaos.platform_host import HELD_SECONDS
from mostovik_pipelines_tests.support.celery_workers import CeleryWorker
from mostovik_pipelines_tests.support.object_store_front import S3Front
from mostovik_pipelines_tests.support.postgres import ThrowawayPostgres
from mostovik_pipelines_tests.support.production_layout import ProductionLayout
from mostovik_pipelines_tests.support.redis import ThrowawayRedis


class PlatformEnvironment:
    """The production layout over a chaos environment's warehouse and stand-in."""

    def __init__(self, chaos: ChaosEnvironment) -> None:
        self.chaos = chaos
        self.root = chaos.root / "platform"
        self.root.mkdir()
        self.run_storage = ThrowawayPostgres().start()
        self.redis = ThrowawayRedis(persistent=True).start()
        self.store = S3Front().start()
        self.layout: ProductionLayout | None = None
        try:
            self.layout = ProductionLayout(
                self.root, self.run_storage, self.redis, self.store, {
                    "MOSTOVIK_DATABASE_URL": chaos.url,
                    "MOSTOVIK_CBR_URL": chaos.standin_server.cbr_url,
                    # A fetch held at the stand-in (the lost host's, the cut claim's) stays held
                    # until the scenario lets it go, not until the client's own 30 s.
                    "MOSTOVIK_CBR_TIMEOUT_SECONDS": str(HELD_SECONDS),
                },
                stopped_schedules=[schedule.name
                                   for schedule in definitions.defs.schedules or ()],
                database="dagster_platform")
        except BaseException:
            self.close()
            raise
        self.services = self.layout.services

    @property
    def environment(self) -> dict[str, str]:
        return self.layout.environment

    @property
    def workers(self) -> list[CeleryWorker]:
        return list(self.layout.workers.values())

    def instance(self) -> contextlib.AbstractContextManager[DagsterInstance]:
        return self.layout.instance()

    def revive(self, restart_seconds: float) -> list[str]:
        return self.layout.revive(restart_seconds)

    def log_paths(self) -> list[Path]:
        return self.layout.log_paths()

    def close(self) -> None:
        if self.layout is not None:
            self.layout.close()
        self.store.close()
        self.redis.stop()
        self.run_storage.stop()
