"""The calendar suite: simulated days of every scheduled source (the CBR rates, the CBR metal
prices, the ERP sync) run by the real daemon on a fake clock, with what goes wrong in the normal
course of operation drawn from a seed:

* the CBR, the metals service or the ERP down for hours to a day (one to three of its ticks);
* a CBR date whose answer is malformed for good (a permanent failure);
* the daemon down for a few ticks, across midnight or not, then back, catching up as Dagster does;
* work orders changed at any time of day, late evening included (after the day's last sync).

Every tick of every day runs (the daemon started just before it), then a fault-free settling day.
At the end, as an operator would check: every CBR date and metals day of the span is loaded and
exact (the stand-ins' own documents parsed), every ERP window equals the source's oracle, the
permanent failure is loaded by no run after its first, waits for an operator and was alerted,
no partition had two runs at once, no run is left in progress, and the runs launched are counted
(at most two a tick).
The file source is not in it: its sensor's retries are tested on their own
(``framework/assets/test_inbox_sensor.py``).

``python -m mostovik_pipelines_tests.chaos.calendar_scenarios --seed N --days N``; ``make chaos``
runs it with its seed.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import date, datetime
from pathlib import Path

from dagster import DagsterRunStatus, RunsFilter

from mostovik_pipelines.framework.automation.partition_states import Outcome, partition_states
from mostovik_pipelines.framework.spec import TransformRequest
from mostovik_pipelines.sources import cbr_daily_rates, cbr_metal_prices, erp_work_orders
from mostovik_pipelines.sources.cbr_daily_rates.standin import CbrStandin
from mostovik_pipelines.sources.cbr_metal_prices.standin import CbrMetalsStandin
from mostovik_pipelines.standin import StandinClient, StandinServer
from mostovik_pipelines_tests.chaos.harness import create_database, drop_database
from mostovik_pipelines_tests.chaos.tally import Tally
from mostovik_pipelines_tests.support.postgres import ThrowawayPostgres
from mostovik_pipelines_tests.support.schedule_calendar import (
    Calendar,
    calendars,
    day_after,
    moscow,
    runs_at_once,
    runs_covering,
)
from mostovik_pipelines_tests.support.warehouse import table_rows

CBR, METALS, ERP = cbr_daily_rates.SOURCE, cbr_metal_prices.SOURCE, erp_work_orders.SOURCE
SCHEDULES = {CBR.name: "cbr_daily_rates_schedule", METALS.name: "cbr_metal_prices_schedule",
             ERP.name: "erp_work_orders_schedule"}
ROUTES = {CBR.name: "cbr", METALS.name: "cbr_metals", ERP.name: "erp"}
FIRST_DAY = "2026-11-02"
"""A Monday, a month before the real today: the stand-ins' documents of the span are final."""


@dataclass(frozen=True)
class Step:
    """One tick of one source's schedule."""

    source: str
    due: datetime


@dataclass
class CalendarTotals:
    steps: int = 0
    runs: dict[str, int] = field(default_factory=dict)
    events: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    checked: dict[str, int] = field(default_factory=dict)


def calendar_steps(days: int, rng: random.Random,
                   sources: tuple[str, ...] = tuple(SCHEDULES)) -> list[Step]:
    """Every tick of the span of ``sources``, in time order: the CBR's at 12, 16 and 20, the
    metals' at 18, and of the ERP's hourly ticks those at 00:05, one drawn in the day and 23:05."""
    steps = []
    for offset in range(days):
        day = day_after(FIRST_DAY, offset)
        steps += [Step(CBR.name, moscow(day, hour)) for hour in (12, 16, 20)]
        steps.append(Step(METALS.name, moscow(day, 18)))
        steps += [Step(ERP.name, moscow(day, hour, 5)) for hour in (0, rng.randint(8, 21), 23)]
    return sorted((step for step in steps if step.source in sources), key=lambda s: s.due)


def settling_steps(days: int, sources: tuple[str, ...] = tuple(SCHEDULES)) -> list[Step]:
    """The day after the span, with nothing going wrong: what is not final yet becomes final
    (the ERP's closed window at 00:05, the CBR's dates at 12:00, the metals' day at 18:00).

    The ERP's 06:05 tick too: a window that failed at 23:05 is held by its backoff at 00:05
    (an hour after a second failure in a row, four after a fourth: the most a span with at most
    three ticks down in a row can set), and the hourly schedule takes it up once that has
    passed; 06:05 is the first of the ticks this suite samples that is past every backoff."""
    day = day_after(FIRST_DAY, days)
    return [step for step in (
        Step(ERP.name, moscow(day, 0, 5)), Step(ERP.name, moscow(day, 6, 5)),
        Step(CBR.name, moscow(day, 12)), Step(METALS.name, moscow(day, 18)))
        if step.source in sources]


