"""The work-orders sync against the ERP stand-in: merge by version, tombstones, records moving
between windows, and progress that resumes after the last committed page."""

from __future__ import annotations

import dataclasses
import os
import signal
from datetime import date, datetime, timedelta
from decimal import Decimal
from zoneinfo import ZoneInfo

import pandas as pd
import pytest
from dagster import DagsterInstance

from mostovik_pipelines.framework.automation.partition_states import partition_states
from mostovik_pipelines.framework.spec import JobType
from mostovik_pipelines.framework.steps.sync_progress import settle_moment
from mostovik_pipelines.platform.tracking import load_job
from mostovik_pipelines.resources import LandingStoreResource
from mostovik_pipelines.sources import ALL_SOURCES, erp_work_orders
from mostovik_pipelines.warehouse import migrate
from mostovik_pipelines_tests.sources.erp_work_orders.sync_support import (
    a_commit_waits_for_the_hold,
    assert_equals_source,
    committed_pages,
    instance_runs,
    instant_between,
    page_commit_held,
    retry_records,
    source_state,
    start_sync,
    stored_by_id,
)
from mostovik_pipelines_tests.support.fake_clock import fake_clock_environment
from mostovik_pipelines_tests.support.locations import FAST_RETRY, code_location_for
from mostovik_pipelines_tests.support.postgres import (
    ThrowawayPostgres,
)
from mostovik_pipelines_tests.support.processes import run_environment
from mostovik_pipelines_tests.support.runs import run_partition
from mostovik_pipelines_tests.support.waiting import (
    PROCESS_START_MARGIN_SECONDS,
    wait_for_hanging_request,
    wait_until,
)

MOSCOW = ZoneInfo("Europe/Moscow")
DAYS = ["2026-11-02", "2026-11-03", "2026-11-04"]

@pytest.fixture
def erp(standin):
    standin.reset_erp()
    for day in DAYS:
        standin.set_erp_volume(day, 120)
    yield standin
    standin.reset_erp()


@pytest.fixture
def source():
    return dataclasses.replace(erp_work_orders.SOURCE, extract_retry=FAST_RETRY,
                               load_retry=FAST_RETRY)


@pytest.fixture
def erp_job(warehouse_url, standin_server, tmp_path, source):
    location = code_location_for(warehouse_url, standin_server, tmp_path, [source])
    return location.resolve_job_def("erp_work_orders_job")


def _at(day: str, hour: int, minute: int = 0) -> str:
    return datetime.combine(date.fromisoformat(day), datetime.min.time(), MOSCOW).replace(
        hour=hour, minute=minute).isoformat()


def test_windows_in_any_order_give_the_table_a_sync_in_order_gives(
    erp_job, erp, warehouse_url, instance
):
    late = "WO-20261102-000007"
    erp.update_erp_work_order(late, _at("2026-11-04", 10), status="done", amount="1.50")
    erp.delete_erp_work_order("WO-20261102-000011", _at("2026-11-03", 9))
    erp.delete_erp_work_order("WO-20261103-000004", _at("2026-11-04", 11))
    erp.restore_erp_work_order("WO-20261103-000004", _at("2026-11-04", 12), status="planned")
    for day in ("2026-11-04", "2026-11-02", "2026-11-03", "2026-11-02"):
        assert run_partition(erp_job, day, instance).success
    assert_equals_source(warehouse_url, erp, DAYS)
    table = stored_by_id(warehouse_url)
    assert table[late]["window_date"] == date(2026, 11, 4), "a later change moves the record"
    assert table["WO-20261102-000011"]["deleted"] is True, "a tombstone is kept, flagged"
    assert table["WO-20261103-000004"]["deleted"] is False, "a newer version restores it"


def test_an_old_window_re_run_after_newer_ones_never_overwrites_a_newer_version(
    erp_job, erp, warehouse_url, instance
):
    for day in DAYS:
        assert run_partition(erp_job, day, instance).success
    record = "WO-20261102-000020"
    erp.update_erp_work_order(record, _at("2026-11-04", 15), amount="999.00")
    assert run_partition(erp_job, "2026-11-04", instance).success
    newer = stored_by_id(warehouse_url)[record]
    assert run_partition(erp_job, "2026-11-02", instance).success
    assert stored_by_id(warehouse_url)[record]["version"] == newer["version"]
    assert stored_by_id(warehouse_url)[record]["window_date"] == date(2026, 11, 4)
    assert_equals_source(warehouse_url, erp, DAYS)


