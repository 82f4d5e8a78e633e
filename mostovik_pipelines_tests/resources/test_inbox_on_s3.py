"""The delivery reports inbox and its archive on object storage (``s3://`` prefixes of an S3 API
server, moto's, behind the test front that counts requests): a version per object version (ETag
and size, from the listing), an upload in progress never seen, reads of exactly the listed
version, the archive by copy-then-delete that loses nothing when a newer upload lands meanwhile
or the move is cut short, and a sensor tick that costs one listing however many files wait.
"""

from __future__ import annotations

import json

import pytest
from dagster import DagsterInstance
from s3fs import S3FileSystem

from mostovik_pipelines.core.errors import ConfigurationError, PermanentError
from mostovik_pipelines.resources.inbox import InboxResource, version_key
from mostovik_pipelines.resources.inbox_objects import ObjectStoreInbox, version_hash
from mostovik_pipelines.sources import material_deliveries
from mostovik_pipelines_tests.support import delivery_reports as reports
from mostovik_pipelines_tests.support.inbox import (
    InboxSensor,
    delivery_rows,
    exact,
    expected_table,
    renumbered,
    sorted_rows,
)
from mostovik_pipelines_tests.support.locations import code_location_for
from mostovik_pipelines_tests.support.object_store import why_no_s3_api
from mostovik_pipelines_tests.support.object_store_front import S3Front
from mostovik_pipelines_tests.support.processes import local_dagster_home

BUCKET = "mostovik-inbox"
NAME = "Поставки МСК-ЖК-014 ноябрь.csv"
WAITING = 8


@pytest.fixture
def front(monkeypatch):
    if reason := why_no_s3_api():
        pytest.skip(reason)
    server = S3Front().start()
    for name, value in server.environment.items():
        monkeypatch.setenv(name, value)
    S3FileSystem.clear_instance_cache()
    server.bucket(BUCKET)
    try:
        yield server
    finally:
        server.close()
        S3FileSystem.clear_instance_cache()


@pytest.fixture
def inbox(front) -> InboxResource:
    return InboxResource(inbox_dir=f"s3://{BUCKET}/in", archive_dir=f"s3://{BUCKET}/archive")


def upload(front: S3Front, name: str, content: bytes) -> str:
    """Upload ``content`` as ``name`` as a back office does (one PUT); its version key."""
    answer = front.buckets.client.put_object(Bucket=BUCKET, Key=f"in/{name}", Body=content)
    return version_key(name, version_hash(answer["ETag"], len(content)))


def report(seed: int, count: int = 12) -> tuple[list, bytes]:
    lines = renumbered(reports.deliveries(count, seed=seed), 800_000 + 1000 * seed)
    return lines, reports.csv_report(reports.report_table(lines))


def _keys(front: S3Front, prefix: str) -> set[str]:
    return front.buckets.objects(BUCKET, prefix)


def test_a_version_is_the_objects_etag_and_size_and_an_upload_in_progress_is_not_seen(
        front, inbox):
    _, content = report(1)
    first = upload(front, NAME, content)
    assert upload(front, NAME, content) == first, "the same bytes again: the same version"
    client = front.buckets.client
    started = client.create_multipart_upload(Bucket=BUCKET, Key="in/in-progress.csv")
    client.upload_part(Bucket=BUCKET, Key="in/in-progress.csv", PartNumber=1,
                       UploadId=started["UploadId"], Body=b"x" * (5 << 20))
    client.put_object(Bucket=BUCKET, Key="in/.hidden.csv", Body=b"x")
    client.put_object(Bucket=BUCKET, Key="in/report.csv.part", Body=b"x")
    client.put_object(Bucket=BUCKET, Key="in/sub/report.csv", Body=b"x")

    [seen] = list(inbox.files())
    assert (seen.name, seen.size) == (NAME, len(content))
    assert version_key(seen.name, inbox.version_hash(seen)) == first
    _, corrected = report(2)
    assert upload(front, NAME, corrected) != first, "a corrected upload: a new version"


def test_a_version_is_read_as_listed_or_from_the_archive_never_a_newer_upload(front, inbox):
    _, content = report(1)
    first = upload(front, NAME, content)
    assert inbox.read_version(first)[0] == content
    _, corrected = report(2)
    second = upload(front, NAME, corrected)
    with pytest.raises(PermanentError, match="neither in the inbox"):
        inbox.read_version(first)
    assert inbox.read_version(second)[0] == corrected


