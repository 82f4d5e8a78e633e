"""Bad and hostile input, for every source: each case of ``corpus/<source>/`` is served through
the stand-in to a real run of the source's job, after a clean load of the partition, or (a file
source, route ``inbox``) dropped into the inbox as a file of its own, its version the partition,
after a clean load of a neighbour file. The run must end as the case expects (failed naming
source, partition and defect; partial with the rows quarantined; not available yet; or loaded as
data), and nothing already loaded may change beyond what the outcome allows. See
``corpus/README.md`` for the case format."""

from __future__ import annotations

import dataclasses
import json
from collections import Counter
from collections.abc import Iterator
from datetime import date
from decimal import Decimal
from pathlib import Path

import psycopg
import pytest
from dagster import (
    AssetCheckSeverity,
    AssetKey,
    AssetRecordsFilter,
    DagsterEventType,
    build_sensor_context,
)

from mostovik_pipelines.framework.quality.checks import SOURCE_SHAPE
from mostovik_pipelines.framework.quality.shape import CHANGE_KEY, FINGERPRINT_KEY, SHAPE_KEY
from mostovik_pipelines.framework.runs.alerts import alert_sensors
from mostovik_pipelines.resources.notifier import AlertNotifierResource
from mostovik_pipelines.sources import ALL_SOURCES
from mostovik_pipelines_tests.support.inbox import drop, inbox_dirs, inbox_resource
from mostovik_pipelines_tests.support.locations import FAST_RETRY, code_location_for
from mostovik_pipelines_tests.support.postgres import dsn_of
from mostovik_pipelines_tests.support.runs import run_partition, step_failure_message
from mostovik_pipelines_tests.support.webhook import WebhookReceiver, evaluate_run_failure_alerts

CORPUS = Path(__file__).parents[1] / "corpus"
OUTCOMES = {"failed", "partial", "not_available", "loaded"}
INBOX = "inbox"
"""The route of a file source: cases are dropped into its inbox instead of served over HTTP."""
SPECS = {spec.name: spec for spec in ALL_SOURCES}


@dataclasses.dataclass(frozen=True)
class Case:
    source: str
    name: str
    payload: Path
    expect: dict
    settings: dict

    @property
    def id(self) -> str:
        return f"{self.source}/{self.name}"


def corpus_cases() -> list[Case]:
    cases = []
    for folder in sorted(p for p in CORPUS.iterdir() if p.is_dir()):
        settings = json.loads((folder / "_source.json").read_text())
        for expectation in sorted(folder.glob("*.expect.json")):
            name = expectation.name.removesuffix(".expect.json")
            payloads = [p for p in folder.glob(f"{name}.*") if p != expectation]
            assert len(payloads) == 1, f"{folder.name}/{name}: expected one payload, {payloads}"
            cases.append(Case(folder.name, name, payloads[0],
                              json.loads(expectation.read_text()), settings))
    return cases


CASES = corpus_cases()


def _param(case: Case):
    marks = []
    if case.expect.get("known_bug"):
        reason = f"known bug: {case.expect['known_bug']}"
        marks.append(pytest.mark.xfail(strict=True, reason=reason))
    return pytest.param(case, id=case.id, marks=marks)


def test_every_source_has_a_corpus_and_every_case_is_well_formed():
    counts = Counter(case.source for case in CASES)
    print("\nbad-input corpus: " + ", ".join(f"{s}: {n} cases" for s, n in sorted(counts.items())))
    assert set(counts) == set(SPECS), f"sources without a corpus: {set(SPECS) - set(counts)}"
    for case in CASES:
        assert case.expect.get("outcome") in OUTCOMES, case.id
        if case.expect["outcome"] == "failed":
            assert case.expect.get("message"), f"{case.id}: a failure must name its defect"
        if case.expect["outcome"] == "partial":
            assert case.expect.get("quarantined"), case.id


@pytest.fixture
def warehouse_url(pg_warehouse_url):
    return pg_warehouse_url


@pytest.fixture
def webhook() -> Iterator[WebhookReceiver]:
    with WebhookReceiver() as receiver:
        yield receiver