def test_a_tombstone_of_a_record_never_loaded_keeps_an_older_version_from_resurrecting_it(
    warehouse_url
):
    from mostovik_pipelines.framework.load.partition import load_partition
    from mostovik_pipelines.resources.warehouse import warehouse_engine

    def version(number: int, deleted: bool, day: str) -> pd.DataFrame:
        return pd.DataFrame([{
            "id": "WO-X", "object_code": "BR-014", "title": "Опалубка", "status": "planned",
            "planned_start": None, "planned_finish": None, "amount": Decimal("10.00"),
            "updated_at": pd.Timestamp(_at(day, 9)).tz_convert("UTC"), "version": number,
            "deleted": deleted, "window_date": date.fromisoformat(day)}])

    engine, target = warehouse_engine(warehouse_url), erp_work_orders.SOURCE.load_target
    counts = load_partition(engine, target, version(2**40, True, "2026-11-04"), "2026-11-04",
                            "run-1", whole_partition=False)
    assert (counts.inserted, counts.tombstoned) == (1, 1)
    counts = load_partition(engine, target, version(2**33, False, "2026-11-02"), "2026-11-02",
                            "run-2", whole_partition=False)
    assert (counts.updated, counts.ignored_older) == (0, 1)
    row = stored_by_id(warehouse_url)["WO-X"]
    assert row["deleted"] is True and row["version"] == 2**40
    assert row["window_date"] == date(2026, 11, 4)


def test_figures_show_new_updated_unchanged_older_and_tombstoned(
    erp_job, erp, warehouse_url, instance
):
    first = run_partition(erp_job, "2026-11-03", instance)
    figures = load_job(instance, first.run_id, ALL_SOURCES).per_partition["2026-11-03"]
    assert (figures["inserted"], figures["pages"]) == (120, 2)
    erp.update_erp_work_order("WO-20261103-000001", _at("2026-11-03", 23, 30), amount="5.00")
    erp.delete_erp_work_order("WO-20261103-000002", _at("2026-11-03", 23, 40))
    again = load_job(instance, run_partition(erp_job, "2026-11-03", instance).run_id, ALL_SOURCES)
    figures = again.per_partition["2026-11-03"]
    assert figures["updated"] == 2 and figures["tombstoned"] == 1
    assert figures["unchanged"] == 118
    assert again.status.value == "completed"


@pytest.mark.slow
@pytest.mark.parametrize("interruption", ["kill", "expired_token"])
def test_a_sync_resumes_after_its_last_committed_page_and_ends_exact(
    interruption, tmp_path, pg_warehouse_url, standin_server, erp, monkeypatch
):
    day = "2026-11-05"
    erp.set_erp_volume(day, 2000)  # 20 pages of 100, committed two at a time
    env = {**run_environment(tmp_path, pg_warehouse_url, standin_server.cbr_url),
           "MOSTOVIK_ERP_URL": standin_server.erp_url, "MOSTOVIK_ERP_ROWS_PER_COMMIT": "200"}
    erp.forget_requests()
    if interruption == "kill":
        with page_commit_held(pg_warehouse_url, 12):  # killed with pages 1-10 committed
            process = start_sync(day, env, tmp_path)
            wait_until(lambda: a_commit_waits_for_the_hold(pg_warehouse_url, process),
                       PROCESS_START_MARGIN_SECONDS + 120, "page 12's commit held")
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        committed = committed_pages(pg_warehouse_url, day)
        [dead] = instance_runs(env)
        landed = len(LandingStoreResource(base_dir=str(tmp_path / "data" / "landing"))
                     .pages_landed_by("erp_work_orders", day, dead))
    else:
        erp.fault("expire_token", route="erp", page=4, match=f"updated_from={day}")
        committed = 0
    asked_before = len(erp.requests("erp"))
    rerun = start_sync(day, env, tmp_path)
    output, _ = rerun.communicate(timeout=180)
    assert rerun.returncode == 0, output[-3000:]
    asked = erp.requests("erp")[asked_before:]
    if interruption == "kill":
        assert committed == 10
        # Every page was landed before the load began committing: none is fetched again.
        assert len(asked) == 20 - landed, "a landed page was fetched again"
    assert committed_pages(pg_warehouse_url, day) is None, "a finished window keeps no checkpoint"
    monkeypatch.setenv("DAGSTER_HOME", env["DAGSTER_HOME"])
    assert_equals_source(pg_warehouse_url, erp, [day])


