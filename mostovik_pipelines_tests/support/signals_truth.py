"""What the operator is told, compared with the truth, at an instant of a calendar run by the
real daemon on a fake clock (:mod:`.schedule_calendar`).

Told: each source's ``period_deadlines`` check and its freshness over GraphQL (a real
``dagster-webserver`` on the calendar's instance), the alerts received by the calendar's webhook,
``mostovik jobs list --waiting`` typed on the daemon's clock, and the metrics through PromQL on
a real Prometheus scraping ``mostovik metrics`` (started again on the daemon's clock at each
look). Truth: :mod:`.period_truth`, from the warehouse and the stand-ins alone.

Each look waits for the signals' own records, never a fixed time: a ``period_deadlines`` sensor
tick that began after the instant looked at, a scrape of a metrics process started for it. What
differs is a disagreement, named: the suites and the tests require none.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from dagster._core.scheduler.instigation import InstigatorType, TickStatus

from mostovik_pipelines.framework.automation.deadlines import DEADLINE_CHECK
from mostovik_pipelines.framework.spec import SourceSpec
from mostovik_pipelines.standin import StandinServer
from mostovik_pipelines_tests.support.fake_clock import fake_clock_environment
from mostovik_pipelines_tests.support.graphql import DagsterGraphQL
from mostovik_pipelines_tests.support.period_truth import (
    Truth,
    is_final,
    ledger_fetched_at,
    truth_at,
)
from mostovik_pipelines_tests.support.postgres import free_port
from mostovik_pipelines_tests.support.processes import stop_process
from mostovik_pipelines_tests.support.prometheus import ThrowawayPrometheus
from mostovik_pipelines_tests.support.schedule_calendar import Calendar
from mostovik_pipelines_tests.support.waiting import (
    PROCESS_START_MARGIN_SECONDS,
    limit_for,
    wait_until,
)

BIN = Path(sys.executable).parent
SENSOR = "period_deadlines"
CHECK_QUERY = """
  query PeriodDeadlines($assetKey: AssetKeyInput!, $checkName: String!) {
    assetCheckExecutions(assetKey: $assetKey, checkName: $checkName, limit: 1) {
      status
      evaluation { metadataEntries { label ... on JsonMetadataEntry { jsonString } } }
    }
    assetNodeOrError(assetKey: $assetKey) {
      ... on AssetNode { freshnessStatusInfo { freshnessStatus } }
    }
  }
