"""The inbox sensor, evaluated as the daemon evaluates it (its cursor kept between ticks, the
partitions it asks for added): one partition and one run request per new file version, keyed by
the version's content hash; an unchanged inbox costs a directory read and opens no file."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import time
from datetime import timedelta

import pytest
from dagster import AddDynamicPartitionsRequest

from mostovik_pipelines.core.outages import Store, setting_of
from mostovik_pipelines.core.tags import REQUESTED_BECAUSE_TAG
from mostovik_pipelines.framework.spec import CatchUpPolicy
from mostovik_pipelines.resources.inbox import InboxResource
from mostovik_pipelines.sources import material_deliveries
from mostovik_pipelines_tests.support import delivery_reports as reports
from mostovik_pipelines_tests.support.inbox import (
    PARTITIONS,
    InboxSensor,
    drop,
    inbox_dirs,
    inbox_resource,
    version_of,
)
from mostovik_pipelines_tests.support.locations import FAST_RETRY, code_location_for
from mostovik_pipelines_tests.support.postgres import free_port

MANY_FILES = 10_000


@pytest.fixture
def inbox(tmp_path):
    return inbox_dirs(tmp_path)[0]


@pytest.fixture
def sensor(tmp_path, standin_server, instance) -> InboxSensor:
    """The sensor of the code location; it never touches the warehouse (not even created)."""
    resource = inbox_resource(tmp_path)
    location = code_location_for(f"sqlite:///{tmp_path / 'unused.sqlite'}", standin_server,
                                 tmp_path, [material_deliveries.SOURCE],
                                 material_deliveries_source=resource)
    return InboxSensor(location, instance, resource)


@pytest.fixture
def hashed(monkeypatch) -> list[str]:
    """The names of the files the sensor hashes (opens), in order."""
    names: list[str] = []
    real = InboxResource.content_hash

    def counting(self, name):
        names.append(name)
        return real(self, name)

    monkeypatch.setattr(InboxResource, "content_hash", counting)
    return names


def _requests(result) -> list[tuple[str, str]]:
    return [(r.partition_key, r.run_key) for r in result.run_requests]


def test_a_new_file_becomes_one_partition_and_one_run_keyed_by_its_content_hash(
    sensor, inbox, hashed
):
    content = "Дата поставки;Объект\n01.11.2026;МСК-ЖК-014\n".encode("windows-1251")
    version = drop(inbox, "Поставки ноябрь.csv", content)

    result = sensor.tick()

    digest = hashlib.sha256(content).hexdigest()
    assert version == f"Поставки ноябрь.csv@{digest[:12]}"
    assert _requests(result) == [(version, digest)]
    assert result.run_requests[0].job_name in (None, "material_deliveries_job")
    assert result.dynamic_partitions_requests == [
        AddDynamicPartitionsRequest(PARTITIONS, [version])]
    assert sensor.instance.get_dynamic_partitions(PARTITIONS) == [version]
    assert hashed == ["Поставки ноябрь.csv"]


def test_an_unchanged_inbox_asks_for_nothing_and_opens_no_file(sensor, inbox, hashed):
    for index in range(5):
        drop(inbox, f"report_{index}.csv", f"rows {index}\n".encode())
    assert len(sensor.tick().run_requests) == 5
    hashed.clear()

    for _ in range(3):
        result = sensor.tick()
        assert result.run_requests == [] and result.dynamic_partitions_requests == []
    assert hashed == [], "an unchanged file was opened"
    assert len(sensor.instance.get_dynamic_partitions(PARTITIONS)) == 5


def test_a_changed_file_under_the_same_name_is_a_new_version(sensor, inbox, hashed):
    first = drop(inbox, "Поставки.csv", b"first version\n")
    drop(inbox, "other.csv", b"another report\n")
    sensor.tick()
    hashed.clear()

    second = drop(inbox, "Поставки.csv", b"corrected version\n")
    result = sensor.tick()

    assert second != first
    assert _requests(result) == [(second, hashlib.sha256(b"corrected version\n").hexdigest())]
    assert result.dynamic_partitions_requests == [AddDynamicPartitionsRequest(PARTITIONS,
                                                                              [second])]
    assert hashed == ["Поставки.csv"], "only the changed file is hashed"
    assert set(sensor.instance.get_dynamic_partitions(PARTITIONS)) == {
        first, second, version_of("other.csv", b"another report\n")}


def test_a_file_touched_but_not_changed_asks_for_its_version_again(sensor, inbox):
    """A new modification time makes the sensor hash the file again; the bytes are the same, so
    its request repeats the version's run key and the daemon launches nothing."""
    version = drop(inbox, "Поставки.csv", b"same bytes\n")
    [(_, run_key)] = _requests(sensor.tick())
    stat = (inbox / "Поставки.csv").stat()
    os.utime(inbox / "Поставки.csv", ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    result = sensor.tick()
    assert _requests(result) == [(version, run_key)]
    assert result.dynamic_partitions_requests == []


def test_after_a_cursor_reset_the_same_requests_come_again_and_no_partition_twice(
    sensor, inbox
):
    for index in range(3):
        drop(inbox, f"report_{index}.csv", f"rows {index}\n".encode())
    first = sensor.tick()
    partitions = sensor.instance.get_dynamic_partitions(PARTITIONS)

    sensor.cursor = None  # an operator resets the cursor in the UI
    again = sensor.tick()

    # The same run keys: the daemon skips a run request whose run key it already launched, so
    # nothing runs twice (a direct sensor call, as here, does not deduplicate).
    assert _requests(again) == _requests(first)
    assert again.dynamic_partitions_requests == []
    assert sensor.instance.get_dynamic_partitions(PARTITIONS) == partitions


def test_uploads_in_progress_and_hidden_files_are_not_asked_for_until_renamed(sensor, inbox):
    inbox.mkdir(parents=True, exist_ok=True)
    (inbox / "Поставки.csv.part").write_bytes(b"half of it")
    (inbox / "~$Поставки.xlsx").write_bytes(b"lock")
    (inbox / ".Поставки.csv.swp").write_bytes(b"swap")
    assert sensor.tick().run_requests == []

    (inbox / "Поставки.csv.part").write_bytes(b"all of it\n")
    os.replace(inbox / "Поставки.csv.part", inbox / "Поставки.csv")
    assert _requests(sensor.tick()) == [
        (version_of("Поставки.csv", b"all of it\n"), hashlib.sha256(b"all of it\n").hexdigest())]


def test_a_file_gone_before_it_is_hashed_is_asked_for_next_time(sensor, inbox, monkeypatch):
    drop(inbox, "Поставки.csv", b"rows\n")
    real = InboxResource.content_hash

    def vanished(self, name):
        raise FileNotFoundError(name)

    monkeypatch.setattr(InboxResource, "content_hash", vanished)
    assert sensor.tick().run_requests == []
    monkeypatch.setattr(InboxResource, "content_hash", real)
    assert len(sensor.tick().run_requests) == 1


def test_a_tick_over_ten_thousand_waiting_files_none_new_reads_none_of_them(
    sensor, inbox, hashed
):
    """Its time is a ``make bench`` figure (benchmarks/files.py); here, what keeps it short."""
    inbox.mkdir(parents=True)
    for index in range(MANY_FILES):
        (inbox / f"Поставки {index:05d}.csv").write_bytes(f"report {index}\n".encode())
    started = time.perf_counter()
    first = sensor.tick()
    first_tick = time.perf_counter() - started
    assert len(first.run_requests) == MANY_FILES
    assert len(sensor.instance.get_dynamic_partitions(PARTITIONS)) == MANY_FILES
    hashed.clear()

    timings = []
    for _ in range(3):
        started = time.perf_counter()
        result = sensor.tick()
        timings.append(time.perf_counter() - started)
        assert result.run_requests == [] and result.dynamic_partitions_requests == []
    assert hashed == []
    print(f"\ninbox sensor, {MANY_FILES:,} files: first tick (hashes all, adds partitions) "
          f"{first_tick:.2f} s; ticks with none new {', '.join(f'{t:.3f}' for t in timings)} s; "
          f"cursor {len(sensor.cursor or ''):,} characters")


def test_a_version_whose_run_failed_on_a_transient_error_is_asked_for_again_once_per_failure(
        tmp_path, standin_server, instance, inbox, monkeypatch):
    """The warehouse away past the run's budget: the version is asked for again (after the
    source's backoff, none here) by the sensor, with a run key of that failure and the reason."""
    monkeypatch.setenv(setting_of(Store.WAREHOUSE), "1")
    source = dataclasses.replace(
        material_deliveries.SOURCE, extract_retry=FAST_RETRY, load_retry=FAST_RETRY,
        catch_up=CatchUpPolicy(backoff=timedelta(0)))
    resource = inbox_resource(tmp_path)
    away = f"postgresql+psycopg://mostovik@127.0.0.1:{free_port()}/warehouse"
    sensor = InboxSensor(code_location_for(away, standin_server, tmp_path, [source],
                                           material_deliveries_source=resource),
                         instance, resource)
    version = drop(inbox, "Поставки ноябрь.csv",
                   reports.csv_report(reports.report_table(reports.deliveries(3))))
    (first,) = sensor.tick().run_requests
    assert first.tags[REQUESTED_BECAUSE_TAG] == "new_file"
    failed = sensor.run(version)
    assert not failed.success

    (again,) = sensor.tick().run_requests
    assert (again.partition_key, again.run_key, again.tags[REQUESTED_BECAUSE_TAG]) == (
        version, f"after:{failed.run_id}", "after_failure")
