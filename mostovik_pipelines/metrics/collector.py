"""One pass over run storage and the warehouse, turned into Prometheus metric families, after
Prometheus' conventions: counters (``_total``) for what only grows, a histogram for load
durations, gauges for states.

Per source (label ``source``, the declaration's name; no other label carries anything but a
fixed word):

* counters, over everything run storage holds when the process starts and what comes after
  (read incrementally, so a pass costs what happened since the last): runs by ADR-016 status
  once they ended (``completed``, ``partial``, ``failed``), rows by change as their loads'
  materialisations recorded them, and a histogram of each partition load's duration;
* gauges: the newest final partition and its age, the partitions failed or waiting for an
  operator within the lookback (:mod:`..framework.automation.partition_states`, the same
  reading as ``mostovik jobs list`` and the automation), the due periods not final
  (:mod:`..framework.automation.deadlines`, what the check ``period_deadlines`` says);

then the run queue's depth, each warehouse table's last load (``partition_loads``), the last
prune's bytes per store, and the alerts the webhook has not acknowledged yet (the outbox).
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
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector
from sqlalchemy import create_engine, func, select

from mostovik_pipelines.core.tags import SOURCE_TAG
from mostovik_pipelines.framework.automation.deadlines import deadline_state
from mostovik_pipelines.framework.automation.partition_states import Outcome, partition_states
from mostovik_pipelines.framework.spec import SourceSpec
from mostovik_pipelines.maintenance.job import PRUNE_JOB, PRUNED_BYTES_PREFIX
from mostovik_pipelines.maintenance.policy import STORES
from mostovik_pipelines.platform.status import JobStatus, recorded
from mostovik_pipelines.resources.alert_outbox import pending_count, sent_count
from mostovik_pipelines.warehouse.schema import partition_loads

CACHE_SECONDS = 30.0
"""A scrape within this long of the last pass is answered from it."""
LOOKBACK = timedelta(days=31)
"""How far back the partitions of a source are read for finality, failures and waiting."""
DYNAMIC_PARTITIONS_READ = 100
"""The newest file versions of a file source read per pass."""
ROW_CHANGES = ("inserted", "updated", "unchanged", "deleted", "rejected")
FINISHED = (DagsterRunStatus.SUCCESS, DagsterRunStatus.FAILURE, DagsterRunStatus.CANCELED)
ENDED = (JobStatus.COMPLETED, JobStatus.PARTIAL, JobStatus.FAILED)
DURATION_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0)
"""Seconds: a day of rates loads in a tenth of a second, a window of a hundred thousand work
orders in minutes."""
PAGE = 1_000


class PipelineCollector(Collector):
    """The metrics of ``sources``, read with ``instance`` and from the warehouse at
    ``warehouse_url``, at most once every ``cache_seconds``."""

    def __init__(self, instance: DagsterInstance, warehouse_url: str,
                 sources: Sequence[SourceSpec], *, cache_seconds: float = CACHE_SECONDS,
                 lookback: timedelta = LOOKBACK,
                 clock: Callable[[], datetime] = lambda: datetime.now(UTC)) -> None:
        self.instance = instance
        self.engine = create_engine(warehouse_url, pool_pre_ping=True)
        self.sources = list(sources)
        self.cache_seconds = cache_seconds
        self.lookback = lookback
        self.clock = clock
        self._lock = threading.Lock()
        self._cached: list[Metric] = []
        self._read_at: float | None = None
        self._totals = _Totals(self.sources)

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
        self._totals.read(self.instance)
        families = [*self._partition_families(now), *self._totals.families(),
                    self._queue_depth(), self._table_last_load(), self._last_prune(),
                    *self._alerts()]
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
        late = GaugeMetricFamily(
            "mostovik_source_late_periods",
            "Due periods not final (what the check period_deadlines says): 0 while every "
            "period is in on time.", labels=["source"])
        for spec in self.sources:
            if spec.deadline is not None:
                late.add_metric([spec.name], len(deadline_state(self.instance, spec, now).late))
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
        return [final_at, age, failed, waiting, late]

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

    def _alerts(self) -> list[Metric]:
        pending = GaugeMetricFamily(
            "mostovik_alerts_pending",
            "Alerts in the outbox the webhook has not acknowledged yet (delivered with "
            "backoff).")
        pending.add_metric([], pending_count(self.engine))
        sent = CounterMetricFamily("mostovik_alerts_sent", "Alerts the webhook acknowledged "
                                   "(or logged, where no webhook is set).")
        sent.add_metric([], sent_count(self.engine))
        return [pending, sent]


class _Totals:
    """The counters and the histogram: everything run storage holds at the first pass, then
    what came after (runs that ended, materialisations recorded), read incrementally."""

    def __init__(self, sources: Sequence[SourceSpec]) -> None:
        self.sources = list(sources)
        self.runs = {(spec.name, status.value): 0 for spec in sources for status in ENDED}
        self.rows = {(spec.name, change): 0 for spec in sources for change in ROW_CHANGES}
        self.durations = {spec.name: [0] * (len(DURATION_BUCKETS) + 1) for spec in sources}
        self.duration_sums = {spec.name: 0.0 for spec in sources}
        self._counted_runs: set[str] = set()
        self._after: dict[str, int | None] = {spec.name: None for spec in sources}
        self._runs_read_at: datetime | None = None

    def read(self, instance: DagsterInstance) -> None:
        since = self._runs_read_at
        self._runs_read_at = datetime.now(UTC)
        for spec in self.sources:
            for record in instance.get_run_records(RunsFilter(
                    tags={SOURCE_TAG: spec.name}, statuses=list(FINISHED),
                    updated_after=since - timedelta(minutes=5) if since else None)):
                run = record.dagster_run
                if run.run_id in self._counted_runs:
                    continue
                self._counted_runs.add(run.run_id)
                self.runs[(spec.name, _ended_status(run).value)] += 1
            self._read_loads(instance, spec)

    def _read_loads(self, instance: DagsterInstance, spec: SourceSpec) -> None:
        while True:
            result = instance.fetch_materializations(
                AssetRecordsFilter(asset_key=AssetKey(spec.name),
                                   after_storage_id=self._after[spec.name]),
                limit=PAGE, ascending=True)
            for record in result.records:
                self._after[spec.name] = record.storage_id
                metadata = (record.asset_materialization.metadata
                            if record.asset_materialization else {})
                for change in ROW_CHANGES:
                    if change in metadata:
                        self.rows[(spec.name, change)] += int(metadata[change].value)
                duration = metadata.get("duration_seconds")
                if duration is not None:
                    seconds = float(duration.value)
                    self.duration_sums[spec.name] += seconds
                    bucket = next((i for i, bound in enumerate(DURATION_BUCKETS)
                                   if seconds <= bound), len(DURATION_BUCKETS))
                    self.durations[spec.name][bucket] += 1
            if not result.has_more:
                return

    def families(self) -> list[Metric]:
        runs = CounterMetricFamily(
            "mostovik_runs", "Runs of a source that ended, by ADR-016 status.",
            labels=["source", "status"])
        for (source, status), count in sorted(self.runs.items()):
            runs.add_metric([source, status], count)
        rows = CounterMetricFamily(
            "mostovik_rows", "Rows the loads of a source inserted, updated, left unchanged, "
            "deleted or rejected (quarantined).", labels=["source", "change"])
        for (source, change), count in sorted(self.rows.items()):
            rows.add_metric([source, change], count)
        durations = HistogramMetricFamily(
            "mostovik_load_duration_seconds",
            "How long each partition's load took (its transaction, checks excluded).",
            labels=["source"])
        for source, counts in sorted(self.durations.items()):
            cumulative, buckets = 0, []
            for bound, count in zip([*map(str, DURATION_BUCKETS), "+Inf"], counts,
                                    strict=True):
                cumulative += count
                buckets.append((bound, cumulative))
            durations.add_metric([source], buckets, self.duration_sums[source])
        return [runs, rows, durations]


def _ended_status(run) -> JobStatus:
    """A finished run's ADR-016 status: what it wrote, else what run storage says."""
    written = recorded(run)
    if written in ENDED:
        return written
    return JobStatus.COMPLETED if run.status is DagsterRunStatus.SUCCESS else JobStatus.FAILED