@pytest.mark.slow
@pytest.mark.parametrize(("pages", "killed_after", "rows_per_commit"), [
    (9, 5, None),  # a window under rows_per_commit: one commit, at its end
    (9, 1, None),
    (20, 12, "200"),  # committed two pages at a time, killed while still landing
])
def test_a_sync_killed_after_page_k_resumes_after_its_last_landed_page(
    pages, killed_after, rows_per_commit, tmp_path, pg_warehouse_url, standin_server, erp,
    monkeypatch
):
    """kill -9 while page k + 1 is asked for (pages 1..k landed): the re-run fetches only the
    pages after k, whatever the commit grouping, and the table equals the source."""
    day = "2026-11-06"
    erp.set_erp_volume(day, pages * 100)
    env = {**run_environment(tmp_path, pg_warehouse_url, standin_server.cbr_url),
           "MOSTOVIK_ERP_URL": standin_server.erp_url}
    if rows_per_commit:
        env["MOSTOVIK_ERP_ROWS_PER_COMMIT"] = rows_per_commit
    landing = LandingStoreResource(base_dir=str(tmp_path / "data" / "landing"))
    erp.fault("hang", route="erp", page=killed_after + 1, seconds=300,
              match=f"updated_from={day}")
    doomed = start_sync(day, env, tmp_path)
    wait_for_hanging_request(erp, f"updated_from={day}")
    [dead] = instance_runs(env)
    wait_until(lambda: len(landing.pages_landed_by("erp_work_orders", day, dead)) >= killed_after,
               PROCESS_START_MARGIN_SECONDS, f"pages 1-{killed_after} landed")
    os.killpg(doomed.pid, signal.SIGKILL)
    doomed.wait()
    erp.release_hangs()  # the dead run's page k + 1 is answered (and logged) to no one
    wait_until(lambda: not erp.hanging(), PROCESS_START_MARGIN_SECONDS,
               "the dead run's hanging request answered")
    landed = [page.page for page in landing.pages_landed_by("erp_work_orders", day, dead)]
    assert landed == list(range(1, killed_after + 1)), landed

    erp.forget_requests()
    rerun = start_sync(day, env, tmp_path)
    output, _ = rerun.communicate(timeout=PROCESS_START_MARGIN_SECONDS + 120)
    assert rerun.returncode == 0, output[-3000:]
    asked = [request["page"] for request in erp.requests("erp")]
    assert asked == list(range(killed_after + 1, pages + 1)), "a landed page was fetched again"
    assert committed_pages(pg_warehouse_url, day) is None, "a finished window keeps no checkpoint"
    monkeypatch.setenv("DAGSTER_HOME", env["DAGSTER_HOME"])
    assert_equals_source(pg_warehouse_url, erp, [day])
    if killed_after == 1:
        # The window was synced to its end since: the next run syncs it afresh, every page.
        erp.forget_requests()
        again = start_sync(day, env, tmp_path)
        output, _ = again.communicate(timeout=PROCESS_START_MARGIN_SECONDS + 120)
        assert again.returncode == 0, output[-3000:]
        assert [r["page"] for r in erp.requests("erp")] == list(range(1, pages + 1))


@pytest.mark.slow
def test_records_in_a_killed_runs_landed_pages_changed_since_end_at_their_newest_version(
    tmp_path, pg_warehouse_url, standin_server, erp, monkeypatch
):
    """kill -9 of a `dagster job execute` run while page 4 of 6 is asked for (pages 1-3 landed,
    none committed); then the source tombstones a record those pages hold, updates a second,
    tombstones and restores a third, stamped after the pages' last item as the ERP's clock
    would. The re-run takes the landed pages up (asks for the pages after them only) and every
    record ends at its newest version: its stale copy in the taken-up pages loses by version."""
    day = "2026-11-07"
    erp.set_erp_volume(day, 600)
    env = {**run_environment(tmp_path, pg_warehouse_url, standin_server.cbr_url),
           "MOSTOVIK_ERP_URL": standin_server.erp_url}
    landing = LandingStoreResource(base_dir=str(tmp_path / "data" / "landing"))
    erp.fault("hang", route="erp", page=4, seconds=300, match=f"updated_from={day}")
    doomed = start_sync(day, env, tmp_path)
    wait_for_hanging_request(erp, f"updated_from={day}")
    [dead] = instance_runs(env)
    wait_until(lambda: len(landing.pages_landed_by("erp_work_orders", day, dead)) >= 3,
               PROCESS_START_MARGIN_SECONDS, "pages 1-3 landed")
    os.killpg(doomed.pid, signal.SIGKILL)
    doomed.wait()
    erp.release_hangs()
    assert committed_pages(pg_warehouse_url, day) is None, "nothing committed"
    read = list(source_state(erp, [day]).values())[:300]  # pages 1-3, in (updated_at, id) order
    last_read = datetime.fromisoformat(read[-1]["updated_at"])
    assert last_read < datetime.fromisoformat(_at(day, 23, 50))
    live = [item["id"] for item in read if not item["deleted"]]
    tombstoned, updated, restored = live[5], live[150], live[-1]
    erp.delete_erp_work_order(tombstoned, _at(day, 23, 50))
    erp.update_erp_work_order(updated, _at(day, 23, 51), amount="42.00")
    erp.delete_erp_work_order(restored, _at(day, 23, 52))
    erp.restore_erp_work_order(restored, _at(day, 23, 53), status="planned")

    erp.forget_requests()
    rerun = start_sync(day, env, tmp_path)
    output, _ = rerun.communicate(timeout=PROCESS_START_MARGIN_SECONDS + 120)
    assert rerun.returncode == 0, output[-3000:]
    # Pages 1-3 are taken up; the three changed records now follow them: 303 items, 4 pages.
    assert [request["page"] for request in erp.requests("erp")] == [4, 5, 6, 7]
    monkeypatch.setenv("DAGSTER_HOME", env["DAGSTER_HOME"])
    assert_equals_source(pg_warehouse_url, erp, [day])
    table = stored_by_id(pg_warehouse_url)
    assert table[tombstoned]["deleted"] is True
    assert table[updated]["amount"] == Decimal("42.00")
    assert table[restored]["deleted"] is False and table[restored]["status"] == "planned"