@pytest.mark.parametrize("case", [_param(c) for c in CASES])
def test_bad_input_is_refused_cleanly_and_keeps_what_was_loaded(
    case: Case, warehouse_url, standin_server, standin, tmp_path, instance, webhook
):
    spec = dataclasses.replace(SPECS[case.source], extract_retry=FAST_RETRY,
                               load_retry=FAST_RETRY)
    inbox_route = case.settings["route"] == INBOX
    resources = {}
    if inbox_route and "max_file_bytes" in case.expect:
        resources[f"{spec.name}_source"] = inbox_resource(
            tmp_path, max_file_bytes=case.expect["max_file_bytes"])
    job = code_location_for(warehouse_url, standin_server, tmp_path, [spec],
                            **resources).resolve_job_def(f"{spec.name}_job")
    if inbox_route:
        result, partition, neighbour, before = _drop_into_the_inbox(case, spec, job, instance,
                                                                    warehouse_url, tmp_path)
    else:
        result, partition, neighbour, before = _serve_through_the_standin(
            case, spec, job, instance, warehouse_url, standin)
    after = _snapshot(warehouse_url, spec)
    outcome = case.expect["outcome"]
    if inbox_route:
        _check_the_inbox(case, tmp_path, partition)

    if outcome == "failed":
        assert not result.success, f"{case.id} should fail"
        message = step_failure_message(instance, result.run_id)
        for fragment in [f"{spec.name} [{partition}]", *case.expect["message"]]:
            assert fragment in message, f"{fragment!r} not in failure: {message}"
        assert after == before
        _check_the_shape(case, spec, job, instance, partition, standin, tmp_path, webhook,
                         warehouse_url, failed_run=result.run_id)
        return
    assert result.success, step_failure_message(instance, result.run_id)
    materialized = _materialized(instance, result.run_id)
    if outcome == "not_available":
        assert materialized == []
        assert after == before
        return

    [metadata] = materialized
    rows = _rows(warehouse_url, spec, partition)
    assert len(rows) == case.expect["loaded_rows"]
    assert _partition_rows(after, spec, neighbour) == _partition_rows(before, spec, neighbour)
    quarantined = [q for q in after["quarantine"] if q["partition_key"] == partition]
    expected = case.expect.get("quarantined", [])
    assert metadata["rejected"] == len(expected)
    assert len(quarantined) == len(expected), quarantined
    if outcome == "partial":
        # A rejected row is not an absent row: what was stored under its key stays.
        assert _keys(_partition_rows(before, spec, partition), spec) <= _keys(
            _partition_rows(after, spec, partition), spec)
    for row, wanted in zip(quarantined, expected, strict=True):
        assert row["row_number"] == wanted["row_number"]
        assert wanted["reason"] in row["reason"], row["reason"]
        assert row["raw_row"]
    for check in case.expect.get("values", []):
        [row] = [r for r in rows if all(r[k] == v for k, v in check["where"].items())]
        for column, value in check["equals"].items():
            assert _same(row[column], value), f"{column}: {row[column]!r} != {value!r}"
    _check_the_shape(case, spec, job, instance, partition, standin, tmp_path, webhook,
                     warehouse_url, materialized=metadata)


