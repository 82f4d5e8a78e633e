"""The delivery reports inbox on object storage under the production layout
(:mod:`.support.production_layout`): the inbox and the archive are ``s3://`` prefixes of an S3 API
server, the sensor runs in the one code server, the daemon launches the runs, their steps run on
two Celery worker hosts; the hosts share no directory, only PostgreSQL, Redis and the buckets.
A back office uploads through the S3 API, as a held-out set of uploads would come: a new file, the
same bytes again, a corrected version, a file with a bad row, and an upload still in progress.
Observed as an operator observes it: the sensor's ticks and the runs over GraphQL, the warehouse,
the buckets.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from mostovik_pipelines import definitions
from mostovik_pipelines.resources.inbox import version_key
from mostovik_pipelines.resources.inbox_objects import version_hash
from mostovik_pipelines.standin import StandinServer
from mostovik_pipelines_tests.support import delivery_reports as reports
from mostovik_pipelines_tests.support.graphql import RunInfo
from mostovik_pipelines_tests.support.inbox import (
    JOB,
    SENSOR,
    delivery_rows,
    exact,
    expected_table,
    quarantined,
    renumbered,
    sorted_rows,
    wait_for_tick_asking_after,
    wait_for_ticks_after,
)
from mostovik_pipelines_tests.support.instances import fresh_warehouse
from mostovik_pipelines_tests.support.object_store import why_no_s3_api
from mostovik_pipelines_tests.support.postgres import ThrowawayPostgres
from mostovik_pipelines_tests.support.production_layout import ProductionLayout, production_layout
from mostovik_pipelines_tests.support.waiting import limit_for

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

BUCKET = "mostovik-inbox"
SENSOR_INTERVAL_SECONDS = 3
TICKS_LIMIT_SECONDS = limit_for(SENSOR_INTERVAL_SECONDS, ticks=2)
SITE_REPORT = "Поставки МСК-ЖК-014 ноябрь.csv"
BAD_ROW_REPORT = "kzn-most-07_november.csv"
UPLOADING = "spb-bc-003_november.csv"
PART_BYTES = 5 << 20
"""S3's smallest part but the last: an upload of two parts is one in progress until completed."""


@pytest.fixture(scope="module")
def layout(postgres: ThrowawayPostgres, standin_server: StandinServer,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProductionLayout]:
    if reason := why_no_s3_api():
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("inbox_on_s3")
    with fresh_warehouse(postgres, "wh_inbox_on_s3") as warehouse_url, production_layout(
        root, postgres, {
            "MOSTOVIK_DATABASE_URL": warehouse_url,
            "MOSTOVIK_CBR_URL": standin_server.cbr_url,
            "MOSTOVIK_ERP_URL": standin_server.erp_url,
            "MOSTOVIK_INBOX_DIR": f"s3://{BUCKET}/inbox",
            "MOSTOVIK_ARCHIVE_DIR": f"s3://{BUCKET}/archive",
            "MOSTOVIK_INBOX_SENSOR_INTERVAL_SECONDS": str(SENSOR_INTERVAL_SECONDS),
        }, buckets=(BUCKET,), database="dagster_inbox_on_s3",
            stopped_schedules=[s.name for s in definitions.defs.schedules or ()],
    ) as running:
        yield running


def _upload(layout: ProductionLayout, name: str, content: bytes) -> str:
    answer = layout.store.buckets.client.put_object(Bucket=BUCKET, Key=f"inbox/{name}",
                                                    Body=content)
    return version_key(name, version_hash(answer["ETag"], len(content)))


def _runs_of(layout: ProductionLayout, version: str) -> list[RunInfo]:
    return layout.services.graphql.runs(
        {"tags": [{"key": "dagster/partition", "value": version}]})


def _upload_and_wait_for_its_run(layout: ProductionLayout, name: str, content: bytes,
                                 status: str = "completed") -> tuple[str, RunInfo]:
    uploaded_at = time.time()
    version = _upload(layout, name, content)
    tick = wait_for_tick_asking_after(layout.services, uploaded_at, TICKS_LIMIT_SECONDS)
    [run] = _runs_of(layout, version)
    assert tick.run_ids == [run.run_id], (tick, run)
    finished = layout.services.graphql.wait_for_run(run.run_id)
    assert finished.status == "SUCCESS", layout.services.graphql.run_errors(run.run_id)
    assert finished.tags.get("dagster/sensor_name") == SENSOR
    assert finished.tags.get("mostovik/status") == status
    return version, finished


def _objects(layout: ProductionLayout, prefix: str) -> set[str]:
    return layout.store.buckets.objects(BUCKET, prefix)