@pytest.mark.slow
@pytest.mark.parametrize("left", ["landed", "committed"])
def test_a_run_after_the_window_settled_re_reads_pages_fetched_before_it(
    left, tmp_path, pg_warehouse_url, standin_server, erp, monkeypatch
):
    """The window's 12:05 sync (a `dagster job execute` run on a fake clock) is killed with
    pages 1-3 of 6 landed (or committed). Then the ERP makes changes visible late, stamped
    inside those pages' range (a record of page 1 updated into page 3's, another tombstoned
    into page 2's). The run after the window settled (close + settle time; the real clock,
    weeks later) takes none of those pages up, says so, asks for every page again, and the
    table equals the source: the late changes are in, and the window recorded final is."""
    day = "2026-11-11"
    erp.set_erp_volume(day, 600)
    env = {**run_environment(tmp_path, pg_warehouse_url, standin_server.cbr_url),
           "MOSTOVIK_ERP_URL": standin_server.erp_url}
    hourly = {**env, **fake_clock_environment(datetime.fromisoformat(_at(day, 12, 5)), env)}
    landing = LandingStoreResource(base_dir=str(tmp_path / "data" / "landing"))
    if left == "committed":
        hourly["MOSTOVIK_ERP_ROWS_PER_COMMIT"] = "100"  # a commit per page
        with page_commit_held(pg_warehouse_url, 4):  # killed with pages 1-3 committed
            doomed = start_sync(day, hourly, tmp_path)
            wait_until(lambda: a_commit_waits_for_the_hold(pg_warehouse_url, doomed),
                       PROCESS_START_MARGIN_SECONDS + 120, "page 4's commit held")
            os.killpg(doomed.pid, signal.SIGKILL)
            doomed.wait()
        assert committed_pages(pg_warehouse_url, day) == 3
    else:
        erp.fault("hang", route="erp", page=4, seconds=300, match=f"updated_from={day}")
        doomed = start_sync(day, hourly, tmp_path)
        wait_for_hanging_request(erp, f"updated_from={day}")
        [dead] = instance_runs(env)
        wait_until(lambda: len(landing.pages_landed_by("erp_work_orders", day, dead)) >= 3,
                   PROCESS_START_MARGIN_SECONDS, "pages 1-3 landed")
        os.killpg(doomed.pid, signal.SIGKILL)
        doomed.wait()
        erp.release_hangs()
        assert committed_pages(pg_warehouse_url, day) is None, "nothing committed"
    [dead] = instance_runs(env)
    fetched = landing.pages_landed_by("erp_work_orders", day, dead)
    assert [page.page for page in fetched][:3] == [1, 2, 3]
    assert all(page.fetched_at < datetime.fromisoformat(_at(day, 13)) for page in fetched)
    read = list(source_state(erp, [day]).values())[:300]  # pages 1-3, in (updated_at, id) order
    live = [item["id"] for item in read[:100] if not item["deleted"]]
    updated, tombstoned = live[10], live[20]
    erp.update_erp_work_order(updated, instant_between(read[200], read[299]), amount="42.00")
    erp.delete_erp_work_order(tombstoned, instant_between(read[100], read[199]))

    erp.forget_requests()
    rerun = start_sync(day, env, tmp_path)
    output, _ = rerun.communicate(timeout=PROCESS_START_MARGIN_SECONDS + 120)
    assert rerun.returncode == 0, output[-3000:]
    monkeypatch.setenv("DAGSTER_HOME", env["DAGSTER_HOME"])
    assert_equals_source(pg_warehouse_url, erp, [day])
    table = stored_by_id(pg_warehouse_url)
    assert table[updated]["amount"] == Decimal("42.00")
    assert table[tombstoned]["deleted"] is True
    with DagsterInstance.from_config(env["DAGSTER_HOME"]) as instance:
        state = partition_states(instance, erp_work_orders.SOURCE, [day],
                                 runs_since=datetime.fromisoformat(_at(day, 0)))[day]
    assert state.final, "the window read whole after it settled is final"
    assert [request["page"] for request in erp.requests("erp")] == list(range(1, 7))
    said = ("not resuming after page 3 committed by run" if left == "committed"
            else "not taking up pages 1-3 landed by run")
    assert f"erp_work_orders [{day}]: {said} {dead}" in output, output[-3000:]