"""


@dataclass
class Told:
    """What the operator was told at one look, per source."""

    check_late: dict[str, set[str]] = field(default_factory=dict)
    check_red: dict[str, bool] = field(default_factory=dict)
    fresh: dict[str, str | None] = field(default_factory=dict)
    metrics_late: dict[str, float | None] = field(default_factory=dict)
    waiting: set[tuple[str, str]] = field(default_factory=set)


@dataclass
class Look:
    at: datetime
    disagreements: list[str]


class SignalsObserver:
    """Looks at a calendar: its webserver, its metrics and Prometheus, compared with the truth
    of ``sources`` (those with a deadline); a context manager."""

    def __init__(self, calendar: Calendar, sources: Sequence[SourceSpec],
                 standin_server: StandinServer, work_dir: Path,
                 sensor_interval_seconds: float = 5) -> None:
        self.calendar = calendar
        self.sources = [calendar.as_configured(spec) for spec in sources
                        if spec.deadline is not None]
        self.standin_server = standin_server
        self.work_dir = work_dir
        self.sensor_interval_seconds = sensor_interval_seconds
        self.metrics_port = free_port()
        self.looks: list[Look] = []
        self.ever_late: dict[str, set[str]] = {spec.name: set() for spec in self.sources}
        """Every period found late at some look: a late alert for any other is false."""
        self._webserver: subprocess.Popen | None = None
        self._metrics: subprocess.Popen | None = None
        self._prometheus: ThrowawayPrometheus | None = None
        self.graphql: DagsterGraphQL | None = None

    def __enter__(self) -> SignalsObserver:
        daemon = self.calendar.daemon
        self.work_dir.mkdir(parents=True, exist_ok=True)
        port = free_port()
        log = (self.work_dir / "webserver.log").open("ab")
        self._webserver = subprocess.Popen(
            [str(BIN / "dagster-webserver"), "--host", "127.0.0.1", "--port", str(port),
             "--workspace", str(daemon.workspace_file)],
            env={**os.environ, **daemon.environment}, cwd=self.work_dir, stdout=log,
            stderr=subprocess.STDOUT, start_new_session=True)
        self.graphql = DagsterGraphQL(f"http://127.0.0.1:{port}/graphql")
        wait_until(lambda: self._webserver.poll() is None and self._loaded(),
                   PROCESS_START_MARGIN_SECONDS, "the webserver serving the code location",
                   lambda: (self.work_dir / "webserver.log").read_text(errors="replace")[-3000:],
                   poll=1)
        self._prometheus = ThrowawayPrometheus(
            self.work_dir, {"mostovik": f"127.0.0.1:{self.metrics_port}"}).__enter__()
        return self

    def __exit__(self, *exc_info: object) -> None:
        stop_process(self._metrics, 10)
        if self._prometheus is not None:
            self._prometheus.__exit__()
        if self.graphql is not None:
            self.graphql.close()
        stop_process(self._webserver, 10)

    def _loaded(self) -> bool:
        try:
            return set(self.graphql.location_statuses().values()) == {"LOADED"}
        except Exception:
            return False

    # --- one look ------------------------------------------------------------------------------

    def look(self, label: str = "") -> Look:
        """What the operator is told now (the daemon's instant) against the truth."""
        # Everything is judged at the instant of the deadlines' sensor's tick that the check's
        # state is from: the first to begin after now. Runs may go on meanwhile: the truth is
        # read before that tick and after every signal was, and what is told must be the truth
        # at some moment in between, period by period.
        now = self.calendar.daemon.now().astimezone(UTC)
        before = self._truth(now)
        at = self._wait_for_deadlines_tick(now)
        told = Told()
        for spec in self.sources:
            result = self.graphql.execute(CHECK_QUERY, {"assetKey": {"path": [spec.name]},
                                                        "checkName": DEADLINE_CHECK})
            executions = result["assetCheckExecutions"]
            entries = {entry["label"]: entry.get("jsonString")
                       for entry in (executions[0]["evaluation"]["metadataEntries"]
                                     if executions else [])}
            told.check_late[spec.name] = set(json.loads(entries.get("late_periods") or "[]"))
            told.check_red[spec.name] = bool(executions) and executions[0]["status"] == "FAILED"
            info = result["assetNodeOrError"].get("freshnessStatusInfo")
            told.fresh[spec.name] = info["freshnessStatus"] if info else None
        told.metrics_late = self._metrics_late(at)
        told.waiting = self._waiting(at)
        disagreements = self._compare(at, told, before, self._truth(at))
        look = Look(at, [f"{label} {at.isoformat(timespec='seconds')}: {d}"
                         for d in disagreements])
        self.looks.append(look)
        return look

    def _wait_for_deadlines_tick(self, after: datetime) -> datetime:
        """Once the deadlines' sensor has finished the first tick that began after ``after``,
        and the instant it began."""
        instance = self.calendar.daemon.instance

        def done() -> float | None:
            for state in instance.all_instigator_state(instigator_type=InstigatorType.SENSOR):
                if state.instigator_name != SENSOR:
                    continue
                ticks = [tick for tick in instance.get_ticks(
                    state.instigator_origin_id, state.selector_id, limit=10)
                    if tick.timestamp >= after.timestamp()]
                first = min(ticks, key=lambda tick: tick.timestamp, default=None)
                if first is not None and first.status in (TickStatus.SKIPPED,
                                                          TickStatus.SUCCESS):
                    return first.timestamp
            return None

        began = wait_until(done, limit_for(self.sensor_interval_seconds),
                           f"a {SENSOR} tick after {after.isoformat()}",
                           self.calendar.daemon.log_tail, poll=0.5)
        return datetime.fromtimestamp(began, UTC)

    def _metrics_late(self, at: datetime) -> dict[str, float | None]:
        """``mostovik_source_late_periods`` per source, scraped from a metrics process started
        on the daemon's clock for this look."""
        stop_process(self._metrics, 10)
        environment = {**os.environ, **self.calendar.daemon.environment}
        environment.update(fake_clock_environment(at, environment))
        log = (self.work_dir / "metrics.log").open("ab")
        self._metrics = subprocess.Popen(
            [str(BIN / "mostovik"), "metrics", "--port", str(self.metrics_port),
             "--cache-seconds", "3600"], env=environment, stdout=log,
            stderr=subprocess.STDOUT)
        started = datetime.now(UTC).timestamp()
        prometheus = self._prometheus

        def scraped() -> dict[str, float | None] | None:
            series = prometheus.query("mostovik_source_late_periods")
            stamps = prometheus.query("timestamp(mostovik_metrics_read_duration_seconds)")
            if not stamps or stamps[0]["value"] < started:
                return None
            return {s["metric"]["source"]: s["value"] for s in series}

        return wait_until(scraped, PROCESS_START_MARGIN_SECONDS,
                          "a scrape of the metrics started for this look",
                          lambda: prometheus.log()[-2000:], poll=0.5)

    def _waiting(self, at: datetime) -> set[tuple[str, str]]:
        listed = self.calendar.mostovik("jobs", "list", "--waiting", "--json",
                                        "--limit", "1000", at=at)
        assert listed.returncode == 0, listed.stderr[-3000:]
        return {(entry["source"], period) for entry in json.loads(listed.stdout)
                for period in entry["waiting_for_operator"]}

    # --- the comparison --------------------------------------------------------------------------

    def _truth(self, at: datetime) -> dict[str, Truth]:
        return {spec.name: truth_at(self.calendar.daemon.instance, spec,
                                    self.calendar.warehouse_url, self.standin_server, at)
                for spec in self.sources}

    def _compare(self, at: datetime, told: Told, before: dict[str, Truth],
                 after: dict[str, Truth]) -> list[str]:
        found = []
        webhook = self.calendar.webhook
        alerts = {(alert["kind"], alert["source"] or "", alert["period"] or "")
                  for alert in webhook.alerts}
        for spec in self.sources:
            name = spec.name
            truth = after[name]
            # Due at the judged instant; late then if late before the look or after it.
            settled = {key for key in truth.due if (key in truth.late) == (
                key in before[name].late or key not in before[name].due)}
            late = truth.late | {key for key in before[name].late if key in truth.due}
            self.ever_late[name] |= truth.late
            shown = told.check_late[name]
            wrong = {key for key in truth.due if (key in shown) != (key in truth.late)
                     and key in settled}
            if wrong or shown - set(truth.due):
                found.append(f"{name}: the check names {sorted(shown)} as late, the truth "
                             f"{sorted(truth.late)} (before the look {sorted(before[name].late)})")
            if told.check_red[name] != bool(shown):
                found.append(f"{name}: the check is {'red' if told.check_red[name] else 'green'}"
                             f" naming {sorted(shown)}")
            if late and told.fresh[name] in ("HEALTHY",):
                found.append(f"{name}: fresh ({told.fresh[name]}) while {sorted(late)} "
                             "are due and not final")
            counted = told.metrics_late.get(name)
            if counted is None or not len(truth.late) <= counted <= len(late):
                found.append(f"{name}: mostovik_source_late_periods {counted}, the truth "
                             f"{len(truth.late)}")
            listed = {period for source, period in told.waiting if source == name}
            if not truth.aged_out <= listed:
                found.append(f"{name}: jobs list --waiting lacks the aged-out "
                             f"{sorted(truth.aged_out - listed)}")
            final = sorted(period for period in listed - truth.late if is_final(
                spec, period, self.calendar.warehouse_url, self.standin_server, at))
            if final:
                found.append(f"{name}: jobs list --waiting lists {final}, final in the "
                             "warehouse")
            for kind, source, period in alerts:
                if source == name and kind in ("late", "aged_out") and (
                        period not in self.ever_late[name]) and self._in_time(spec, period):
                    found.append(f"{name} [{period}]: a {kind} alert, never late")
        found += [f"alert {key} received {count} times"
                  for key, count in webhook.delivered().items() if count != 1]
        return found

    def _in_time(self, spec: SourceSpec, period: str) -> bool:
        """Whether a period no look found late was in on time: its load, as the ledger keeps
        it, fetched before it was due (a period loaded late, between two looks, was late; a
        sync's windows keep no ledger: not judged)."""
        fetched = ledger_fetched_at(spec, period, self.calendar.warehouse_url)
        if fetched is None:
            return False
        window = spec.partitions_def.time_window_for_partition_key(period)
        return fetched <= spec.deadline.due(window.start, window.end)

    def alerts_owed(self) -> list[str]:
        """Once every alert could be delivered: each period ever late has had its one late
        alert (the final judgement of a run)."""
        received = {(alert["source"], alert["period"]) for alert in self.calendar.webhook.alerts
                    if alert["kind"] == "late"}
        return [f"{source} [{period}] was late and no late alert arrived"
                for source, periods in self.ever_late.items() for period in sorted(periods)
                if (source, period) not in received]

    def disagreements(self) -> list[str]:
        return [d for look in self.looks for d in look.disagreements]
