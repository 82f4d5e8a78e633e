"""The calendar suite: simulated days of every scheduled source (every source with a schedule,
as declared: the CBR rates, the metals, the ERP sync, and any source added since) and the
delivery inbox, run by the real daemon on a fake clock over a span that holds the public holiday
of 4 November (the stand-ins taught it) and a weekend, with what goes wrong in the normal course
of operation drawn from a seed:

* each source down for hours to a day (one to three of its ticks);
* a CBR date whose answer is malformed for good (a permanent failure);
* the daemon down for a few ticks, across midnight or not, then back, catching up as Dagster does;
* work orders changed at any time of day, late evening included (after the day's last sync);
* delivery reports dropped into the inbox during the span, one of them not a report;
* ticks that do not wait for runs: an operator's re-run of a final period in flight (held at its
  source) while its schedule's tick asks for the periods around it, looked at before it ends.

Every tick of every day runs (the daemon started just before it), then a fault-free settling day.
With ``truth`` (``make chaos``), after every tick what the operator is told (the checks and
freshness over GraphQL, the alerts, ``jobs list --waiting``, the metrics through PromQL) is
compared with the truth of the warehouse against the stand-ins (``support/signals_truth.py``).
At the end, :mod:`.calendar_judge` checks every period, the permanent failure, the inbox and the
runs.

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
from datetime import datetime, timedelta
from pathlib import Path

from mostovik_pipelines.core.tags import run_partitions
from mostovik_pipelines.framework.automation.partition_states import partition_states
from mostovik_pipelines.standin import StandinClient, StandinServer
from mostovik_pipelines_tests.chaos.calendar_judge import CalendarJudge
from mostovik_pipelines_tests.chaos.calendar_steps import (
    CBR,
    ERP,
    FIRST_DAY,
    HOLIDAYS,
    INTERVAL_SECONDS,
    RERUN_SHARE,
    ROUTES,
    SCHEDULES,
    SPECS,
    Step,
    calendar_steps,
    settling_steps,
)
from mostovik_pipelines_tests.chaos.harness import create_database, drop_database
from mostovik_pipelines_tests.chaos.tally import Tally
from mostovik_pipelines_tests.support.delivery_reports import csv_report, deliveries, report_table
from mostovik_pipelines_tests.support.fake_clock import wait_for_runs_done
from mostovik_pipelines_tests.support.inbox import drop
from mostovik_pipelines_tests.support.postgres import ThrowawayPostgres
from mostovik_pipelines_tests.support.schedule_calendar import (
    ENDPOINTS,
    Calendar,
    calendars,
    day_after,
    moscow,
)
from mostovik_pipelines_tests.support.signals_truth import SignalsObserver
from mostovik_pipelines_tests.support.waiting import PROCESS_START_MARGIN_SECONDS, wait_until


@dataclass
class CalendarTotals:
    steps: int = 0
    runs: dict[str, int] = field(default_factory=dict)
    events: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    checked: dict[str, int] = field(default_factory=dict)
    looks: int = 0
    disagreements: int = 0
    """What the operator was told that the truth contradicted, summed over the looks."""


class CalendarSuite(CalendarJudge):
    def __init__(self, calendar: Calendar, standin_server: StandinServer, seed: int, days: int,
                 log, max_outage_ticks: int = 3, sources: tuple[str, ...] = tuple(SCHEDULES),
                 down_sources: tuple[str, ...] = tuple(SCHEDULES),
                 observer: SignalsObserver | None = None, inbox: bool = True,
                 reruns: bool = True) -> None:
        self.calendar = calendar
        self.standin = calendar.standin
        self.standin_server = standin_server
        self.rng = random.Random(seed)
        self.days = days
        self.log = log
        self.totals = CalendarTotals()
        self.max_outage_ticks = max_outage_ticks
        self.sources = sources
        self.observer = observer
        self.steps = calendar_steps(days, self.rng, sources)
        self.outages = {source: self._outage(source) for source in down_sources}
        self.permanent = day_after(FIRST_DAY, self.rng.randint(1, days)) if (
            CBR in sources) else None
        """A CBR date whose answer is malformed for good."""
        first_down = self.rng.randint(2, len(self.steps) - 4)
        self.daemon_down = set(range(first_down, first_down + self.rng.randint(2, 4)))
        self.reruns = {index for index in range(len(self.steps))
                       if reruns and index not in self.daemon_down
                       and self.rng.random() < RERUN_SHARE}
        self.drops = self._drops() if inbox else {}
        self.rerun_runs: list[str] = []
        self.totals.events += [
            *(f"{source} down for its ticks {sorted(ticks)}" for source, ticks in
              self.outages.items() if ticks),
            *([f"cbr_daily_rates {self.permanent}: malformed for good"] if self.permanent
              else []),
            f"daemon down for steps {sorted(self.daemon_down)} "
            f"({self.steps[min(self.daemon_down)].due:%d %H:%M} to "
            f"{self.steps[max(self.daemon_down)].due:%d %H:%M})",
            f"holidays {', '.join(HOLIDAYS)}",
            f"operators' re-runs in flight during steps {sorted(self.reruns)}",
            *(f"inbox: {name} at step {index}" for index, (name, _, _) in self.drops.items())]

    def _outage(self, source: str) -> set[int]:
        """Which of the source's ticks (their order among its own) find it down."""
        ticks = sum(1 for step in calendar_steps(self.days, random.Random(0), (source,)))
        length = self.rng.randint(1, self.max_outage_ticks)
        first = self.rng.randrange(0, max(1, ticks - length))
        return set(range(first, first + length))

    def _drops(self) -> dict[int, tuple[str, bytes, list | None]]:
        """Reports dropped into the inbox before some steps: (file name, bytes, their lines,
        None for one that is not a report)."""
        steps = sorted(self.rng.sample(range(len(self.steps)), k=min(3, len(self.steps))))
        drops = {}
        for number, index in enumerate(steps):
            if number == len(steps) - 1:
                drops[index] = (f"site-{number}_scan.csv", b"%PDF-1.4\n% not a report\n", None)
                continue
            lines = deliveries(self.rng.randint(3, 8), seed=self.rng.randrange(10**6))
            drops[index] = (f"site-{number}_report.csv", csv_report(report_table(lines)), lines)
        return drops

    def run(self) -> CalendarTotals:
        for line in self.totals.events:
            self.log(f"calendar: {line}")
        for route in ROUTES.values():
            self.standin.control(route, "holidays", {"dates": list(HOLIDAYS)})
        seen: dict[str, int] = {}
        catch_up_since = None
        for index, step in enumerate(self.steps):
            number = seen.get(step.source, 0)
            seen[step.source] = number + 1
            self._change_work_orders(step)
            if index in self.drops:
                name, content, _ = self.drops[index]
                drop(Path(self.calendar.daemon.environment["MOSTOVIK_INBOX_DIR"]), name, content)
            if index in self.daemon_down:
                if catch_up_since is None:
                    self.calendar.daemon.stop()
                    catch_up_since = step.due
                continue
            self._faults(down=[s for s, ticks in self.outages.items() if number in ticks
                               and s == step.source])
            self._tick(step, catch_up_since, rerun=index in self.reruns)
            catch_up_since = None
        self._faults(down=[])
        for step in settling_steps(self.days, self.sources):
            self._tick(step, None, rerun=False)
        self.calendar.daemon.stop()
        self._check()
        return self.totals

    def _tick(self, step: Step, catch_up_since: datetime | None, rerun: bool) -> None:
        started = time.monotonic()
        target = self._final_period(step) if rerun and catch_up_since is None else None
        if target is None:
            runs = self.calendar.tick(SCHEDULES[step.source], step.due,
                                      catch_up_since=catch_up_since)
            self._look(step)
        else:
            route = ROUTES[step.source]
            # Held until released or until the fetch's timeout: in flight at the tick.
            self.standin.fault("hang", route=route, times=1, seconds=600)

            def operators_rerun() -> None:
                asked = self.calendar.mostovik(
                    "jobs", "rerun", "--source", step.source, "--period", target,
                    "--reason", "chaos: an operator's re-run during a tick")
                if asked.returncode != 0:
                    self._fail(f"{step.source} {target}: the re-run was refused: "
                               f"{asked.stderr[-500:]}")
                    return
                self.rerun_runs.append(asked.stdout.split()[0])
                wait_until(lambda: self.standin.hanging(route), PROCESS_START_MARGIN_SECONDS,
                           "the operator's re-run fetching", self.calendar.daemon.log_tail)

            runs = self.calendar.tick(SCHEDULES[step.source], step.due,
                                      started_at=step.due - timedelta(seconds=15),
                                      before_tick=operators_rerun, wait_for_runs=False)
            spec = SPECS[step.source]
            if any(target in run_partitions(run.tags, spec.partitions_def) for run in runs):
                self._fail(f"{step.source} {target}: asked for by the tick while an operator's "
                           "re-run of it was in flight")
            self._look(step, "runs going")
            self.standin.release_hangs()
            wait_for_runs_done(self.calendar.daemon.instance,
                               diagnostics=self.calendar.daemon.log_tail)
            self._look(step, "runs done")
        self.totals.steps += 1
        self.log(f"calendar: {step.due:%a %d %H:%M} {step.source}"
                 + (" (daemon back)" if catch_up_since else "")
                 + (f" (an operator's re-run of {target} in flight)" if target else "")
                 + f": {[run.tags.get('mostovik/requested_because') for run in runs]} "
                 f"{[run.status.value for run in runs]} ({time.monotonic() - started:.0f} s)")

    def _final_period(self, step: Step) -> str | None:
        """A period of the source in its lookback that is final now: an operator re-runs it."""
        spec = self.calendar.as_configured(SPECS[step.source])
        keys = spec.partitions_def.get_partition_keys(current_time=step.due)
        lookback = [key for key in keys[-8:] if spec.partitions_def.time_window_for_partition_key(
            key).end > step.due - spec.catch_up.lookback]
        instance = self.calendar.daemon.instance
        states = partition_states(instance, spec, lookback, step.due - timedelta(days=14))
        final = [key for key in lookback[1:-1] if states[key].final and key != self.permanent]
        return self.rng.choice(final) if final else None

    def _look(self, step: Step, moment: str = "") -> None:
        if self.observer is None:
            return
        look = self.observer.look(f"{step.due:%a %d %H:%M} {step.source} {moment}".strip())
        self.totals.looks += 1
        self.totals.disagreements += len(look.disagreements)
        for disagreement in look.disagreements:
            self._fail(f"told: {disagreement}")

    def _faults(self, down: list[str]) -> None:
        self.standin.clear_faults()
        if self.permanent:
            asked = datetime.fromisoformat(self.permanent)
            self.standin.fault("malformed", route="cbr", times=100_000,
                               match=f"date_req={asked:%d/%m/%Y}")
        for source in down:
            if source in ROUTES:
                self.standin.fault("status", route=ROUTES[source], status=503, times=100_000)

    def _change_work_orders(self, step: Step) -> None:
        """Before an ERP tick: one or two work orders changed since the previous one, at a time
        drawn between the two (after the day's 23:05 sync, for the 00:05 tick)."""
        if step.source != ERP:
            return
        previous = max((s.due for s in self.steps if s.source == ERP and s.due < step.due),
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


    def _fail(self, message: str) -> None:
        self.totals.failures.append(message)
        self.log(f"calendar: FAILED {message}")


def calendar_faults(suite: CalendarSuite) -> set[str]:
    """What the simulated span met: its sources' outages, the permanent failure, the daemon
    down, the holiday, the operators' re-runs during ticks and the inbox."""
    return {*(f"down: {source}" for source, ticks in suite.outages.items() if ticks),
            *(["permanent failure"] if suite.permanent else []), "daemon down", "holiday",
            *(["re-run during a tick"] if suite.reruns else []),
            *(["inbox"] if suite.drops else [])}


def run_calendar_chaos(postgres: ThrowawayPostgres, standin_server: StandinServer, seed: int,
                       days: int, *, lookback_days: int = 7, max_outage_ticks: int = 3,
                       sources: tuple[str, ...] = tuple(SCHEDULES),
                       down_sources: tuple[str, ...] | None = None,
                       template: str | None = None, log=print,
                       tally: Tally | None = None, truth: bool = False, inbox: bool = True,
                       reruns: bool = True) -> CalendarTotals:
    """Run the calendar of ``sources`` (every scheduled source, by default) in a warehouse and
    instance of their own, ``down_sources`` (default: all of them) going down, and print the
    summary; with ``truth``, what the operator is told is compared with the truth after every
    tick. A shorter ``lookback_days`` makes each source's first tick (and a run while it is
    down) smaller, and caps a source's outage at that many of its ticks: the catch-up looks back
    no further, so a longer outage would leave days behind by design, not by a defect (seed
    1063406734 with a 1-day lookback: the metals down two ticks, one day "unsettled")."""
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
                Path(work_dir), url, standin_server, standin,
                alert_interval_seconds=INTERVAL_SECONDS) as start:
            calendar = start(*(SCHEDULES[name] for name in sources),
                             lookback={name: lookback_days for name in sources},
                             environment={"MOSTOVIK_INBOX_SENSOR_INTERVAL_SECONDS":
                                          str(INTERVAL_SECONDS if inbox else 60)})
            specs = [SPECS[name] for name in sources]
            if truth:
                with SignalsObserver(calendar, specs, standin_server,
                                     Path(work_dir) / "observer",
                                     sensor_interval_seconds=INTERVAL_SECONDS) as observer:
                    suite = CalendarSuite(calendar, standin_server, seed, days, log,
                                          outage_ticks, sources, down_sources or sources,
                                          observer, inbox, reruns)
                    totals = suite.run()
            else:
                suite = CalendarSuite(calendar, standin_server, seed, days, log, outage_ticks,
                                      sources, down_sources or sources, None, inbox, reruns)
                totals = suite.run()
    finally:
        standin.clear_faults()
        standin.reset_erp()
        for endpoint in ENDPOINTS.values():
            standin.reset(endpoint.route)
        drop_database(postgres, name)
    if tally is not None:
        stuck = sum(" left " in failure and failure.startswith("run ")
                    for failure in totals.failures)
        tally.record("calendar", calendar_faults(suite),
                     unsettled=len(totals.failures) - stuck, stuck=stuck)
    log(f"calendar: seed {seed}, {days} day(s) + 1 settling, {totals.steps} ticks, "
        f"{totals.looks} looks at what the operator is told"
        + (f" ({totals.disagreements} disagreements)" if truth else "")
        + f", runs {totals.runs}, checked "
        f"{totals.checked}, {len(totals.failures)} failure(s), "
        f"{time.monotonic() - started:.0f} s; replay: python -m "
        f"mostovik_pipelines_tests.chaos.calendar_scenarios --seed {seed} --days {days} "
        f"--lookback-days {lookback_days} --max-outage-ticks {max_outage_ticks}"
        + (" --truth" if truth else ""))
    return totals


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m mostovik_pipelines_tests.chaos.calendar_scenarios")
    parser.add_argument("--seed", type=int, default=None, help="default: a random seed")
    parser.add_argument("--days", type=int, default=7)
    parser.add_argument("--lookback-days", type=int, default=7)
    parser.add_argument("--max-outage-ticks", type=int, default=3)
    parser.add_argument("--truth", action="store_true",
                        help="compare what the operator is told with the truth at every tick")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 31)
    postgres = ThrowawayPostgres().start()
    server = StandinServer().start()
    try:
        totals = run_calendar_chaos(postgres, server, seed, args.days,
                                    lookback_days=args.lookback_days,
                                    max_outage_ticks=args.max_outage_ticks, truth=args.truth)
    finally:
        server.stop()
        postgres.stop()
    return 1 if totals.failures else 0


if __name__ == "__main__":
    sys.exit(main())