def _check_the_shape(case: Case, spec, job, instance, partition: str, standin, tmp_path: Path,
                     webhook: WebhookReceiver, warehouse_url: str,
                     materialized: dict | None = None,
                     failed_run: str | None = None) -> None:
    """A case of a changed shape (``shape`` in its expectation): the partition's observation
    names the change and what the source sends now, a loaded partition's materialisation shows
    it and its check ``source_shape`` warns, one alert names source, change and partition; a
    second partition sent the same shape is recorded again and alerts no more."""
    expected = case.expect.get("shape")
    if expected is None:
        return
    [observed] = _shape_observations(instance, spec, partition)
    assert observed[CHANGE_KEY] == expected["change"]
    for fragment in expected["sends"]:
        assert fragment in observed[SHAPE_KEY], observed[SHAPE_KEY]
    if materialized is not None:
        assert materialized[SHAPE_KEY] == observed[SHAPE_KEY]
        [check] = _check_evaluations(instance, spec, partition, SOURCE_SHAPE)
        assert (check.passed, check.severity) == (False, AssetCheckSeverity.WARN)
        assert expected["check"] in check.description, check.description
    if failed_run is not None:
        # Said by the shape alert instead.
        evaluate_run_failure_alerts(instance, failed_run, webhook, warehouse_url)
    tick = _shape_alert_sensor(instance, webhook, warehouse_url)
    [alert] = webhook.alerts
    assert (alert["kind"], alert["source"], alert["period"]) == (
        "source_shape", spec.name, partition)
    for fragment in expected["alert"]:
        assert fragment in alert["message"], alert["message"]

    second = _send_again(case, spec, job, instance, standin, tmp_path)
    [again] = _shape_observations(instance, spec, second)
    assert again[FINGERPRINT_KEY] == observed[FINGERPRINT_KEY]
    tick()
    assert len(webhook.alerts) == 1, webhook.alerts


def _send_again(case: Case, spec, job, instance, standin, tmp_path: Path) -> str:
    """The case's bytes sent for another partition (another file of the inbox): its key."""
    if case.settings["route"] == INBOX:
        partition = drop(inbox_dirs(tmp_path)[0], f"again_{case.payload.name}",
                         case.payload.read_bytes())
        instance.add_dynamic_partitions(spec.partitions_def.name, [partition])
    else:
        partition = case.settings["second"]
        standin.serve_bytes(case.payload.read_bytes(), route=case.settings["route"])
    result = run_partition(job, partition, instance)
    standin.clear_faults()
    assert result.success == (case.expect["outcome"] != "failed")
    return partition


def _shape_alert_sensor(instance, webhook: WebhookReceiver, warehouse_url: str):
    """Ticks the sensor source_shape_alerts as the daemon does, keeping its cursor; ticked
    once."""
    [sensor] = [s for s in alert_sensors(ALL_SOURCES) if s.name == "source_shape_alerts"]
    notifier = AlertNotifierResource(database_url=warehouse_url, webhook_url=webhook.url)
    cursor = [None]

    def tick() -> None:
        context = build_sensor_context(instance=instance, cursor=cursor[0],
                                       resources={"alert_notifier": notifier})
        sensor(context)
        cursor[0] = context.cursor

    tick()
    return tick


def _shape_observations(instance, spec, partition: str) -> list[dict]:
    records = instance.fetch_observations(
        AssetRecordsFilter(asset_key=AssetKey(spec.name), asset_partitions=[partition]),
        limit=10).records
    return [{k: v.value for k, v in r.asset_observation.metadata.items()} for r in records
            if FINGERPRINT_KEY in r.asset_observation.metadata]


def _check_evaluations(instance, spec, partition: str, check: str) -> list:
    records = instance.get_records_for_run(
        instance.get_latest_materialization_event(AssetKey(spec.name)).run_id,
        of_type=DagsterEventType.ASSET_CHECK_EVALUATION).records
    return [e for r in records
            if (e := r.event_log_entry.dagster_event.event_specific_data).check_name == check
            and e.partition == partition]


def _serve_through_the_standin(case: Case, spec, job, instance, warehouse_url: str, standin):
    """Clean loads of the neighbour and of the partition, then the case's bytes served for the
    partition: the run's result, the partition, the neighbour, the table before."""
    partition = case.expect.get("partition", case.settings["partition"])
    if partition == "tomorrow":
        partition = spec.partitions_def.get_partition_keys()[-1]
    neighbour = case.settings["neighbour"]
    for key in (neighbour, partition):
        assert run_partition(job, key, instance).success, f"clean load of {key} failed"
    before = _snapshot(warehouse_url, spec)

    options = {k: case.expect[k] for k in ("content_type", "status", "times") if k in case.expect}
    standin.serve_bytes(case.payload.read_bytes(), route=case.settings["route"], **options)
    try:
        result = run_partition(job, partition, instance)
    finally:
        standin.clear_faults()
    return result, partition, neighbour, before


