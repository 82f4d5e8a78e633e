"""A source's calendar run by the real daemon on a fake clock (:mod:`.fake_clock`): the daemon is
started just before each tick a test names, and the test reads what it did from run storage and
the warehouse, as an operator would.

Everything here is taken from the sources' declarations, so a new source is in it as it is
written: its schedule, its lookback's setting, its stand-in endpoint. The stand-ins run in the
test process, on the real clock: before each tick every endpoint is told the daemon's instant
(``set_clock``), and answers with what its source has published by then (the CBR: tomorrow's
rates from 15:30; the metals: the day's prices)."""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
import subprocess
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import date, datetime, timedelta
from pathlib import Path

from dagster import DagsterRun, RunsFilter
from dagster._core.scheduler.instigation import InstigatorTick, TickStatus

from mostovik_pipelines.core.tags import REQUESTED_BECAUSE_TAG, SOURCE_TAG, run_partitions
from mostovik_pipelines.framework.spec import SourceSpec
from mostovik_pipelines.sources import ALL_SOURCES
from mostovik_pipelines.standin import StandinClient, StandinServer
from mostovik_pipelines.standin.endpoint import discover_endpoints
from mostovik_pipelines_tests.support.fake_clock import (
    MOSCOW,
    FakeClockDaemon,
    code_location_environment,
    fake_clock_environment,
    fake_clock_instance,
    schedule_ticks,
    wait_for_runs_done,
    wait_for_tick,
)
from mostovik_pipelines_tests.support.waiting import PROCESS_START_MARGIN_SECONDS
from mostovik_pipelines_tests.support.webhook import WebhookReceiver

SCHEDULED: tuple[SourceSpec, ...] = tuple(spec for spec in ALL_SOURCES if spec.schedule)
"""Every source with a schedule (a time-partitioned one), as declared."""
ALL_SCHEDULES = (*(f"{spec.name}_schedule" for spec in SCHEDULED), "prune_storage_daily")
ENDPOINTS = discover_endpoints()
LEAD = timedelta(seconds=3)
"""How long before a tick the daemon is started. The schedules count their ticks from its start
(:func:`.fake_clock.hold_schedules_from`), so a slower start still evaluates the tick."""


@dataclass
class Calendar:
    """The daemon of one instance, the stand-in, and what each tick launched."""

    daemon: FakeClockDaemon
    standin: StandinClient
    webhook: WebhookReceiver
    """Where the code location's alerts are posted."""
    warehouse_url: str
    launched: list[str] = field(default_factory=list)
    """Every run the ticks asked for, in order."""

    def tick(self, schedule: str, due: datetime, *, started_at: datetime | None = None,
             catch_up_since: datetime | None = None,
             before_tick: Callable[[], None] | None = None,
             wait_for_runs: bool = True) -> list[DagsterRun]:
        """The daemon started (again) just before ``due``, the tick of ``schedule`` due then
        evaluated and every run it launched finished; those runs.

        With ``catch_up_since``, the daemon was down since then and is started at
        ``started_at``, after ``due``: Dagster catches up the ticks it missed (the last five),
        ``due`` among them; the runs of every tick since ``catch_up_since``. ``before_tick`` is
        called once the daemon is up, before the tick is due (start it early enough); without
        ``wait_for_runs`` the tick's runs are returned as they are, maybe still going."""
        start = started_at or due - LEAD
        self.start_at(start, catch_up=catch_up_since is not None)
        if before_tick is not None:
            before_tick()
        tick = wait_for_tick(self.daemon.instance, schedule, due,
                             diagnostics=self.daemon.log_tail)
        assert tick.status in (TickStatus.SUCCESS, TickStatus.SKIPPED), _describe(tick)
        if wait_for_runs:
            wait_for_runs_done(self.daemon.instance, diagnostics=self.daemon.log_tail)
        runs = self.runs_of_ticks(schedule, since=catch_up_since or due)
        self.launched += [run.run_id for run in runs if run.run_id not in self.launched]
        return runs

    def as_configured(self, spec: SourceSpec) -> SourceSpec:
        """``spec`` as the daemon's code location reads it: its lookback from the settings the
        calendar gave it (this process read its own)."""
        prefix = spec.catch_up.settings_prefix
        days = self.daemon.environment.get(f"{prefix}_LOOKBACK_DAYS") if prefix else None
        if days is None:
            return spec
        return dataclasses.replace(spec, catch_up=dataclasses.replace(
            spec.catch_up, lookback=timedelta(days=int(days))))

    def start_at(self, at: datetime, *, catch_up: bool = False) -> None:
        """The daemon (re)started with its clock reading ``at``, every stand-in told the time."""
        self.tell_the_time(at)
        self.daemon.restart(at, catch_up=catch_up)

    def mostovik(self, *args: str, at: datetime | None = None) -> subprocess.CompletedProcess:
        """``mostovik ARGS`` as an operator types it on the deployment: the daemon's instance and
        settings, its clock reading ``at`` (by default, what the daemon's clock reads now)."""
        at = at or self.daemon.now()
        environment = {**os.environ, **self.daemon.environment}
        environment.update(fake_clock_environment(at, environment))
        return subprocess.run([str(Path(sys.executable).parent / "mostovik"), *args],
                              env=environment, capture_output=True, text=True,
                              timeout=PROCESS_START_MARGIN_SECONDS * 2)

    def tell_the_time(self, at: datetime) -> None:
        """Every stand-in endpoint answers as its source has published by ``at``."""
        for endpoint in ENDPOINTS.values():
            self.standin.control(endpoint.route, "clock", {"at": at.isoformat()})

    def runs_of_ticks(self, schedule: str, since: datetime) -> list[DagsterRun]:
        """The runs of the ticks of ``schedule`` due at or after ``since``, oldest first."""
        ticks = sorted((t for t in schedule_ticks(self.daemon.instance, schedule)
                        if t.timestamp >= since.timestamp()), key=lambda t: t.timestamp)
        run_ids = [run_id for t in ticks for run_id in t.run_ids]
        return [self.daemon.instance.get_run_by_id(run_id) for run_id in run_ids]


