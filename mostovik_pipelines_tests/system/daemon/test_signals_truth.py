"""What the operator is told is true: the real daemon on a fake clock (libfaketime), every source
(the CBR rates, the metals, the ERP sync, the delivery inbox), over the public holiday of
4 November 2026 (the stand-ins taught it), and at every look the checks and freshness over
GraphQL, the alerts a webhook received, ``mostovik jobs list --waiting`` and the metrics through
PromQL on a real Prometheus compared with the truth: which periods the warehouse holds as the
stand-ins give them (``support/signals_truth.py``, ``support/period_truth.py``). The short,
scripted version of the calendar suite's truth judge (``make chaos``: a whole week, drawn from a
seed).

The cases, in order (Moscow time):

* Tue 12:00, the first CBR tick: the CBR down for two old days; the inbox gets a report and a
  PDF saved as CSV;
* Tue 16:00: the catch-up loads the old Sunday while tomorrow's rates (4 November) are refused:
  at 16:30 the check is red naming them, although a partition was just loaded (Dagster's
  freshness would have passed); the webhook is away from 16:30 for over an hour;
* Tue 18:00: the metals rename their record element: an alert, and the days are not final; the
  webhook is back and the alert it missed arrives, once;
* Tue 20:00: an operator's re-run of a final day is in flight during a catch-up tick that would
  have bridged it: not asked for twice, and a look while the runs still go (no waiting);
* Wed 00:05: the ERP's first tick syncs the closed window;
* Wed 18:00 (the holiday): the metals' day off is final, empty, on its day; Monday's metals
  left the one-day lookback unloaded: one alert, listed as waiting; no CBR date is due (the
  5th's rates come on the 5th);
* Thu 12:00: the 5th's rates are loaded.
"""

from __future__ import annotations

import json
from datetime import timedelta
from pathlib import Path

import pytest
from dagster import DagsterRunStatus

from mostovik_pipelines.core.tags import run_partitions
from mostovik_pipelines.sources import ALL_SOURCES, cbr_daily_rates, cbr_metal_prices
from mostovik_pipelines_tests.support.delivery_reports import csv_report, deliveries, report_table
from mostovik_pipelines_tests.support.delivery_reports import expected_rows as report_rows
from mostovik_pipelines_tests.support.fake_clock import wait_for_runs_done
from mostovik_pipelines_tests.support.inbox import delivery_rows, drop
from mostovik_pipelines_tests.support.schedule_calendar import (
    moscow,
    runs_at_once,
    runs_covering,
)
from mostovik_pipelines_tests.support.signals_truth import SignalsObserver
from mostovik_pipelines_tests.support.waiting import PROCESS_START_MARGIN_SECONDS, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

CBR, METALS = cbr_daily_rates.SOURCE, cbr_metal_prices.SOURCE
HOLIDAY = "2026-11-04"
INTERVAL = 5
"""The alert, deadline and inbox sensors' interval in this test (seconds)."""


def _cbr_fault(cal, day: str, times: int, **options) -> None:
    year, month, date = day.split("-")
    cal.standin.fault(options.pop("kind", "status"), route="cbr", times=times,
                      match=f"date_req={date}/{month}/{year}", **options)


