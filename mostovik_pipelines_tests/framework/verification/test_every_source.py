"""Verification and the tracker's rebuild hold for every source, taken from the declarations (a
scaffolded source included: ``test_scaffold.py`` runs this module on one of each kind): a clean
partition of the source (its corpus' neighbour, ``corpus/README.md``) loaded end to end matches
both the landed payload and the source; a row deleted by hand is named missing; a run storage
that lost the load gets it back from the ledger, once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from dagster import AssetKey, AssetRecordsFilter, DagsterInstance
from sqlalchemy import create_engine, text

from mostovik_pipelines.framework.runs.rebuild import LOADED_BY_RUN_KEY, rebuild_tracker
from mostovik_pipelines.framework.verification.compare import Status
from mostovik_pipelines.framework.verification.verify import verify_partition
from mostovik_pipelines.resources import LandingStoreResource
from mostovik_pipelines.sources import ALL_SOURCES
from mostovik_pipelines_tests.support.inbox import drop, inbox_dirs
from mostovik_pipelines_tests.support.locations import code_location_for, standin_resource
from mostovik_pipelines_tests.support.runs import run_partition

CORPUS = Path(__file__).parents[2] / "corpus"


def load_a_clean_partition(spec, job, instance: DagsterInstance, work: Path) -> tuple[str, str]:
    """The source's corpus neighbour loaded as its route reaches it: its key and run."""
    settings = json.loads((CORPUS / spec.name / "_source.json").read_text())
    if settings["route"] == "inbox":
        report = CORPUS / spec.name / settings["neighbour"]
        key = drop(inbox_dirs(work)[0], report.name, report.read_bytes())
        instance.add_dynamic_partitions(spec.partitions_def.name, [key])
    else:
        key = settings["neighbour"]
    result = run_partition(job, key, instance)
    assert result.success, f"{spec.name}: the clean load of {key} failed"
    return key, result.run_id


@pytest.mark.parametrize("spec", ALL_SOURCES, ids=[spec.name for spec in ALL_SOURCES])
def test_a_partition_of_every_source_is_verified_and_rebuilt_from_the_ledger(
        spec, pg_warehouse_url, standin_server, standin, tmp_path, instance):
    job = code_location_for(pg_warehouse_url, standin_server, tmp_path, [spec]).resolve_job_def(
        f"{spec.name}_job")
    key, run_id = load_a_clean_partition(spec, job, instance, tmp_path)
    engine = create_engine(pg_warehouse_url)
    landing = LandingStoreResource(base_dir=str(tmp_path / "landing"))
    resource = standin_resource(spec, standin_server, tmp_path)
    try:
        for against in ("landed", "source"):
            verdict = verify_partition(engine, spec, key, against, resource=resource,
                                       landing=landing)
            assert verdict.status is Status.MATCHES, (against, verdict.lines())
            assert verdict.source_rows == verdict.stored_rows > 0

        with engine.begin() as connection:
            connection.execute(text(
                f'DELETE FROM "{spec.table.name}" WHERE ctid = (SELECT ctid FROM '
                f'"{spec.table.name}" WHERE "{spec.partition_column}" = :value LIMIT 1)'),
                {"value": spec.load_target.partition_value(key)})
        verdict = verify_partition(engine, spec, key, "landed", landing=landing)
        assert (verdict.status, verdict.counts["missing"]) == (Status.DIFFERS, 1)

        with DagsterInstance.ephemeral() as lost:
            [first] = rebuild_tracker(lost, engine, [spec])
            [second] = rebuild_tracker(lost, engine, [spec])
            [record] = lost.fetch_materializations(
                AssetRecordsFilter(asset_key=AssetKey(spec.name)), limit=10).records
    finally:
        engine.dispose()
    assert (first.recorded, second.recorded) == ([key], [])
    assert record.partition_key == key
    assert record.asset_materialization.metadata[LOADED_BY_RUN_KEY].value == run_id
