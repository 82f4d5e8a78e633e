"""The judge of the calendar suite, at the end of its span, as an operator would check: every
period of the span equals what one clean load gives from its source (``support/period_truth.py``:
any source, read by its own transform), the permanent failure is loaded by no run after its
first, waits for an operator and was alerted, the reports are loaded and the bad one waits, no
partition had two runs at once, no run is left in progress, and the runs launched are counted.
"""

from __future__ import annotations

from datetime import timedelta

from dagster import DagsterRunStatus, RunsFilter

from mostovik_pipelines.framework.automation.partition_states import Outcome, partition_states
from mostovik_pipelines_tests.chaos.calendar_steps import (
    CBR,
    FIRST_DAY,
    INBOX,
    SPECS,
    settling_steps,
)
from mostovik_pipelines_tests.support.delivery_reports import expected_rows as report_rows
from mostovik_pipelines_tests.support.inbox import delivery_rows, version_of
from mostovik_pipelines_tests.support.period_truth import is_final, stored_rows
from mostovik_pipelines_tests.support.schedule_calendar import (
    day_after,
    moscow,
    runs_at_once,
    runs_covering,
)


class CalendarJudge:
    """The judge, for :class:`.calendar_scenarios.CalendarSuite`: it reads the suite's calendar,
    sources, drops and permanent failure, and counts into its totals."""
    def _check(self) -> None:
        instance = self.calendar.daemon.instance
        url = self.calendar.warehouse_url
        span = [day_after(FIRST_DAY, offset) for offset in range(self.days + 1)]
        for spec in (SPECS[name] for name in self.sources):
            self.totals.runs[spec.name] = len(instance.get_runs(RunsFilter(
                tags={"mostovik/source": spec.name})))
            for key, run_a, run_b in runs_at_once(self.calendar, spec):
                self._fail(f"{spec.name} {key}: runs {run_a} and {run_b} at once")
        ticked = sum(self.totals.runs.values()) - len(self.rerun_runs)
        if ticked > 2 * self.totals.steps:
            self._fail(f"{ticked} runs for {self.totals.steps} ticks: more than two a tick")
        stuck = instance.get_runs(RunsFilter(statuses=[
            DagsterRunStatus.QUEUED, DagsterRunStatus.STARTING, DagsterRunStatus.STARTED]))
        for run in stuck:
            self._fail(f"run {run.run_id} left {run.status.value}")
        self._check_periods(url, span)
        self._check_inbox(url)
        if self.observer is not None:
            for owed in self.observer.alerts_owed():
                self._fail(f"told: {owed}")
        if self.permanent is None:
            return
        cbr = SPECS[CBR]
        states = partition_states(instance, cbr, [self.permanent], moscow(FIRST_DAY, 0))
        if states[self.permanent].latest_outcome is not Outcome.FAILED_PERMANENTLY:
            self._fail(f"{self.permanent}: {states[self.permanent]}, not waiting")
        if len(runs_covering(self.calendar, cbr, self.permanent)) != 1:
            self._fail(f"{self.permanent}: asked for again after a permanent failure")
        if not [alert for alert in self.calendar.webhook.alerts
                if f"waiting for an operator: {self.permanent}" in alert["message"]]:
            self._fail(f"{self.permanent}: no alert names it as waiting for an operator")

    def _check_periods(self, url: str, span: list[str]) -> None:
        """Every period of the span (but the permanent failure) equals what one clean load of
        it gives from its source now, for any source (``support/period_truth.py``)."""
        settled = max(step.due for step in settling_steps(self.days, self.sources))
        at = settled + timedelta(hours=1)
        self.calendar.tell_the_time(at)
        for spec in (self.calendar.as_configured(SPECS[name]) for name in self.sources):
            checked = 0
            for day in span:
                window = spec.partitions_def.time_window_for_partition_key(day)
                due = spec.deadline.due(window.start, window.end) if spec.deadline else (
                    window.end)
                if due > at:
                    continue  # not due by the settling day's last tick
                checked += 1
                if spec.name == CBR and day == self.permanent:
                    if stored_rows(spec, day, url):
                        self._fail(f"{spec.name} {day}: rows stored for a date failed for good")
                    continue
                if not is_final(spec, day, url, self.standin_server, at):
                    self._fail(f"{spec.name} {day}: the warehouse does not hold it as its "
                               "source gives it")
            self.totals.checked[f"{spec.name} periods"] = checked

    def _check_inbox(self, url: str) -> None:
        for name, content, lines in self.drops.values():
            version = version_of(name, content)
            if lines is None:
                waiting = self.calendar.mostovik("jobs", "list", "--waiting", "--json",
                                                 "--source", INBOX).stdout
                if version not in waiting:
                    self._fail(f"{INBOX} {version}: not listed as waiting for an operator")
                continue
            stored = sorted((r["waybill"], r["line_no"], r["quantity"].normalize())
                            for r in delivery_rows(url, name))
            expected = sorted((r["waybill"], r["line_no"], r["quantity"].normalize())
                              for r in report_rows(lines, name, version))
            if stored != expected:
                self._fail(f"{INBOX} {name}: {len(stored)} rows stored, {len(expected)} sent")
        self.totals.checked["inbox files"] = len(self.drops)