@pytest.mark.timeout(1500)
def test_what_the_operator_is_told_agrees_with_the_warehouse_at_every_look(
        calendar, standin_server, tmp_path: Path):
    cal = calendar(*(f"{spec.name}_schedule" for spec in ALL_SOURCES if spec.schedule),
                   lookback={CBR.name: 2, METALS.name: 1, "erp_work_orders": 1},
                   environment={"MOSTOVIK_INBOX_SENSOR_INTERVAL_SECONDS": str(INTERVAL),
                                # The operator's re-run stays held in its fetch until released,
                                # however long the 20:00 tick takes on a busy machine.
                                "MOSTOVIK_CBR_TIMEOUT_SECONDS": "900"})
    for route in ("cbr", "cbr_metals"):
        cal.standin.control(route, "holidays", {"dates": [HOLIDAY]})
    good_lines = deliveries(6, seed=4)
    good = csv_report(report_table(good_lines))
    bad = b"%PDF-1.4\n%\xe2\xe3\xcf\xd3\n1 0 obj\n<< /Type /Catalog >>\nendobj\n"
    inbox = Path(cal.daemon.environment["MOSTOVIK_INBOX_DIR"])
    good_version = drop(inbox, "site-7_november.csv", good)
    bad_version = drop(inbox, "site-9_november.csv", bad)

    with SignalsObserver(cal, ALL_SOURCES, standin_server, tmp_path / "observer",
                         sensor_interval_seconds=INTERVAL) as observer:
        # Tue 12:00: Sunday's and Monday's rates refused (503), the first of them this tick only.
        _cbr_fault(cal, "2026-11-01", times=1000, status=503)
        _cbr_fault(cal, "2026-11-02", times=1000, status=503)
        cal.tick("cbr_daily_rates_schedule", moscow("2026-11-03", 12))
        wait_until(lambda: _files_done(cal, {good_version, bad_version}),
                   PROCESS_START_MARGIN_SECONDS, "the inbox's two runs", cal.daemon.log_tail)
        observer.look("Tue 12:00")

        # Tue 16:00: the old Sunday comes in; tomorrow's rates, published at 15:30, refused.
        cal.standin.clear_faults()
        _cbr_fault(cal, "2026-11-02", times=1000, status=503)
        _cbr_fault(cal, HOLIDAY, times=1000, status=503)
        runs = cal.tick("cbr_daily_rates_schedule", moscow("2026-11-03", 16))
        assert "2026-11-01" in {row for run in runs for row in run_partitions(
            run.tags, CBR.partitions_def)}
        observer.look("Tue 16:00")
        cal.webhook.down = True
        cal.start_at(moscow("2026-11-03", 16, 30) + timedelta(seconds=1))
        red = observer.look("Tue 16:30")
        assert not red.disagreements, "\n".join(red.disagreements)
        assert HOLIDAY in _told_late(observer, CBR.name)  # red though a day was just loaded

        # Tue 18:00: the metals rename <Record>; the webhook is back.
        cal.webhook.down = False
        cal.standin.control("cbr_metals", "record_element", {"name": "Rec"})
        cal.tick("cbr_metal_prices_schedule", moscow("2026-11-03", 18))
        observer.look("Tue 18:00")
        cal.standin.control("cbr_metals", "record_element", {"name": None})
        shape_alerts = [a for a in cal.webhook.alerts if a["kind"] == "source_shape"]
        assert [a["source"] for a in shape_alerts] == [METALS.name]
        assert "no Record records but Metall/Rec" in shape_alerts[0]["message"]
        # The late alert raised while the webhook was away arrived once it was back.
        wait_until(lambda: ("late", HOLIDAY) in {(a["kind"], a["period"])
                                                  for a in cal.webhook.alerts},
                   PROCESS_START_MARGIN_SECONDS, "the late alert held in the outbox")

        # Tue 20:00: an operator re-runs Tuesday's (final) rates, held in its fetch, while the
        # catch-up asks for Monday's and Wednesday's around it.
        cal.standin.clear_faults()
        # Held until released (the fetch's timeout is raised above): in flight at the tick.
        _cbr_fault(cal, "2026-11-03", times=1, kind="hang", seconds=600)

        def operators_rerun() -> None:
            asked = cal.mostovik("jobs", "rerun", "--source", CBR.name, "--period",
                                 "2026-11-03", "--reason", "a figure looked wrong")
            assert asked.returncode == 0, asked.stderr[-2000:]
            wait_until(lambda: cal.standin.hanging("cbr"), PROCESS_START_MARGIN_SECONDS,
                       "the operator's re-run fetching", cal.daemon.log_tail)

        runs = cal.tick("cbr_daily_rates_schedule", moscow("2026-11-03", 20),
                        started_at=moscow("2026-11-03", 20) - timedelta(seconds=15),
                        before_tick=operators_rerun,
                        wait_for_runs=False)
        asked = [run_partitions(run.tags, CBR.partitions_def) for run in runs]
        assert asked and all("2026-11-03" not in partitions for partitions in asked), asked
        observer.look("Tue 20:00, runs going")
        cal.standin.release_hangs()
        wait_for_runs_done(cal.daemon.instance, diagnostics=cal.daemon.log_tail)
        observer.look("Tue 20:00, runs done")

        # Wed 00:05: the ERP's first tick.
        cal.tick("erp_work_orders_schedule", moscow(HOLIDAY, 0, 5))
        observer.look("Wed 00:05")

        # Wed 18:00, the holiday: the metals' empty day off; Monday's metals aged out.
        cal.tick("cbr_metal_prices_schedule", moscow(HOLIDAY, 18))
        holiday = observer.look("Wed 18:00")
        assert _told_late(observer, CBR.name) == set(), "no CBR date is due on the holiday"
        assert "2026-11-02" in _aged(cal, METALS.name)

        # Thu 12:00: the 5th's rates.
        cal.tick("cbr_daily_rates_schedule", moscow("2026-11-05", 12))
        observer.look("Thu 12:00")

        disagreements = observer.disagreements()
        assert disagreements == [], "\n".join(disagreements)
        assert observer.alerts_owed() == []
        assert not holiday.disagreements

    # Every alert once; the late and aged-out ones are those the truth knew.
    assert all(count == 1 for count in cal.webhook.delivered().values()), (
        cal.webhook.delivered())
    aged = [a for a in cal.webhook.alerts if a["kind"] == "aged_out"]
    # The metals' days of the renamed element wait for an operator, and left the one-day
    # lookback: Monday's by Wednesday's look, Tuesday's by Thursday's.
    assert sorted((a["source"], a["period"]) for a in aged) == [
        (METALS.name, "2026-11-02"), (METALS.name, "2026-11-03")]
    # Nothing ran twice at once: not the operator's re-run and a catch-up.
    for spec in ALL_SOURCES:
        assert runs_at_once(cal, spec) == [], spec.name
    covering = runs_covering(cal, CBR, "2026-11-03")
    assert [run.tags.get("mostovik/requested_by") is not None for run in covering].count(
        True) == 1, [run.tags for run in covering]
    assert len(covering) == 3  # 12:00's, 16:00's range, and the operator's; none at 20:00
    # The inbox: the report loaded exactly, the PDF waits for an operator, alerted once.
    assert _rows(delivery_rows(cal.warehouse_url, "site-7_november.csv")) == _rows(
        report_rows(good_lines, "site-7_november.csv", good_version))
    waiting = json.loads(cal.mostovik("jobs", "list", "--waiting", "--json",
                                      "--source", "material_deliveries").stdout)
    assert [entry["waiting_for_operator"] for entry in waiting] == [[bad_version]]
    failures = [a for a in cal.webhook.alerts if a["kind"] == "run_failure"
                and a["source"] == "material_deliveries"]
    assert [a["period"] for a in failures] == [bad_version]
    assert all(run.status is not DagsterRunStatus.STARTED
               for run in cal.daemon.instance.get_runs())


