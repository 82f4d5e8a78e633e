"""A re-load of the payload a partition's stored rows came from, by the same code, skips making
its rows and comparing them; its checks still run and record; a changed parser, a row written
by hand and a ledger changed under the load each make the payload into rows and compare them."""

from __future__ import annotations

from decimal import Decimal

import pytest
from dagster import DagsterEventType

from mostovik_pipelines.core.errors import RunClaimLost
from mostovik_pipelines.framework.load import partition
from mostovik_pipelines.framework.load.partition import confirm_unchanged, load_partition
from mostovik_pipelines.framework.quality.checks import partition_checks
from mostovik_pipelines.framework.steps import unchanged
from mostovik_pipelines.resources.warehouse import warehouse_engine
from mostovik_pipelines.sources.cbr_daily_rates import SOURCE
from mostovik_pipelines_tests.framework.load.test_ledger import ledger, operator_sql
from mostovik_pipelines_tests.framework.load.test_partition import DAY, rates
from mostovik_pipelines_tests.support.runs import load_metadata, run_partition
from mostovik_pipelines_tests.support.warehouse import physical_snapshot, table_rows

PARTITION = "2026-11-02"
ROWS = 12


def check_results(instance, run_id: str) -> dict[str, tuple[str, bool]]:
    """Check name -> (partition, passed) of every check result the run recorded."""
    records = instance.get_records_for_run(
        run_id, of_type=DagsterEventType.ASSET_CHECK_EVALUATION).records
    evaluations = [r.event_log_entry.dagster_event.event_specific_data for r in records]
    return {e.check_name: (e.partition, e.passed) for e in evaluations}


def every_check_passed() -> dict[str, tuple[str, bool]]:
    return {check.name: (PARTITION, True) for check in partition_checks(SOURCE)}


@pytest.mark.parametrize("warehouse_url", ["postgresql"], indirect=True)
def test_the_same_payload_by_the_same_code_is_not_made_into_rows_and_its_checks_still_record(
    cbr_job, instance, warehouse_url
):
    first = run_partition(cbr_job, PARTITION, instance)
    assert first.success
    assert "payload_unchanged" not in load_metadata(instance, first.run_id)
    before = physical_snapshot(warehouse_url, "cbr_daily_rates")
    recorded = ledger(warehouse_url)[("cbr_daily_rates", PARTITION)]
    assert recorded["parser_version"] == unchanged.parser_version(SOURCE)

    again = run_partition(cbr_job, PARTITION, instance)
    assert again.success
    figures = load_metadata(instance, again.run_id)
    assert figures["payload_unchanged"] is True
    assert (figures["inserted"], figures["updated"], figures["deleted"]) == (0, 0, 0)
    assert (figures["unchanged"], figures["dagster/row_count"], figures["rejected"]) == (
        ROWS, ROWS, 0)
    assert figures["duplicates_dropped"] == 0
    assert figures["content_hash"] == load_metadata(instance, first.run_id)["content_hash"]
    assert "USD" in figures["preview"] or "AUD" in figures["preview"]
    assert check_results(instance, again.run_id) == every_check_passed()
    assert physical_snapshot(warehouse_url, "cbr_daily_rates") == before
    assert ledger(warehouse_url)[("cbr_daily_rates", PARTITION)] == recorded


@pytest.mark.parametrize("warehouse_url", ["postgresql"], indirect=True)
def test_a_changed_parser_makes_the_payload_into_rows_again_and_the_ledger_names_it(
    cbr_job, instance, warehouse_url, monkeypatch
):
    assert run_partition(cbr_job, PARTITION, instance).success
    monkeypatch.setattr(unchanged, "_package_digest", lambda: "the code changed")

    reparsed = run_partition(cbr_job, PARTITION, instance)
    assert reparsed.success
    figures = load_metadata(instance, reparsed.run_id)
    assert "payload_unchanged" not in figures
    assert (figures["inserted"], figures["updated"], figures["unchanged"]) == (0, 0, ROWS)
    assert check_results(instance, reparsed.run_id) == every_check_passed()
    assert ledger(warehouse_url)[("cbr_daily_rates", PARTITION)]["parser_version"] == (
        unchanged.parser_version(SOURCE))

    skipped = run_partition(cbr_job, PARTITION, instance)
    assert load_metadata(instance, skipped.run_id)["payload_unchanged"] is True


@pytest.mark.parametrize("warehouse_url", ["postgresql"], indirect=True)
def test_a_row_edited_by_hand_is_caught_by_the_comparison_and_repaired(
    cbr_job, instance, warehouse_url
):
    assert run_partition(cbr_job, PARTITION, instance).success
    stored = {r["char_code"]: r["value"] for r in table_rows(warehouse_url, "cbr_daily_rates")}
    operator_sql(warehouse_url, "UPDATE cbr_daily_rates SET value = 1 WHERE char_code = 'USD'")

    repaired = run_partition(cbr_job, PARTITION, instance)
    assert repaired.success
    figures = load_metadata(instance, repaired.run_id)
    assert "payload_unchanged" not in figures
    assert (figures["updated"], figures["unchanged"]) == (1, ROWS - 1)
    assert {r["char_code"]: r["value"]
            for r in table_rows(warehouse_url, "cbr_daily_rates")} == stored
    assert check_results(instance, repaired.run_id) == every_check_passed()