def test_archiving_copies_then_deletes_and_keeps_when_it_was_uploaded(front, inbox):
    _, content = report(1)
    version = upload(front, NAME, content)
    uploaded_at = inbox.read_version(version)[1]
    inbox.archive(version, "completed", "run-1")
    assert _keys(front, "in/") == set()
    assert _keys(front, "archive/") == {f"archive/{version}", f"archive/{version}.outcome.json"}
    note = json.loads(front.buckets.client.get_object(
        Bucket=BUCKET, Key=f"archive/{version}.outcome.json")["Body"].read())
    assert (note["version"], note["outcome"], note["run_id"]) == (version, "completed", "run-1")
    # Re-processing reads the archived bytes, with the time of the upload, not of the copy.
    assert inbox.read_version(version) == (content, uploaded_at)


def test_an_upload_landing_before_the_archive_stays_in_the_inbox(front, inbox):
    _, content = report(1)
    version = upload(front, NAME, content)
    _, corrected = report(2)
    newer = upload(front, NAME, corrected)
    inbox.archive(version, "completed", "run-1")
    assert _keys(front, "in/") == {f"in/{NAME}"}
    assert inbox.read_version(newer)[0] == corrected
    assert _keys(front, "archive/") == set(), "the loaded version was replaced: nothing moved"


def test_an_upload_landing_between_the_copy_and_the_delete_is_not_deleted(front, inbox,
                                                                         monkeypatch):
    _, content = report(1)
    version = upload(front, NAME, content)
    _, corrected = report(2)
    call_s3 = S3FileSystem.call_s3

    def upload_before_the_delete(fs, method, *args, **kwargs):
        if method == "delete_object":
            upload(front, NAME, corrected)
        return call_s3(fs, method, *args, **kwargs)

    monkeypatch.setattr(S3FileSystem, "call_s3", upload_before_the_delete)
    inbox.archive(version, "completed", "run-1")
    assert front.buckets.client.get_object(
        Bucket=BUCKET, Key=f"in/{NAME}")["Body"].read() == corrected
    assert f"archive/{version}" in _keys(front, "archive/")


def test_an_archive_cut_short_after_the_copy_loses_nothing_and_the_next_one_finishes(
        front, inbox, monkeypatch):
    _, content = report(1)
    version = upload(front, NAME, content)
    call_s3 = S3FileSystem.call_s3

    def killed_before_the_delete(fs, method, *args, **kwargs):
        if method == "delete_object":
            raise KeyboardInterrupt  # the process dies here
        return call_s3(fs, method, *args, **kwargs)

    with monkeypatch.context() as patched:
        patched.setattr(S3FileSystem, "call_s3", killed_before_the_delete)
        with pytest.raises(KeyboardInterrupt):
            inbox.archive(version, "completed", "run-1")
    assert _keys(front, "in/") == {f"in/{NAME}"}
    assert f"archive/{version}" in _keys(front, "archive/")
    [seen] = list(inbox.files())
    assert version_key(seen.name, inbox.version_hash(seen)) == version, "no new version"
    inbox.archive(version, "completed", "run-2")
    assert _keys(front, "in/") == set()
    assert inbox.read_version(version)[0] == content


def test_the_sensor_lists_the_inbox_once_a_tick_and_reads_no_file(
        front, inbox, sqlite_warehouse_url, standin_server, tmp_path):
    """Eight reports waiting: a tick asks for eight runs after one request to the store (the
    listing), and the runs load them through the bucket."""
    location = code_location_for(sqlite_warehouse_url, standin_server, tmp_path,
                                 [material_deliveries.SOURCE],
                                 material_deliveries_source=inbox)
    expected = []
    for number in range(WAITING):
        lines, content = report(number, count=3)
        name = f"site-{number:02}.csv"
        version = upload(front, name, content)
        expected += expected_table(lines, name, version)
    with DagsterInstance.from_config(str(local_dagster_home(tmp_path))) as instance:
        sensor = InboxSensor(location, instance, inbox)
        before = sum(front.requests.values())
        result = sensor.tick()
        assert sum(front.requests.values()) - before == 1, front.requests
        assert len(result.run_requests) == WAITING
        before = sum(front.requests.values())
        assert sensor.tick().run_requests == [], "nothing new"
        assert sum(front.requests.values()) - before == 1
        for request in result.run_requests:
            assert sensor.run(request.partition_key).success
    assert exact(delivery_rows(sqlite_warehouse_url)) == exact(sorted_rows(expected))
    assert _keys(front, "in/") == set()


def test_an_inbox_and_archive_of_two_kinds_is_a_configuration_error(front, tmp_path):
    mixed = InboxResource(inbox_dir=f"s3://{BUCKET}/in", archive_dir=str(tmp_path / "archive"))
    with pytest.raises(ConfigurationError, match="MOSTOVIK_ARCHIVE_DIR"):
        list(mixed.files())


def test_an_object_store_inbox_over_a_missing_bucket_is_refused(front):
    inbox = ObjectStoreInbox("s3://no-such-bucket/in", "s3://no-such-bucket/archive")
    with pytest.raises(FileNotFoundError):
        list(inbox.listing())