@contextlib.contextmanager
def calendars(work_dir: Path, warehouse_url: str, standin_server: StandinServer,
              standin: StandinClient,
              alert_interval_seconds: int = 5) -> Iterator[Callable[..., Calendar]]:
    """Makes a :class:`Calendar`: a fresh instance, the warehouse, and the daemon that runs only
    the named schedules, with each source's lookback as given (``lookback={"erp_work_orders":
    1}``: days, set through the source's own setting), its alerts posted to a webhook of the
    test's; ``environment`` adds settings of the test's."""
    started: list[FakeClockDaemon] = []
    with WebhookReceiver() as webhook:

        def start(*schedules: str, lookback: Mapping[str, int] | None = None,
                  environment: Mapping[str, str] | None = None) -> Calendar:
            environment = {
                **code_location_environment(work_dir, warehouse_url, standin_server),
                **lookback_environment(lookback or {}),
                "MOSTOVIK_ALERT_WEBHOOK_URL": webhook.url,
                "MOSTOVIK_ALERT_SENSOR_INTERVAL_SECONDS": str(alert_interval_seconds),
                "MOSTOVIK_DEADLINE_SENSOR_INTERVAL_SECONDS": str(alert_interval_seconds),
                # No inbox in a calendar unless a test drops files: its sensor looks once a
                # minute, not every 15 s.
                "MOSTOVIK_INBOX_SENSOR_INTERVAL_SECONDS": "60",
                **(environment or {}),
            }
            daemon = FakeClockDaemon(work_dir, fake_clock_instance(work_dir), environment,
                                     stopped_schedules=[s for s in ALL_SCHEDULES
                                                        if s not in schedules])
            started.append(daemon)
            return Calendar(daemon, standin, webhook=webhook, warehouse_url=warehouse_url)

        try:
            yield start
        finally:
            for daemon in started:
                daemon.__exit__(None, None, None)


def lookback_environment(lookback_days: Mapping[str, int]) -> dict[str, str]:
    """The settings that give each named source its lookback (days)."""
    specs = {spec.name: spec for spec in ALL_SOURCES}
    found = {}
    for name, days in lookback_days.items():
        prefix = specs[name].catch_up.settings_prefix
        if prefix is None:
            raise ValueError(f"source {name} declares no setting for its lookback")
        found[f"{prefix}_LOOKBACK_DAYS"] = str(days)
    return found


def moscow(day: str, hour: int, minute: int = 0) -> datetime:
    """An instant of ``day`` (ISO) in Moscow time, the schedules' time zone."""
    return datetime.fromisoformat(day).replace(hour=hour, minute=minute, tzinfo=MOSCOW)


def day_after(day: str, days: int = 1) -> str:
    return (date.fromisoformat(day) + timedelta(days=days)).isoformat()


def requested_because(runs: Sequence[DagsterRun]) -> list[str]:
    """Why each run was asked for (its ``mostovik/requested_because`` tag)."""
    return [run.tags[REQUESTED_BECAUSE_TAG] for run in runs]


def runs_covering(calendar: Calendar, spec: SourceSpec, partition: str) -> list[DagsterRun]:
    return [run for run in calendar.daemon.instance.get_runs(
        RunsFilter(tags={SOURCE_TAG: spec.name}))
        if partition in run_partitions(run.tags, spec.partitions_def)]


def runs_at_once(calendar: Calendar, spec: SourceSpec) -> list[tuple[str, str, str]]:
    """Every two runs of ``spec`` that covered one partition at the same time (started before
    the other ended): (partition, run, run). What the schedules ask for never overlaps."""
    instance = calendar.daemon.instance
    records = instance.get_run_records(RunsFilter(tags={SOURCE_TAG: spec.name}))
    spans = [(record.dagster_run, record.start_time or 0.0, record.end_time or float("inf"))
             for record in records]
    overlapping = []
    for (run_a, start_a, end_a), (run_b, start_b, end_b) in itertools.combinations(spans, 2):
        shared = (run_partitions(run_a.tags, spec.partitions_def)
                  & run_partitions(run_b.tags, spec.partitions_def))
        if shared and start_a < end_b and start_b < end_a:
            overlapping += [(key, run_a.run_id, run_b.run_id) for key in sorted(shared)]
    return overlapping


def _describe(tick: InstigatorTick) -> str:
    return f"{tick.status.value} {tick.error.message if tick.error else ''}"
