"""Material delivery reports through the whole file job: files dropped into the inbox, the
sensor's partitions and runs, the table, the quarantine, the archive. Real PostgreSQL (and SQLite
where it is cheap); the parser alone is tested in ``test_material_deliveries_format.py``."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import subprocess
import sys
from decimal import Decimal
from pathlib import Path

import pytest
from click.testing import CliRunner
from dagster import DagsterInstance, DagsterRunStatus

from mostovik_pipelines import cli
from mostovik_pipelines.platform.status import STATUS_TAG
from mostovik_pipelines.sources import material_deliveries
from mostovik_pipelines_tests.sources.material_deliveries.report_files import (
    MAX_FILE_BYTES,
    corrected,
    csv_file,
    file_defects,
    report_lines,
    variant_files,
    xlsx_file,
)
from mostovik_pipelines_tests.support import delivery_reports as reports
from mostovik_pipelines_tests.support.delivery_reports import TITLE_ROWS, Layout
from mostovik_pipelines_tests.support.inbox import (
    JOB,
    InboxSensor,
    delivery_rows,
    drop,
    exact,
    expected_table,
    inbox_dirs,
    inbox_resource,
    physical_rows,
    quarantined,
    sorted_rows,
    version_of,
)
from mostovik_pipelines_tests.support.locations import FAST_RETRY, code_location_for
from mostovik_pipelines_tests.support.processes import (
    DAGSTER,
    local_dagster_home,
    run_environment,
)
from mostovik_pipelines_tests.support.run_queue import run_queue_daemon
from mostovik_pipelines_tests.support.runs import load_metadata, step_failure_message

MOSTOVIK = str(Path(sys.executable).parent / "mostovik")
SOURCE = dataclasses.replace(material_deliveries.SOURCE, extract_retry=FAST_RETRY,
                             load_retry=FAST_RETRY)


@pytest.fixture
def inbox(tmp_path) -> Path:
    return inbox_dirs(tmp_path)[0]


@pytest.fixture
def archive(tmp_path) -> Path:
    return inbox_dirs(tmp_path)[1]


def _sensor(url: str, standin_server, work_dir: Path, instance: DagsterInstance,
            **resource_options) -> InboxSensor:
    resource = inbox_resource(work_dir, **resource_options)
    location = code_location_for(url, standin_server, work_dir, [SOURCE],
                                 material_deliveries_source=resource)
    return InboxSensor(location, instance, resource)


@pytest.fixture
def sensor(pg_warehouse_url, standin_server, tmp_path, instance) -> InboxSensor:
    return _sensor(pg_warehouse_url, standin_server, tmp_path, instance)


def test_a_folder_of_every_variant_loads_exactly_and_is_archived(
    sensor, pg_warehouse_url, inbox, archive
):
    files = variant_files()
    versions = {name: drop(inbox, name, content) for name, (_, content) in files.items()}

    results = sensor.run_new_versions()

    assert set(results) == set(versions.values())
    failed = {key: step_failure_message(sensor.instance, r.run_id)
              for key, r in results.items() if not r.success}
    assert not failed, failed
    expected = [row for name, (lines, _) in files.items()
                for row in expected_table(lines, name, versions[name])]
    loaded = delivery_rows(pg_warehouse_url)
    assert loaded == sorted_rows(expected)
    # Amounts typed as text keep their scale exactly (1 234,500 is 1234.500); a number typed
    # into an XLSX cell is a double and has none (410.50 reads back as 410.5).
    typed_as_text = {name for name in files if not name.endswith(".xlsx")} | {"mac_1904.xlsx"}
    assert exact(r for r in loaded if r["source_file"] in typed_as_text) == exact(
        r for r in sorted_rows(expected) if r["source_file"] in typed_as_text)
    # Waybill numbers are text: leading zeros kept, in CSV and in XLSX text cells.
    for kind in (".csv", ".xlsx"):
        assert any(row["waybill"].startswith("0") and row["source_file"].endswith(kind)
                   for row in loaded), f"no leading-zero waybill in a {kind} file"
    assert quarantined(pg_warehouse_url) == []

    assert list(inbox.iterdir()) == []
    for name, (_, content) in files.items():
        version = versions[name]
        assert (archive / version).read_bytes() == content
        note = json.loads((archive / f"{version}.outcome.json").read_text())
        assert note["file"] == name and note["version"] == version
        assert note["outcome"] == "loaded"
        assert note["run_id"] == results[version].run_id
        tags = sensor.instance.get_run_by_id(results[version].run_id).tags
        assert tags[STATUS_TAG] == "completed"
        assert tags["dagster/partition"] == version
    assert len(list(archive.iterdir())) == 2 * len(files)


def test_a_corrected_version_replaces_exactly_that_files_rows(
    warehouse_url, standin_server, tmp_path, instance, inbox, archive
):
    sensor = _sensor(warehouse_url, standin_server, tmp_path, instance)
    other_lines, first_lines = report_lines(15, 1), report_lines(20, 2)
    drop(inbox, "Объект 1.csv", csv_file(other_lines))
    first = drop(inbox, "Объект 2.csv", csv_file(first_lines))
    assert all(r.success for r in sensor.run_new_versions().values())
    other_before = physical_rows(warehouse_url, "Объект 1.csv")

    second_lines = corrected(first_lines)
    second = drop(inbox, "Объект 2.csv", csv_file(second_lines))
    assert second != first
    results = sensor.run_new_versions()

    assert list(results) == [second]
    assert results[second].success, step_failure_message(instance, results[second].run_id)
    rows = delivery_rows(warehouse_url, "Объект 2.csv")
    assert exact(rows) == exact(sorted_rows(expected_table(second_lines, "Объект 2.csv",
                                                           second)))
    assert (first_lines[7].waybill, first_lines[7].line_no) not in {
        (r["waybill"], r["line_no"]) for r in rows}
    figures = load_metadata(instance, results[second].run_id)
    # Every kept row is rewritten once: its file_version is the new version's.
    assert (figures["inserted"], figures["updated"], figures["deleted"]) == (
        1, len(first_lines) - 1, 1)
    assert physical_rows(warehouse_url, "Объект 1.csv") == other_before
    assert list(inbox.iterdir()) == []
    assert {p.name for p in archive.iterdir() if not p.name.endswith(".json")} == {
        version_of("Объект 1.csv", csv_file(other_lines)), first, second}

    # The site takes the correction back: the first bytes dropped again are the file's newest
    # upload, so they run once more (under a run key of their own), and the file holds them.
    assert drop(inbox, "Объект 2.csv", csv_file(first_lines)) == first
    [revert] = sensor.tick().run_requests
    assert revert.partition_key == first
    assert revert.run_key != hashlib.sha256(csv_file(first_lines)).hexdigest()
    sensor.cursor = None  # a reset cursor asks again under the same key: the daemon runs it once
    assert [r.run_key for r in sensor.tick().run_requests] == [revert.run_key]
    assert sensor.run(first).success
    assert exact(delivery_rows(warehouse_url, "Объект 2.csv")) == exact(sorted_rows(
        expected_table(first_lines, "Объект 2.csv", first)))
    assert list(inbox.iterdir()) == []


def test_a_file_with_three_bad_rows_among_a_hundred_loads_97_and_is_partial(
    pg_warehouse_url, standin_server, tmp_path, inbox, archive
):
    lines = report_lines(100, 3)
    table = reports.report_table(lines)
    bad = {10: ("Количество", "12,5 кг", "Количество '12,5 кг' is not a number"),
           50: ("Дата поставки", "31.02.2026", "Дата поставки '31.02.2026' is not a date"),
           90: ("Цена", "-15,00", "Цена '-15,00' is negative")}
    for data_row, (header, value, _) in bad.items():
        reports.set_cell(table, data_row, header, value)
    content = reports.csv_report(table, encoding="windows-1251")
    home = str(local_dagster_home(tmp_path))  # an instance `mostovik jobs show` can read
    with DagsterInstance.from_config(home) as instance:
        sensor = _sensor(pg_warehouse_url, standin_server, tmp_path, instance)
        version = drop(inbox, "Накладные за ноябрь.csv", content)
        [result] = sensor.run_new_versions().values()
        assert result.success, step_failure_message(instance, result.run_id)
        assert instance.get_run_by_id(result.run_id).tags[STATUS_TAG] == "partial"

    good = [line for index, line in enumerate(lines) if index not in bad]
    assert exact(delivery_rows(pg_warehouse_url)) == exact(sorted_rows(expected_table(
        good, "Накладные за ноябрь.csv", version)))
    rejected = quarantined(pg_warehouse_url)
    assert [(q["source"], q["partition_key"], q["row_number"]) for q in rejected] == [
        ("material_deliveries", version, reports.first_data_row_number() + index)
        for index in sorted(bad)]
    for row, (_, value, reason) in zip(rejected, [bad[i] for i in sorted(bad)], strict=True):
        assert reason in row["reason"], row["reason"]
        assert value in row["raw_row"]
        assert row["run_id"] == result.run_id

    # The operator's view, `mostovik jobs show RUN_ID --json` (the command in this process).
    shown = CliRunner().invoke(cli.main, ["jobs", "show", result.run_id, "--json"],
                               env={"DAGSTER_HOME": home})
    assert shown.exit_code == 0, shown.output
    job = json.loads(shown.output)
    assert (job["status"], job["source"], job["period"]) == (
        "partial", "material_deliveries", version)
    assert job["totals"]["rejected"] == 3 and job["totals"]["inserted"] == 97
    note = json.loads((archive / f"{version}.outcome.json").read_text())
    assert note["outcome"] == "partial"
    assert list(inbox.iterdir()) == []



def test_each_file_level_defect_fails_its_run_loads_nothing_and_stays_in_the_inbox(
    pg_warehouse_url, standin_server, tmp_path, instance, inbox, archive
):
    sensor = _sensor(pg_warehouse_url, standin_server, tmp_path, instance,
                     max_file_bytes=MAX_FILE_BYTES)
    earlier = drop(inbox, "earlier.csv", csv_file(report_lines(20, 1)))
    assert sensor.run_new_versions()[earlier].success
    before = physical_rows(pg_warehouse_url)
    defects = file_defects()
    versions = {name: drop(inbox, name, content) for name, (content, _) in defects.items()}

    results = sensor.run_new_versions()

    assert set(results) == set(versions.values())
    wrong = {}
    for name, (_, fragments) in defects.items():
        result = results[versions[name]]
        message = step_failure_message(instance, result.run_id)
        missing = [f for f in [f"material_deliveries [{versions[name]}]", name, *fragments]
                   if f not in message]
        if result.success or missing:
            wrong[name] = (result.success, missing, message)
        assert instance.get_run_by_id(result.run_id).tags.get(STATUS_TAG) == "failed"
    assert not wrong, json.dumps(wrong, ensure_ascii=False, indent=1)
    assert physical_rows(pg_warehouse_url) == before
    assert quarantined(pg_warehouse_url) == []
    assert sorted(p.name for p in inbox.iterdir()) == sorted(defects)
    assert sorted(p.name for p in archive.iterdir()) == [earlier, f"{earlier}.outcome.json"]
    # Nothing changed in the inbox: the next tick asks for nothing.
    assert sensor.tick().run_requests == []


def test_a_waybill_line_another_file_delivered_is_quarantined_naming_that_file(
    pg_warehouse_url, sensor, inbox
):
    first_lines, later_lines = report_lines(10, 1), report_lines(10, 2)
    first = drop(inbox, "Склад А.csv", csv_file(first_lines))
    assert sensor.run_new_versions()[first].success
    stored = physical_rows(pg_warehouse_url, "Склад А.csv")
    # The later file repeats a line of the first one's (another quantity), as its 5th row.
    claimed = dataclasses.replace(first_lines[6], quantity=Decimal("77.000"))
    content = csv_file([*later_lines[:4], claimed, *later_lines[4:]], title_rows=TITLE_ROWS)
    later = drop(inbox, "Склад Б.csv", content)

    [result] = sensor.run_new_versions().values()

    assert result.success, step_failure_message(sensor.instance, result.run_id)
    assert sensor.instance.get_run_by_id(result.run_id).tags[STATUS_TAG] == "partial"
    assert physical_rows(pg_warehouse_url, "Склад А.csv") == stored
    assert exact(delivery_rows(pg_warehouse_url, "Склад Б.csv")) == exact(sorted_rows(
        expected_table(later_lines, "Склад Б.csv", later)))
    [rejected] = quarantined(pg_warehouse_url, later)
    assert "Склад А.csv" in rejected["reason"], rejected["reason"]
    assert claimed.waybill in rejected["reason"]
    assert load_metadata(sensor.instance, result.run_id)["rejected"] == 1

    # Re-processed as it is (from the archive): the line is still held by the first file, so
    # it is still quarantined; an identical re-load must not lose it from the quarantine.
    again = sensor.run(later)
    assert again.success, step_failure_message(sensor.instance, again.run_id)
    assert [q["reason"] for q in quarantined(pg_warehouse_url, later)] == [rejected["reason"]]
    assert load_metadata(sensor.instance, again.run_id)["rejected"] == 1
    assert physical_rows(pg_warehouse_url, "Склад А.csv") == stored


def test_quarantined_rows_name_the_row_of_the_file_they_came_from(
    pg_warehouse_url, sensor, inbox
):
    """An operator opens the file at the quarantined row's number. Rows the parser rejects are
    numbered as the spreadsheet numbers them; rows rejected after parsing (a waybill line held
    by another file, two rows of one key with different data) must be too, and their raw row
    must be readable (a date as a date, not epoch milliseconds)."""
    first_lines, lines = report_lines(10, 1), report_lines(24, 2)
    first = drop(inbox, "Склад А.csv", csv_file(first_lines))
    assert sensor.run_new_versions()[first].success
    held = dataclasses.replace(first_lines[6], quantity=Decimal("77.000"))
    conflicting = dataclasses.replace(lines[2], quantity=lines[2].quantity + 1)
    table = reports.report_table(
        [lines[0], lines[1], lines[2], lines[3], held, lines[4], conflicting, *lines[5:]])
    reports.set_cell(table, 1, "Количество", "много")  # a row the parser rejects
    version = drop(inbox, "Склад Б.csv", reports.csv_report(table, title_rows=TITLE_ROWS))

    [result] = sensor.run_new_versions().values()

    assert result.success, step_failure_message(sensor.instance, result.run_id)
    row = reports.first_data_row_number(TITLE_ROWS)  # the first data row's number
    wanted = [(row + 1, "is not a number"), (row + 2, "shares its natural key"),
              (row + 4, "already held by Склад А.csv"), (row + 6, "shares its natural key")]
    rejected = quarantined(pg_warehouse_url, version)
    found = sorted((q["row_number"], next((w for _, w in wanted if w in q["reason"]),
                                          q["reason"])) for q in rejected)
    assert found == wanted, found
    [held_row] = [q for q in rejected if "already held" in q["reason"]]
    assert any(day in held_row["raw_row"] for day in (
        held.delivery_date.strftime("%d.%m.%Y"), held.delivery_date.isoformat())), held_row[
        "raw_row"]


LONG_NAME = "Отчёт о поставках материалов на объект МСК-ЖК-014 за ноябрь 2026 (исправленный).xlsx"


def test_a_report_with_a_long_russian_name_loads_and_is_archived(
    pg_warehouse_url, sensor, inbox, archive
):
    """Sites name their exports in words; 85 characters is an ordinary name (the filesystem
    allows 255 bytes, ~120 Cyrillic characters)."""
    lines = report_lines(5, 1)
    content = xlsx_file(lines, Layout(dates="cell"))
    version = drop(inbox, LONG_NAME, content)
    [result] = sensor.run_new_versions().values()
    assert result.success, step_failure_message(sensor.instance, result.run_id)
    assert delivery_rows(pg_warehouse_url) == sorted_rows(expected_table(lines, LONG_NAME,
                                                                         version))
    assert list(inbox.iterdir()) == []
    assert (archive / version).read_bytes() == content


# Real processes: `dagster job execute` and `mostovik jobs rerun`, as an operator runs them.


def _process_env(tmp_path: Path, warehouse_url: str, standin_server) -> dict[str, str]:
    inbox, archive = inbox_dirs(tmp_path)
    return {**run_environment(tmp_path, warehouse_url, standin_server.cbr_url),
            "MOSTOVIK_INBOX_DIR": str(inbox), "MOSTOVIK_ARCHIVE_DIR": str(archive)}


def _job_execute(version: str, env: dict[str, str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [DAGSTER, "job", "execute", "-m", "mostovik_pipelines", "-j", JOB,
         "--tags", json.dumps({"dagster/partition": version})],
        env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finished(process: subprocess.Popen, timeout: float = 180) -> str:
    output, _ = process.communicate(timeout=timeout)
    assert process.returncode == 0, output[-3000:]
    return output


def _mostovik(env: dict[str, str], *args: str) -> str:
    done = subprocess.run([MOSTOVIK, *args], env=env, capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    return done.stdout


def _runs_of(instance: DagsterInstance, version: str):
    """The runs of a file version, oldest first."""
    runs = instance.get_runs()
    return [r for r in reversed(runs) if r.tags.get("dagster/partition") == version]


@pytest.mark.slow
@pytest.mark.timeout(900)  # the daemon started for the queued re-run
def test_reprocessing_an_archived_file_on_purpose_succeeds_and_rewrites_nothing(
    pg_warehouse_url, standin_server, tmp_path, inbox, archive
):
    env = _process_env(tmp_path, pg_warehouse_url, standin_server)
    lines = report_lines(40, 4)
    with DagsterInstance.from_config(env["DAGSTER_HOME"]) as instance:
        sensor = _sensor(pg_warehouse_url, standin_server, tmp_path, instance)
        version = drop(inbox, "Поставки ноябрь.csv", csv_file(lines))
        assert sensor.run_new_versions()[version].success
        assert list(inbox.iterdir()) == []
        assert (archive / version).exists()
        stored = physical_rows(pg_warehouse_url)
        assert len(stored) == 40
        [first] = _runs_of(instance, version)

        # Queued: the daemon launches each re-run; --wait follows it to its end.
        with run_queue_daemon(env, tmp_path / "daemon"):
            by_id = _mostovik(env, "jobs", "rerun", first.run_id, "--wait")
            by_period = _mostovik(env, "jobs", "rerun", "--source", "material_deliveries",
                                  "--period", version, "--wait")

        again, fresh = _runs_of(instance, version)[1:]
    assert by_id.split() == [again.run_id, "completed"]
    assert by_period.split() == [fresh.run_id, "completed"]
    assert again.parent_run_id == first.run_id
    for run in (again, fresh):
        assert run.status == DagsterRunStatus.SUCCESS
        assert run.tags[STATUS_TAG] == "completed"
    # An identical re-load rewrites no row: ctid and xmin unchanged.
    assert physical_rows(pg_warehouse_url) == stored
    assert exact(delivery_rows(pg_warehouse_url)) == exact(sorted_rows(expected_table(
        lines, "Поставки ноябрь.csv", version)))
    assert list(inbox.iterdir()) == []
    note = json.loads((archive / f"{version}.outcome.json").read_text())
    assert note["run_id"] == fresh.run_id and note["outcome"] == "loaded"


@pytest.mark.slow
def test_two_versions_of_one_file_loading_at_once_never_mix(
    pg_warehouse_url, standin_server, tmp_path, inbox
):
    """The first version (archived) is re-processed while the corrected one loads, in two
    `dagster job execute` processes started together: the table ends up holding one version's
    rows exactly, the newer one (an older version is never loaded over a newer)."""
    env = _process_env(tmp_path, pg_warehouse_url, standin_server)
    first_lines = report_lines(3000, 5)
    second_lines = [dataclasses.replace(line, price=line.price + Decimal("0.01"))
                    for line in corrected(first_lines)]
    with DagsterInstance.from_config(env["DAGSTER_HOME"]) as instance:
        sensor = _sensor(pg_warehouse_url, standin_server, tmp_path, instance)
        first = drop(inbox, "Поставки.csv", csv_file(first_lines))
        assert sensor.run_new_versions()[first].success
        second = drop(inbox, "Поставки.csv", csv_file(second_lines))
        assert [r.partition_key for r in sensor.tick().run_requests] == [second]

        processes = [_job_execute(version, env, tmp_path) for version in (first, second)]
        outputs = [_finished(process) for process in processes]

        statuses = {version: [r.tags.get(STATUS_TAG) for r in _runs_of(instance, version)]
                    for version in (first, second)}
    rows = exact(delivery_rows(pg_warehouse_url))
    versions = {row[-1] for row in rows}
    assert len(versions) == 1, f"two versions mixed: {versions}; runs {statuses}"
    assert rows == exact(sorted_rows(expected_table(second_lines, "Поставки.csv", second))), (
        statuses, [o[-1500:] for o in outputs])