class CalendarSuite:
    def __init__(self, calendar: Calendar, seed: int, days: int, log,
                 max_outage_ticks: int = 3, sources: tuple[str, ...] = tuple(SCHEDULES),
                 down_sources: tuple[str, ...] = tuple(SCHEDULES)) -> None:
        self.calendar = calendar
        self.standin = calendar.standin
        self.rng = random.Random(seed)
        self.days = days
        self.log = log
        self.totals = CalendarTotals()
        self.max_outage_ticks = max_outage_ticks
        self.sources = sources
        self.steps = calendar_steps(days, self.rng, sources)
        self.outages = {source: self._outage(source) for source in down_sources}
        self.permanent = day_after(FIRST_DAY, self.rng.randint(1, days))
        """A CBR date whose answer is malformed for good."""
        first_down = self.rng.randint(2, len(self.steps) - 4)
        self.daemon_down = set(range(first_down, first_down + self.rng.randint(2, 4)))
        self.totals.events += [
            *(f"{source} down for its ticks {sorted(ticks)}" for source, ticks in
              self.outages.items() if ticks),
            f"cbr_daily_rates {self.permanent}: malformed for good",
            f"daemon down for steps {sorted(self.daemon_down)} "
            f"({self.steps[min(self.daemon_down)].due:%d %H:%M} to "
            f"{self.steps[max(self.daemon_down)].due:%d %H:%M})"]

    def _outage(self, source: str) -> set[int]:
        """Which of the source's ticks (their order among its own) find it down."""
        ticks = sum(1 for step in calendar_steps(self.days, random.Random(0), (source,)))
        length = self.rng.randint(1, self.max_outage_ticks)
        first = self.rng.randrange(0, max(1, ticks - length))
        return set(range(first, first + length))

    def run(self) -> CalendarTotals:
        for line in self.totals.events:
            self.log(f"calendar: {line}")
        seen: dict[str, int] = {}
        catch_up_since = None
        for index, step in enumerate(self.steps):
            number = seen.get(step.source, 0)
            seen[step.source] = number + 1
            self._change_work_orders(step)
            if index in self.daemon_down:
                if catch_up_since is None:
                    self.calendar.daemon.stop()
                    catch_up_since = step.due
                continue
            self._faults(down=[s for s, ticks in self.outages.items() if number in ticks
                               and s == step.source])
            self._tick(step, catch_up_since)
            catch_up_since = None
        self._faults(down=[])
        for step in settling_steps(self.days, self.sources):
            self._tick(step, None)
        self.calendar.daemon.stop()
        self._check()
        return self.totals

    def _tick(self, step: Step, catch_up_since: datetime | None) -> None:
        started = time.monotonic()
        runs = self.calendar.tick(SCHEDULES[step.source], step.due,
                                  catch_up_since=catch_up_since)
        self.totals.steps += 1
        self.log(f"calendar: {step.due:%a %d %H:%M} {step.source}"
                 + (" (daemon back)" if catch_up_since else "")
                 + f": {[run.tags.get('mostovik/requested_because') for run in runs]} "
                 f"{[run.status.value for run in runs]} ({time.monotonic() - started:.0f} s)")

    def _faults(self, down: list[str]) -> None:
        self.standin.clear_faults()
        asked = datetime.fromisoformat(self.permanent)
        self.standin.fault("malformed", route="cbr", times=100_000,
                           match=f"date_req={asked:%d/%m/%Y}")
        for source in down:
            self.standin.fault("status", route=ROUTES[source], status=503, times=100_000)

    def _change_work_orders(self, step: Step) -> None:
        """Before an ERP tick: one or two work orders changed since the previous one, at a time
        drawn between the two (after the day's 23:05 sync, for the 00:05 tick)."""
        if step.source != ERP.name:
            return
        previous = max((s.due for s in self.steps if s.source == ERP.name and s.due < step.due),
                       default=None)
        if previous is None:
            return
        for _ in range(self.rng.randint(1, 2)):
            at = previous + (step.due - previous) * self.rng.uniform(0.1, 0.95)
            day = at.date().isoformat()
            candidates = [item for item in self.standin.erp_window_state(
                moscow(day_after(day, -1), 0), at) if not item["deleted"]]
            if candidates:
                item = self.rng.choice(candidates)
                self.standin.update_erp_work_order(item["id"], at.isoformat(),
                                                   amount=f"{self.rng.randint(1, 10**6)}.00")

    def _check(self) -> None:
        instance = self.calendar.daemon.instance
        url = self.calendar.warehouse_url
        span = [day_after(FIRST_DAY, offset) for offset in range(self.days + 1)]
        for source in (spec for spec in (CBR, METALS, ERP) if spec.name in self.sources):
            self.totals.runs[source.name] = len(instance.get_runs(RunsFilter(
                tags={"mostovik/source": source.name})))
            for key, run_a, run_b in runs_at_once(self.calendar, source):
                self._fail(f"{source.name} {key}: runs {run_a} and {run_b} at once")
        if sum(self.totals.runs.values()) > 2 * self.totals.steps:
            self._fail(f"{sum(self.totals.runs.values())} runs for {self.totals.steps} ticks: "
                       "more than two a tick")
        stuck = instance.get_runs(RunsFilter(statuses=[
            DagsterRunStatus.QUEUED, DagsterRunStatus.STARTING, DagsterRunStatus.STARTED]))
        for run in stuck:
            self._fail(f"run {run.run_id} left {run.status.value}")
        self._check_rates(url, span)
        if METALS.name in self.sources:
            self._check_metals(url, span)
        if ERP.name in self.sources:
            self._check_windows(url, span)
        states = partition_states(instance, CBR, [self.permanent], moscow(FIRST_DAY, 0))
        if states[self.permanent].latest_outcome is not Outcome.FAILED_PERMANENTLY:
            self._fail(f"{self.permanent}: {states[self.permanent]}, not waiting")
        if len(runs_covering(self.calendar, CBR, self.permanent)) != 1:
            self._fail(f"{self.permanent}: asked for again after a permanent failure")
        if not [alert for alert in self.calendar.webhook.alerts
                if f"waiting for an operator: {self.permanent}" in alert["message"]]:
            self._fail(f"{self.permanent}: no alert names it as waiting for an operator")

    def _check_rates(self, url: str, span: list[str]) -> None:
        stored: dict[str, set] = {}
        for row in table_rows(url, "cbr_daily_rates"):
            stored.setdefault(row["partition_date"].isoformat(), set()).add(
                (row["char_code"], row["rate_date"], row["value"]))
        for day in span:
            expected = set() if day == self.permanent else _published_rates(day)
            if stored.get(day, set()) != expected:
                self._fail(f"cbr_daily_rates {day}: {len(stored.get(day, ()))} rows stored, "
                           f"{len(expected)} expected, or they differ")
        self.totals.checked["cbr dates"] = len(span)

    def _check_metals(self, url: str, span: list[str]) -> None:
        standin = CbrMetalsStandin()
        standin.control("POST", "published_until", {}, {"date": span[-1]})
        stored = {(row["price_date"].isoformat(), row["metal_code"], row["buy"])
                  for row in table_rows(url, "cbr_metal_prices")}
        for day in span:
            expected = {(day, code, price)
                        for code, price in standin.records(date.fromisoformat(day))}
            if {row for row in stored if row[0] == day} != expected:
                self._fail(f"cbr_metal_prices {day}: stored rows differ from the source's")
        self.totals.checked["metals days"] = len(span)

    def _check_windows(self, url: str, span: list[str]) -> None:
        synced: dict[str, set] = {}
        for row in table_rows(url, "erp_work_orders"):
            synced.setdefault(row["window_date"].isoformat(), set()).add(
                (row["id"], row["version"]))
        for day in span[:-1]:
            oracle = {(item["id"], item["version"]) for item in self.standin.erp_window_state(
                moscow(day, 0), moscow(day_after(day), 0))}
            if synced.get(day, set()) != oracle:
                self._fail(f"erp_work_orders {day}: {len(synced.get(day, ()))} stored, "
                           f"{len(oracle)} in the source, "
                           f"{len(oracle - synced.get(day, set()))} missing or stale")
        self.totals.checked["erp windows"] = len(span) - 1

    def _fail(self, message: str) -> None:
        self.totals.failures.append(message)
        self.log(f"calendar: FAILED {message}")