def _files_done(cal, versions: set[str]) -> bool:
    runs = [run for run in cal.daemon.instance.get_runs()
            if run.tags.get("dagster/partition") in versions]
    return {run.tags["dagster/partition"] for run in runs} == versions and all(
        run.status in (DagsterRunStatus.SUCCESS, DagsterRunStatus.FAILURE) for run in runs)


def _told_late(observer: SignalsObserver, source: str) -> set[str]:
    from mostovik_pipelines.framework.automation.deadlines import DEADLINE_CHECK
    from mostovik_pipelines_tests.support.signals_truth import CHECK_QUERY

    result = observer.graphql.execute(CHECK_QUERY, {"assetKey": {"path": [source]},
                                                    "checkName": DEADLINE_CHECK})
    [execution] = result["assetCheckExecutions"]
    entries = {e["label"]: e.get("jsonString") for e in execution["evaluation"]["metadataEntries"]}
    return set(json.loads(entries["late_periods"]))


def _aged(cal, source: str) -> set[str]:
    waiting = json.loads(cal.mostovik("jobs", "list", "--waiting", "--json", "--source",
                                      source).stdout)
    return {period for entry in waiting for period in entry["waiting_for_operator"]}


def _rows(rows) -> list[tuple]:
    return sorted((str(r["waybill"]), int(r["line_no"]), str(r["material"]),
                   format(r["quantity"].normalize(), "f") if hasattr(r["quantity"], "normalize")
                   else str(r["quantity"])) for r in rows)
