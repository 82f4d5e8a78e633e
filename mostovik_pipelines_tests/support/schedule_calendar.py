"""A source's calendar run by the real daemon on a fake clock (:mod:`.fake_clock`): the daemon is
started just before each tick a test names, and the test reads what it did from run storage and
the warehouse, as an operator would.

The stand-ins run in the test process, on the real clock: the CBR stand-ins are told, before each
tick, what the CBR has published by the daemon's instant (tomorrow's rates from 15:30, today's
metal prices)."""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import date, datetime, time, timedelta
from pathlib import Path

from dagster import DagsterRun, RunsFilter
from dagster._core.scheduler.instigation import InstigatorTick, TickStatus

from mostovik_pipelines.framework.runs.tags import REQUESTED_BECAUSE_TAG, SOURCE_TAG, run_partitions
from mostovik_pipelines.framework.spec import SourceSpec
from mostovik_pipelines.standin import StandinClient, StandinServer
from mostovik_pipelines_tests.support.fake_clock import (
    MOSCOW,
    FakeClockDaemon,
    code_location_environment,
    fake_clock_instance,
    schedule_ticks,
    wait_for_runs_done,
    wait_for_tick,
)
from mostovik_pipelines_tests.support.webhook import WebhookReceiver

ALL_SCHEDULES = ("cbr_daily_rates_schedule", "cbr_metal_prices_schedule",
                 "erp_work_orders_schedule", "prune_storage_daily")
LEAD = timedelta(seconds=3)
"""How long before a tick the daemon is started. The schedules count their ticks from its start
(:func:`.fake_clock.hold_schedules_from`), so a slower start still evaluates the tick."""
CBR_PUBLISHES_AT = time(15, 30)


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
             catch_up_since: datetime | None = None) -> list[DagsterRun]:
        """The daemon started (again) just before ``due``, the tick of ``schedule`` due then
        evaluated and every run it launched finished; those runs.

        With ``catch_up_since``, the daemon was down since then and is started at
        ``started_at``, after ``due``: Dagster catches up the ticks it missed (the last five),
        ``due`` among them; the runs of every tick since ``catch_up_since``."""
        start = started_at or due - LEAD
        self.standin.publish_cbr_until(cbr_published_until(start).isoformat())
        self.standin.control("cbr_metals", "published_until", {"date": start.date().isoformat()})
        self.daemon.restart(start, catch_up=catch_up_since is not None)
        tick = wait_for_tick(self.daemon.instance, schedule, due,
                             diagnostics=self.daemon.log_tail)
        assert tick.status in (TickStatus.SUCCESS, TickStatus.SKIPPED), _describe(tick)
        wait_for_runs_done(self.daemon.instance, diagnostics=self.daemon.log_tail)
        runs = self.runs_of_ticks(schedule, since=catch_up_since or due)
        self.launched += [run.run_id for run in runs if run.run_id not in self.launched]
        return runs

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
    the named schedules, with each source's lookback as given (``erp=1``: days), its alerts
    posted to a webhook of the test's."""
    started: list[FakeClockDaemon] = []
    with WebhookReceiver() as webhook:

        def start(*schedules: str, **lookback_days: int) -> Calendar:
            environment = {
                **code_location_environment(work_dir, warehouse_url, standin_server),
                **{f"MOSTOVIK_{name.upper()}_LOOKBACK_DAYS": str(days)
                   for name, days in lookback_days.items()},
                "MOSTOVIK_ALERT_WEBHOOK_URL": webhook.url,
                "MOSTOVIK_ALERT_SENSOR_INTERVAL_SECONDS": str(alert_interval_seconds),
                # No inbox in a calendar: its sensor looks once a minute, not every 15 s.
                "MOSTOVIK_INBOX_SENSOR_INTERVAL_SECONDS": "60",
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


def moscow(day: str, hour: int, minute: int = 0) -> datetime:
    """An instant of ``day`` (ISO) in Moscow time, the schedules' time zone."""
    return datetime.fromisoformat(day).replace(hour=hour, minute=minute, tzinfo=MOSCOW)


def day_after(day: str, days: int = 1) -> str:
    return (date.fromisoformat(day) + timedelta(days=days)).isoformat()


def requested_because(runs: Sequence[DagsterRun]) -> list[str]:
    """Why each run was asked for (its ``mostovik/requested_because`` tag)."""
    return [run.tags[REQUESTED_BECAUSE_TAG] for run in runs]


def cbr_published_until(at: datetime) -> datetime.date:
    """The last date whose rates the CBR has published at ``at`` (Moscow time)."""
    return at.date() + timedelta(days=1) if at.time() >= CBR_PUBLISHES_AT else at.date()


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