def _published_rates(day: str) -> set:
    """What the CBR answers for ``day`` once it has come: (code, rate date, value)."""
    frame = cbr_daily_rates.parse_daily_rates(TransformRequest(
        CBR.name, day, CbrStandin().document(date.fromisoformat(day)), "application/xml",
        moscow(day, 12))).as_frame()
    return {(row.char_code, row.rate_date, row.value) for row in frame.itertuples()}


def calendar_faults(suite: CalendarSuite) -> set[str]:
    """What the simulated span met: its sources' outages, the permanent failure, the daemon
    down."""
    return {*(f"down: {source}" for source, ticks in suite.outages.items() if ticks),
            "permanent failure", "daemon down"}


def run_calendar_chaos(postgres: ThrowawayPostgres, standin_server: StandinServer, seed: int,
                       days: int, *, lookback_days: int = 7, max_outage_ticks: int = 3,
                       sources: tuple[str, ...] = tuple(SCHEDULES),
                       down_sources: tuple[str, ...] | None = None,
                       template: str | None = None, log=print,
                       tally: Tally | None = None) -> CalendarTotals:
    """Run the calendar of ``sources`` (the CBR's always: it carries the permanent failure) in
    a warehouse and instance of their own, ``down_sources`` (default: all of them) going down,
    and print the summary. A shorter ``lookback_days`` makes each source's first tick (and a run
    while it is down) smaller, and caps a source's outage at that many of its ticks: the
    catch-up looks back no further, so a longer outage would leave days behind by design, not
    by a defect (seed 1063406734 with a 1-day lookback: the metals down two ticks, one day
    "unsettled")."""
    started = time.monotonic()
    if max_outage_ticks > lookback_days:
        log(f"calendar: outages capped at {lookback_days} tick(s), the {lookback_days}-day "
            "lookback's reach")
    outage_ticks = min(max_outage_ticks, lookback_days)
    name = f"wh_calendar_{seed % 100_000}_{int(time.time()) % 100_000}"
    url = create_database(postgres, name, template)
    standin = StandinClient(standin_server.url)
    standin.reset_erp()
    try:
        with tempfile.TemporaryDirectory(prefix="calendar-") as work_dir, calendars(
                Path(work_dir), url, standin_server, standin) as start:
            calendar = start(*(SCHEDULES[name] for name in sources), cbr=lookback_days,
                             cbr_metals=lookback_days, erp=lookback_days)
            suite = CalendarSuite(calendar, seed, days, log, outage_ticks, sources,
                                  down_sources or sources)
            totals = suite.run()
    finally:
        standin.clear_faults()
        standin.reset_erp()
        drop_database(postgres, name)
    if tally is not None:
        stuck = sum(" left " in failure and failure.startswith("run ")
                    for failure in totals.failures)
        tally.record("calendar", calendar_faults(suite),
                     unsettled=len(totals.failures) - stuck, stuck=stuck)
    log(f"calendar: seed {seed}, {days} day(s) + 1 settling, {totals.steps} ticks, runs "
        f"{totals.runs}, checked {totals.checked}, {len(totals.failures)} failure(s), "
        f"{time.monotonic() - started:.0f} s; replay: python -m "
        f"mostovik_pipelines_tests.chaos.calendar_scenarios --seed {seed} --days {days} "
        f"--lookback-days {lookback_days} --max-outage-ticks {max_outage_ticks}")
    return totals


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mostovik_pipelines_tests.chaos.calendar_scenarios")
    parser.add_argument("--seed", type=int, default=None, help="default: a random seed")
    parser.add_argument("--days", type=int, default=7)
    parser.add_argument("--lookback-days", type=int, default=7)
    parser.add_argument("--max-outage-ticks", type=int, default=3)
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 31)
    postgres = ThrowawayPostgres().start()
    server = StandinServer().start()
    try:
        totals = run_calendar_chaos(postgres, server, seed, args.days,
                                    lookback_days=args.lookback_days,
                                    max_outage_ticks=args.max_outage_ticks)
    finally:
        server.stop()
        postgres.stop()
    return 1 if totals.failures else 0


if __name__ == "__main__":
    sys.exit(main())