def _drop_into_the_inbox(case: Case, spec, job, instance, warehouse_url: str, tmp_path: Path):
    """A clean load of the neighbour file, then the case's bytes dropped into the inbox under
    the case's file name and its version run, as the sensor would ask: the run's result, the
    version, the neighbour's version, the table before."""
    inbox = inbox_dirs(tmp_path)[0]
    neighbour_file = CORPUS / case.source / case.settings["neighbour"]
    neighbour = drop(inbox, neighbour_file.name, neighbour_file.read_bytes())
    instance.add_dynamic_partitions(spec.partitions_def.name, [neighbour])
    assert run_partition(job, neighbour, instance).success, "clean load of the neighbour failed"
    before = _snapshot(warehouse_url, spec)

    partition = drop(inbox, case.payload.name, case.payload.read_bytes())
    instance.add_dynamic_partitions(spec.partitions_def.name, [partition])
    return run_partition(job, partition, instance), partition, neighbour, before


def _check_the_inbox(case: Case, tmp_path: Path, version: str) -> None:
    """A failed file stays in the inbox; a loaded one moves to the archive with its outcome."""
    inbox, archive = inbox_dirs(tmp_path)
    name = case.payload.name
    if case.expect["outcome"] == "failed":
        assert (inbox / name).read_bytes() == case.payload.read_bytes()
        assert not (archive / version).exists()
    else:
        assert not (inbox / name).exists(), f"{name} was not archived"
        assert (archive / version).read_bytes() == case.payload.read_bytes()
        note = json.loads((archive / f"{version}.outcome.json").read_text())
        assert note["outcome"] == ("loaded" if case.expect["outcome"] == "loaded" else "partial")


def _same(stored, wanted) -> bool:
    """A stored value as a case spells it; a decimal or a date given as text is compared by its
    text (a decimal's scale counts: "1234.500" is not 1234.5)."""
    if isinstance(wanted, str) and isinstance(stored, Decimal | date):
        return str(stored) == wanted
    return stored == wanted


def _keys(rows, spec) -> set[tuple]:
    return {tuple(row[k] for k in spec.natural_key) for row in rows}


def _snapshot(url: str, spec) -> dict:
    """Every row of the source's table with its physical identity (a rewritten row gets a new
    ctid and xmin), and the whole quarantine."""
    order = ", ".join(spec.natural_key)
    with psycopg.connect(dsn_of(url)) as connection:
        table = connection.execute(
            f"SELECT ctid::text, xmin::text, * FROM {spec.table.name} ORDER BY {order}")
        names = [d.name for d in table.description]
        rows = [dict(zip(names, r, strict=True)) for r in table.fetchall()]
        quarantine = connection.execute("SELECT * FROM quarantined_rows ORDER BY id")
        names = [d.name for d in quarantine.description]
        quarantined = [dict(zip(names, r, strict=True)) for r in quarantine.fetchall()]
    return {"rows": rows, "quarantine": quarantined}


def _partition_value(spec, partition: str) -> str:
    """The partition column's value of a partition key, as text (a file version's is the file
    name)."""
    return str(spec.load_target.partition_value(partition))


def _partition_rows(snapshot: dict, spec, partition: str) -> list[dict]:
    value = _partition_value(spec, partition)
    return [r for r in snapshot["rows"] if str(r[spec.partition_column]) == value]


def _rows(url: str, spec, partition: str) -> list[dict]:
    with psycopg.connect(dsn_of(url)) as connection:
        cursor = connection.execute(
            f"SELECT * FROM {spec.table.name} WHERE {spec.partition_column}::text = %s",
            (_partition_value(spec, partition),))
        names = [d.name for d in cursor.description]
        return [dict(zip(names, r, strict=True)) for r in cursor.fetchall()]


def _materialized(instance, run_id: str) -> list[dict]:
    records = instance.get_records_for_run(
        run_id, of_type=DagsterEventType.ASSET_MATERIALIZATION).records
    return [{k: v.value for k, v in r.event_log_entry.asset_materialization.metadata.items()}
            for r in records]


