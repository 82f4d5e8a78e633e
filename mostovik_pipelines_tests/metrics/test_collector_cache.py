"""A scrape costs one pass over run storage and the warehouse at most once per cache period: a
second scrape inside it answers the same figures, one after it reads the new runs."""

from __future__ import annotations

import pytest

from mostovik_pipelines.metrics.collector import PipelineCollector

PARTITION = "2026-11-03"
RATES_PER_DATE = 12


def _inserted(collector: PipelineCollector) -> float:
    (family,) = [f for f in collector.collect() if f.name == "mostovik_rows"]
    (sample,) = [s for s in family.samples
                 if s.labels == {"source": "cbr_daily_rates", "change": "inserted"}]
    return sample.value


@pytest.mark.parametrize("warehouse_url", ["sqlite"], indirect=True)
def test_a_scrape_inside_the_cache_period_reads_nothing_new(warehouse_url, cbr_job, cbr_source,
                                                             instance):
    cached = PipelineCollector(instance, warehouse_url, [cbr_source], cache_seconds=3600)
    fresh = PipelineCollector(instance, warehouse_url, [cbr_source], cache_seconds=0)
    assert _inserted(cached) == _inserted(fresh) == 0

    assert cbr_job.execute_in_process(instance=instance, partition_key=PARTITION).success

    assert _inserted(cached) == 0
    assert _inserted(fresh) == RATES_PER_DATE