def test_uploads_through_the_s3_api_load_on_celery_workers_sharing_no_directory(layout):
    graphql = layout.services.graphql
    warehouse_url = layout.shared["MOSTOVIK_DATABASE_URL"]
    assert graphql.repository_contents().sensors.get(SENSOR) == "RUNNING"

    # A new file: its version runs on a worker, loads, and moves to the archive.
    lines = renumbered(reports.deliveries(15, seed=21), 910_000)
    first, run = _upload_and_wait_for_its_run(layout, SITE_REPORT, reports.csv_report(
        reports.report_table(lines), encoding="windows-1251"))
    assert exact(delivery_rows(warehouse_url, SITE_REPORT)) == exact(sorted_rows(
        expected_table(lines, SITE_REPORT, first)))
    assert _objects(layout, "inbox/") == set()
    assert {f"archive/{first}", f"archive/{first}.outcome.json"} <= _objects(layout, "archive/")

    # The same bytes again: the sensor asks under the same run key, the daemon launches nothing.
    again_at = time.time()
    assert _upload(layout, SITE_REPORT, reports.csv_report(
        reports.report_table(lines), encoding="windows-1251")) == first
    seen = wait_for_tick_asking_after(layout.services, again_at, TICKS_LIMIT_SECONDS)
    assert seen.run_keys == [run.tags["dagster/run_key"]] and seen.run_ids == [], seen

    # A corrected version under the same name: a new version, which replaces the file's rows.
    corrected = [*lines[:3], *lines[4:]]
    second, _ = _upload_and_wait_for_its_run(layout, SITE_REPORT, reports.csv_report(
        reports.report_table(corrected)))
    assert second != first
    assert exact(delivery_rows(warehouse_url, SITE_REPORT)) == exact(sorted_rows(
        expected_table(corrected, SITE_REPORT, second)))
    assert [r.run_id for r in _runs_of(layout, first)] == [run.run_id], "the same bytes ran once"

    # A bad row: the rest loads, the row waits in quarantine with its reason, the run is partial.
    bad_lines = renumbered(reports.deliveries(8, seed=22), 920_000)
    table = reports.report_table(bad_lines)
    reports.set_cell(table, 2, "Количество", "двенадцать")
    bad, _ = _upload_and_wait_for_its_run(layout, BAD_ROW_REPORT, reports.csv_report(table),
                                          status="partial")
    loaded = {(row["waybill"], row["line_no"]) for row in delivery_rows(warehouse_url,
                                                                       BAD_ROW_REPORT)}
    assert len(loaded) == len(bad_lines) - 1
    [rejected] = quarantined(warehouse_url, bad)
    assert "двенадцать" in rejected["reason"], rejected

    # An upload in progress (a multipart upload not completed yet) is not seen, tick after tick.
    client = layout.store.buckets.client
    upload_lines = renumbered(reports.deliveries(6, seed=23), 930_000)
    content = reports.csv_report(reports.report_table(upload_lines))
    started_at = time.time()
    started = client.create_multipart_upload(Bucket=BUCKET, Key=f"inbox/{UPLOADING}")
    parts = [client.upload_part(Bucket=BUCKET, Key=f"inbox/{UPLOADING}", PartNumber=1,
                                UploadId=started["UploadId"],
                                Body=content.ljust(PART_BYTES, b"\n"))]
    ticks = wait_for_ticks_after(layout.services, started_at, 2, TICKS_LIMIT_SECONDS)
    assert all(not tick.run_keys for tick in ticks), ticks
    assert not [r for r in graphql.runs({"pipelineName": JOB})
                if r.tags.get("dagster/partition", "").startswith(UPLOADING)]
    completed_at = time.time()
    parts.append(client.upload_part(Bucket=BUCKET, Key=f"inbox/{UPLOADING}", PartNumber=2,
                                    UploadId=started["UploadId"], Body=b"\n"))
    answer = client.complete_multipart_upload(
        Bucket=BUCKET, Key=f"inbox/{UPLOADING}", UploadId=started["UploadId"],
        MultipartUpload={"Parts": [{"ETag": part["ETag"], "PartNumber": number}
                                   for number, part in enumerate(parts, start=1)]})
    size = client.head_object(Bucket=BUCKET, Key=f"inbox/{UPLOADING}")["ContentLength"]
    version = version_key(UPLOADING, version_hash(answer["ETag"], size))
    tick = wait_for_tick_asking_after(layout.services, completed_at, TICKS_LIMIT_SECONDS)
    [run] = _runs_of(layout, version)
    assert tick.run_ids == [run.run_id]
    assert graphql.wait_for_run(run.run_id).status == "SUCCESS", graphql.run_errors(run.run_id)
    assert exact(delivery_rows(warehouse_url, UPLOADING)) == exact(sorted_rows(
        expected_table(upload_lines, UPLOADING, version)))

    # The steps ran on the workers, and no host kept an inbox or archive of its own.
    assert any(worker.succeeded_task_ids() for worker in layout.workers.values())
    for host in [layout.orchestrator, *layout.hosts.values()]:
        assert not [path for path in host.disk.rglob("*")
                    if path.name in ("inbox", "archive")], host.name
