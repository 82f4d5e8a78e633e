"""Runs over a range of partitions: one run, each partition loaded and recorded on its own."""

from __future__ import annotations

from dagster import DagsterEventType

from mostovik_pipelines_tests.support.runs import step_failure_message
from mostovik_pipelines_tests.support.warehouse import table_rows

RANGE = ("2026-11-02", "2026-11-06")


def _run_range(job, instance, start: str, end: str):
    return job.execute_in_process(
        instance=instance, raise_on_error=False,
        tags={"dagster/asset_partition_range_start": start,
              "dagster/asset_partition_range_end": end},
    )


def _materialized(instance, run_id: str) -> dict[str, dict]:
    records = instance.get_records_for_run(
        run_id, of_type=DagsterEventType.ASSET_MATERIALIZATION).records
    return {
        r.event_log_entry.asset_materialization.partition:
        {k: v.value for k, v in r.event_log_entry.asset_materialization.metadata.items()}
        for r in records
    }


def test_a_ranged_run_loads_every_partition_with_its_own_figures(
    cbr_job, instance, warehouse_url
):
    result = _run_range(cbr_job, instance, *RANGE)
    assert result.success
    materialized = _materialized(instance, result.run_id)
    assert sorted(materialized) == [f"2026-11-0{d}" for d in range(2, 7)]
    assert all(m["inserted"] == 12 for m in materialized.values())
    assert len(table_rows(warehouse_url, "cbr_daily_rates")) == 60


def test_a_bad_partition_in_a_range_is_set_aside_and_named(
    cbr_job, instance, warehouse_url, standin
):
    standin.fault("malformed", match="date_req=04/11/2026", times=-1)
    result = _run_range(cbr_job, instance, *RANGE)
    assert not result.success
    assert sorted(_materialized(instance, result.run_id)) == [
        "2026-11-02", "2026-11-03", "2026-11-05", "2026-11-06"]
    message = step_failure_message(instance, result.run_id)
    assert "1 of 5 partitions failed" in message
    assert "cbr_daily_rates [2026-11-04] transform" in message
    assert len(table_rows(warehouse_url, "cbr_daily_rates")) == 48


def test_a_retried_ranged_extract_resumes_instead_of_fetching_again(
    cbr_job, instance, standin
):
    standin.fault("status", status=503, match="date_req=05/11/2026", times=1)
    result = _run_range(cbr_job, instance, *RANGE)
    assert result.success
    asked = [r["query"] for r in standin.requests("cbr")]
    assert len(asked) == 6  # five partitions, one of them asked twice
    assert sum("05%2F11%2F2026" in q for q in asked) == 2


def test_a_commit_group_joins_pages_given_as_columns_or_frames_in_page_order():
    import pandas as pd

    from mostovik_pipelines.framework.spec import ParsedRows, RejectedRow
    from mostovik_pipelines.framework.steps.transform import PageGroup

    group = PageGroup()
    received = group.add(1, ParsedRows({"id": ["a", "b"], "n": [1, 2]}), 0)
    received = group.add(2, ParsedRows(pd.DataFrame({"id": ["c"], "n": [3]}),
                                       [RejectedRow(2, "{}", "unreadable")], [1]), received)
    received = group.add(3, ParsedRows({"id": [], "n": []}), received)
    group.add(4, ParsedRows({"id": ["d"], "n": [4]}), received)
    parsed = group.parsed()
    assert parsed.frame.to_dict("list") == {"id": ["a", "b", "c", "d"], "n": [1, 2, 3, 4]}
    assert list(parsed.row_numbers) == [1, 2, 3, 5]
    assert [r.row_number for r in parsed.rejected] == [4]
    assert group.first_page == 1 and group.rows == 4
