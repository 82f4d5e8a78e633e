"""One pass over run storage and the warehouse, turned into Prometheus metric families.

Per source (label ``source``, the declaration's name; no other label carries anything but a
fixed word): the newest final partition and its age, the partitions failed or waiting for an
operator within the lookback (:mod:`..framework.automation.partition_states`, the same reading
as ``mostovik jobs list`` and the automation), jobs by ADR-016 status and rows inserted, updated
and rejected over the window (:func:`..framework.runs.tracking.list_jobs`), the last load's
duration (its materialisation's ``duration_seconds``); then the run queue's depth, each warehouse
table's last load (``partition_loads``) and the last prune's bytes per store.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Sequence
from datetime import UTC, datetime, timedelta

from dagster import (
    AssetKey,
    AssetRecordsFilter,
    DagsterEventType,
    DagsterInstance,
    DagsterRunStatus,
    RunsFilter,
    TimeWindowPartitionsDefinition,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy import create_engine, func, select

from mostovik_pipelines.framework.automation.partition_states import Outcome, partition_states
from mostovik_pipelines.framework.runs.tracking import JobStatus, list_jobs
from mostovik_pipelines.framework.spec import SourceSpec
from mostovik_pipelines.maintenance.job import PRUNE_JOB, PRUNED_BYTES_PREFIX
from mostovik_pipelines.maintenance.policy import STORES
from mostovik_pipelines.warehouse.schema import partition_loads

CACHE_SECONDS = 30.0
"""A scrape within this long of the last pass is answered from it."""
WINDOW = timedelta(hours=24)
"""The window of the job and row counts."""
LOOKBACK = timedelta(days=31)
"""How far back the partitions of a source are read for finality, failures and waiting."""
DYNAMIC_PARTITIONS_READ = 100
"""The newest file versions of a file source read per pass."""
ROW_CHANGES = ("inserted", "updated", "rejected")


class PipelineCollector(Collector):
    """The metrics of ``sources``, read with ``instance`` and from the warehouse at
    ``warehouse_url``, at most once every ``cache_seconds``."""

    def __init__(self, instance: DagsterInstance, warehouse_url: str,
                 sources: Sequence[SourceSpec], *, cache_seconds: float = CACHE_SECONDS,
                 window: timedelta = WINDOW, lookback: timedelta = LOOKBACK,
                 clock: Callable[[], datetime] = lambda: datetime.now(UTC)) -> None:
        self.instance = instance
        self.engine = create_engine(warehouse_url, pool_pre_ping=True)
        self.sources = list(sources)
        self.cache_seconds = cache_seconds
        self.window = window
        self.lookback = lookback
        self.clock = clock
        self._lock = threading.Lock()
        self._cached: list[Metric] = []
        self._read_at: float | None = None

    def collect(self) -> Iterable[Metric]:
        with self._lock:
            if self._read_at is None or time.monotonic() - self._read_at >= self.cache_seconds:
                self._cached = self.read()
                self._read_at = time.monotonic()
            return list(self._cached)

    def read(self) -> list[Metric]:
        """Every metric family, from one pass."""
        now = self.clock()
        started = time.monotonic()
        families = [*self._partition_families(now), *self._job_families(now),
                    self._load_duration(), self._queue_depth(), self._table_last_load(),
                    self._last_prune()]
        pass_seconds = GaugeMetricFamily(
            "mostovik_metrics_read_duration_seconds",
            "How long the last pass over run storage and the warehouse took.")
        pass_seconds.add_metric([], time.monotonic() - started)
        return [*families, pass_seconds]

    def _partition_families(self, now: datetime) -> list[Metric]:
        final_at = GaugeMetricFamily(
            "mostovik_source_newest_final_partition_timestamp_seconds",
            "End of the newest final partition's period (a file source: when it was loaded).",
            labels=["source"])
        age = GaugeMetricFamily(
            "mostovik_source_newest_final_partition_age_seconds",
            "Seconds since the end of the newest final partition's period.", labels=["source"])
        failed = GaugeMetricFamily(
            "mostovik_source_partitions_failed",
            "Partitions in the lookback whose latest run failed on a transient error "
            "(asked for again with backoff).", labels=["source"])
        waiting = GaugeMetricFamily(
            "mostovik_source_partitions_waiting_for_operator",
            "Partitions in the lookback whose latest run failed for a permanent reason or was "
            "cancelled: nothing asks for them again until a person does.", labels=["source"])
        for spec in self.sources:
            keys = self._keys_in_lookback(spec, now)
            states = partition_states(self.instance, spec, keys, now - self.lookback)
            final = [key for key in keys if states[key].final]
            if final:
                stamp = self._final_timestamp(spec, states[final[-1]], final[-1])
                final_at.add_metric([spec.name], stamp)
                age.add_metric([spec.name], max(0.0, now.timestamp() - stamp))
            failed.add_metric([spec.name], sum(
                1 for state in states.values() if state.latest_outcome is Outcome.FAILED))
            waiting.add_metric([spec.name], sum(
                1 for state in states.values() if state.waiting_for_operator))
        return [final_at, age, failed, waiting]

    def _keys_in_lookback(self, spec: SourceSpec, now: datetime) -> list[str]:
        """The source's partitions in the lookback, oldest first."""
        partitions = spec.partitions_def
        if isinstance(partitions, TimeWindowPartitionsDefinition):
            since = now - self.lookback
            return [key for key in partitions.get_partition_keys(current_time=now)
                    if partitions.time_window_for_partition_key(key).end > since]
        keys = partitions.get_partition_keys(dynamic_partitions_store=self.instance)
        return list(keys)[-DYNAMIC_PARTITIONS_READ:]

    @staticmethod
    def _final_timestamp(spec: SourceSpec, state, key: str) -> float:
        partitions = spec.partitions_def
        if isinstance(partitions, TimeWindowPartitionsDefinition):
            return partitions.time_window_for_partition_key(key).end.timestamp()
        return state.latest_ended_at.timestamp() if state.latest_ended_at else 0.0

    def _job_families(self, now: datetime) -> list[Metric]:
        jobs_family = GaugeMetricFamily(
            "mostovik_jobs_in_window",
            "Jobs (runs of a source) created in the window, by ADR-016 status.",
            labels=["source", "status"])
        rows = GaugeMetricFamily(
            "mostovik_rows_in_window",
            "Rows the jobs created in the window inserted, updated or rejected (quarantined).",
            labels=["source", "change"])
        window = GaugeMetricFamily("mostovik_window_seconds",
                                   "The window of the *_in_window metrics.")
        window.add_metric([], self.window.total_seconds())
        counts = {(spec.name, status): 0 for spec in self.sources for status in JobStatus}
        changes = {(spec.name, change): 0 for spec in self.sources for change in ROW_CHANGES}
        for job in list_jobs(self.instance, since=now - self.window, limit=1_000_000,
                             sources=self.sources):
            counts[(job.source, job.status)] = counts.get((job.source, job.status), 0) + 1
            for change in ROW_CHANGES:
                changes[(job.source, change)] += job.totals.get(change, 0)
        for (source, status), count in sorted(counts.items()):
            jobs_family.add_metric([source, str(status)], count)
        for (source, change), count in sorted(changes.items()):
            rows.add_metric([source, change], count)
        return [jobs_family, rows, window]

    def _load_duration(self) -> Metric:
        family = GaugeMetricFamily(
            "mostovik_source_last_load_duration_seconds",
            "How long the latest load of a partition of the source took.", labels=["source"])
        for spec in self.sources:
            result = self.instance.fetch_materializations(
                AssetRecordsFilter(asset_key=AssetKey(spec.name)), limit=1, ascending=False)
            for record in result.records:
                duration = (record.asset_materialization.metadata.get("duration_seconds")
                            if record.asset_materialization else None)
                if duration is not None:
                    family.add_metric([spec.name], float(duration.value))
        return family

    def _queue_depth(self) -> Metric:
        family = GaugeMetricFamily("mostovik_run_queue_depth",
                                   "Runs waiting in the run queue for the daemon to start them.")
        family.add_metric([], self.instance.get_runs_count(
            RunsFilter(statuses=[DagsterRunStatus.QUEUED])))
        return family

    def _table_last_load(self) -> Metric:
        family = GaugeMetricFamily(
            "mostovik_table_last_load_timestamp_seconds",
            "When a partition of the warehouse table was last loaded (partition_loads).",
            labels=["table"])
        tables = {spec.table.name for spec in self.sources}
        with self.engine.connect() as connection:
            rows = connection.execute(
                select(partition_loads.c.table_name, func.max(partition_loads.c.loaded_at))
                .group_by(partition_loads.c.table_name)).all()
        for table, loaded_at in rows:
            if table in tables and loaded_at is not None:
                if loaded_at.tzinfo is None:
                    loaded_at = loaded_at.replace(tzinfo=UTC)
                family.add_metric([table], loaded_at.timestamp())
        return family

    def _last_prune(self) -> Metric:
        family = GaugeMetricFamily(
            "mostovik_prune_last_removed_bytes",
            "Bytes the latest successful retention prune removed, per store.", labels=["store"])
        runs = self.instance.get_runs(
            RunsFilter(job_name=PRUNE_JOB, statuses=[DagsterRunStatus.SUCCESS]), limit=1)
        for run in runs:
            for record in self.instance.get_records_for_run(
                    run.run_id, of_type=DagsterEventType.ENGINE_EVENT).records:
                event = record.event_log_entry.dagster_event
                metadata = event.engine_event_data.metadata if event else {}
                for key, value in metadata.items():
                    store = key.removeprefix(PRUNED_BYTES_PREFIX)
                    if key.startswith(PRUNED_BYTES_PREFIX) and store in STORES:
                        family.add_metric([store.replace(" ", "_")], float(value.value))
        return family