@pytest.mark.parametrize("warehouse_url", ["sqlite"], indirect=True)
def test_sqlite_keeps_no_digest_and_always_makes_the_rows(cbr_job, instance, warehouse_url):
    assert run_partition(cbr_job, PARTITION, instance).success
    again = run_partition(cbr_job, PARTITION, instance)
    figures = load_metadata(instance, again.run_id)
    assert "payload_unchanged" not in figures
    assert figures["unchanged"] == ROWS


def _loaded(url: str) -> dict:
    load_partition(warehouse_engine(url), SOURCE.load_target, rates(), DAY.isoformat(), "run-1",
                   payload_hash="payload-1", parser_version="parser-1")
    return ledger(url)[("cbr_daily_rates", DAY.isoformat())]


def _confirm(url: str, recorded: dict, **changed):
    given = {"content_digest": recorded["content_digest"], "payload_hash": "payload-1",
             "parser_version": "parser-1", "fetched_at": None} | changed
    return confirm_unchanged(warehouse_engine(url), SOURCE.load_target, DAY.isoformat(),
                             "run-2", **given)


def test_the_load_confirms_the_ledger_under_its_locks(pg_warehouse_url):
    recorded = _loaded(pg_warehouse_url)
    assert _confirm(pg_warehouse_url, recorded).as_dict() == {
        "inserted": 0, "updated": 0, "unchanged": 3, "deleted": 0}
    assert _confirm(pg_warehouse_url, recorded, parser_version="parser-2") is None
    assert _confirm(pg_warehouse_url, recorded, payload_hash="payload-2") is None
    # A row written by hand after transform read the ledger: the digest is forgotten.
    operator_sql(pg_warehouse_url,
                 "UPDATE cbr_daily_rates SET value = 1 WHERE char_code = 'USD'")
    assert _confirm(pg_warehouse_url, recorded) is None
    assert ledger(pg_warehouse_url)[("cbr_daily_rates", DAY.isoformat())]["loaded_by_run"] == (
        "run-1")
    assert [r["value"] for r in table_rows(pg_warehouse_url, "cbr_daily_rates")
            if r["char_code"] == "USD"] == [Decimal(1)]


def test_the_fence_is_checked_inside_the_confirming_transaction(pg_warehouse_url, monkeypatch):
    recorded = _loaded(pg_warehouse_url)
    written = []

    def lost(run_id: str) -> None:
        raise RunClaimLost(f"run {run_id} lost its claim")

    monkeypatch.setattr(partition, "ensure_run_claim", lost)
    with pytest.raises(RunClaimLost):
        confirm_unchanged(warehouse_engine(pg_warehouse_url), SOURCE.load_target,
                          DAY.isoformat(), "run-2", content_digest=recorded["content_digest"],
                          payload_hash="payload-1", parser_version="parser-1", fetched_at=None,
                          within_transaction=lambda connection, counts: written.append(counts))
    assert len(written) == 1  # what commits with it ran inside the transaction, before the fence
    assert ledger(pg_warehouse_url)[("cbr_daily_rates", DAY.isoformat())] == recorded


@pytest.mark.parametrize("warehouse_url", ["postgresql"], indirect=True)
def test_a_ranged_run_again_skips_every_partition_and_records_every_check(
    cbr_job, instance, warehouse_url
):
    days = ("2026-11-02", "2026-11-03", "2026-11-04")
    tags = {"dagster/asset_partition_range_start": days[0],
            "dagster/asset_partition_range_end": days[-1]}
    for run in ("first", "again"):
        result = cbr_job.execute_in_process(instance=instance, raise_on_error=False, tags=tags)
        assert result.success, run
        records = instance.get_records_for_run(
            result.run_id, of_type=DagsterEventType.ASSET_MATERIALIZATION).records
        skipped = {r.event_log_entry.asset_materialization.partition:
                   "payload_unchanged" in r.event_log_entry.asset_materialization.metadata
                   for r in records}
        assert skipped == dict.fromkeys(days, run == "again")
        evaluations = [r.event_log_entry.dagster_event.event_specific_data
                       for r in instance.get_records_for_run(
                           result.run_id,
                           of_type=DagsterEventType.ASSET_CHECK_EVALUATION).records]
        assert {(e.check_name, e.partition) for e in evaluations if e.passed} == {
            (check.name, day) for check in partition_checks(SOURCE) for day in days}


@pytest.mark.parametrize("warehouse_url", ["postgresql"], indirect=True)
def test_a_row_edited_after_transform_found_the_payload_unchanged_is_repaired_by_the_load(
    cbr_job, instance, warehouse_url, monkeypatch
):
    from mostovik_pipelines.framework.steps import load as load_step

    assert run_partition(cbr_job, PARTITION, instance).success
    stored = {r["char_code"]: r["value"] for r in table_rows(warehouse_url, "cbr_daily_rates")}
    confirmed = []

    def edited_first(*args, **kwargs):
        operator_sql(warehouse_url, "UPDATE cbr_daily_rates SET value = 1 WHERE char_code = 'USD'")
        confirmed.append(partition.confirm_unchanged(*args, **kwargs))
        return confirmed[-1]

    monkeypatch.setattr(load_step, "confirm_unchanged", edited_first)
    repaired = run_partition(cbr_job, PARTITION, instance)
    assert repaired.success
    assert confirmed == [None]  # transform found it unchanged; the load's locks did not
    figures = load_metadata(instance, repaired.run_id)
    assert "payload_unchanged" not in figures
    assert (figures["updated"], figures["unchanged"]) == (1, ROWS - 1)
    assert {r["char_code"]: r["value"]
            for r in table_rows(warehouse_url, "cbr_daily_rates")} == stored
    assert check_results(instance, repaired.run_id) == every_check_passed()