@pytest.mark.slow
def test_a_warehouse_crash_between_the_pages_of_a_sync_is_ridden_out_to_an_exact_table(
    tmp_path, standin_server, erp, monkeypatch
):
    """The warehouse crashes (``pg_ctl -m immediate``) after a sync committed pages 1-3 of 6
    and while page 4's commit is in flight, and is back once the run has ridden out 15 s of it:
    the run succeeds, no page is fetched twice, and the table equals the source."""
    day = "2026-11-10"
    warehouse = ThrowawayPostgres().start()
    try:
        migrate.upgrade(warehouse.url())
        erp.set_erp_volume(day, 600)
        env = {**run_environment(tmp_path, warehouse.url(), standin_server.cbr_url),
               "MOSTOVIK_ERP_URL": standin_server.erp_url,
               "MOSTOVIK_ERP_ROWS_PER_COMMIT": "100"}  # a commit per page
        erp.forget_requests()
        with page_commit_held(warehouse.url(), 4):
            run = start_sync(day, env, tmp_path)
            wait_until(lambda: a_commit_waits_for_the_hold(warehouse.url(), run),
                       PROCESS_START_MARGIN_SECONDS + 120, "page 4's commit held")
            assert committed_pages(warehouse.url(), day) == 3
            warehouse.pause()  # the held commit, and the hold, die with the server
        with DagsterInstance.from_config(env["DAGSTER_HOME"]) as instance:
            def ridden_out() -> bool:
                assert run.poll() is None, f"the run ended in the outage:\n{run.stdout.read()}"
                return sum(r["wait_seconds"] for r in retry_records(instance)
                           if r.get("outage")) >= WAREHOUSE_DOWN_SECONDS
            wait_until(ridden_out, PROCESS_START_MARGIN_SECONDS + 3 * WAREHOUSE_DOWN_SECONDS,
                       "the sync riding out the warehouse's outage")
        warehouse.resume()
        output, _ = run.communicate(timeout=PROCESS_START_MARGIN_SECONDS + 120)
        assert run.returncode == 0, output[-3000:]
        asked = [request["page"] for request in erp.requests("erp")]
        assert asked == list(range(1, 7)), f"pages asked for: {asked}"
        assert committed_pages(warehouse.url(), day) is None
        monkeypatch.setenv("DAGSTER_HOME", env["DAGSTER_HOME"])
        assert_equals_source(warehouse.url(), erp, [day])
    finally:
        warehouse.stop()

WAREHOUSE_DOWN_SECONDS = 15


def test_the_window_is_moscow_time_by_default():
    start, end = erp_work_orders.window_bounds("2026-11-03")
    assert start.utcoffset() == timedelta(hours=3)
    assert (end - start) == timedelta(days=1)


def test_a_window_settles_at_its_close_plus_the_settle_time_and_only_a_sync_with_one_does():
    """What fetched before it a run after it reads again (``steps/sync_progress.py``): the ERP's
    window of 2026-11-11 settles at 00:05 Moscow time the next day; a sync without a settle time
    and a parser have no such moment (what they fetched stays true)."""
    assert settle_moment(erp_work_orders.SOURCE, "2026-11-11") == datetime(
        2026, 11, 12, 0, 5, tzinfo=MOSCOW)
    no_settle = dataclasses.replace(erp_work_orders.SOURCE, catch_up=dataclasses.replace(
        erp_work_orders.SOURCE.catch_up, settle=timedelta(0)))
    assert settle_moment(no_settle, "2026-11-11") is None
    parser = next(spec for spec in ALL_SOURCES if spec.job_type is JobType.PARSER)
    assert settle_moment(parser, "2026-11-11") is None
