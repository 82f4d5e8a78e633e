"""What a verification run does (:mod:`.schedule` declares it): verify each partition, record
its ``matches_source`` check, and alert once per partition that differs."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

from dagster import (
    AssetCheckEvaluation,
    AssetCheckSeverity,
    AssetKey,
    AssetRecordsFilter,
    DagsterInstance,
    MetadataValue,
    OpExecutionContext,
    TimeWindowPartitionsDefinition,
)

from mostovik_pipelines.core.dagster_compat import (
    AssetCheckEvaluationTargetMaterializationData,
)
from mostovik_pipelines.core.outages import Store, ride_out
from mostovik_pipelines.core.retries import StepContext, outage_recorder
from mostovik_pipelines.framework.assets.resource_keys import (
    LANDING_KEY,
    WAREHOUSE_KEY,
    source_resource_key,
)
from mostovik_pipelines.framework.load.ledger import ledger_entries
from mostovik_pipelines.framework.runs.alerts import ALERT_NOTIFIER_KEY
from mostovik_pipelines.framework.spec import JobType, SourceSpec
from mostovik_pipelines.framework.verification.check import (
    MATCHES_SOURCE,
    verification_check_key,
)
from mostovik_pipelines.framework.verification.compare import PartitionVerdict
from mostovik_pipelines.framework.verification.verify import read_only, verify_partition
from mostovik_pipelines.resources.notifier import Alert

FINGERPRINT_KEY = "mostovik/differences"
"""Metadata of a failed verdict: what the differences are, hashed (an alert is said once)."""
STORES = (Store.WAREHOUSE, Store.OBJECT_STORE)
SHOWN_LINES = 12
"""Lines of a verdict an alert carries (the check's metadata keeps them all)."""


def run_verification(context: OpExecutionContext, spec: SourceSpec, against: str,
                     partitions: Sequence[str] | None) -> None:
    engine = getattr(context.resources, WAREHOUSE_KEY).engine()
    landing = getattr(context.resources, LANDING_KEY)
    resource = getattr(context.resources, source_resource_key(spec))
    notifier = getattr(context.resources, ALERT_NOTIFIER_KEY)
    # Read-only work, made again in place while the warehouse or the landing store is away.
    keys = list(partitions) if partitions else ride_out(
        STORES, lambda: lookback_partitions(engine, spec, datetime.now(UTC)),
        on_wait=outage_recorder(context, StepContext(spec.name, "lookback", "verify")))
    said = _said_before(context.instance, spec, keys)
    differing = []
    for key in keys:
        verdict = ride_out(STORES, lambda key=key: verify_partition(
            engine, spec, key, against, resource=resource, landing=landing,
            instance=context.instance), on_wait=outage_recorder(
                context, StepContext(spec.name, key, "verify")))
        target = _latest_materialization(context.instance, spec, key)
        context.log_event(_evaluation(spec, verdict, target))
        if verdict.agrees:
            continue
        differing.append(key)
        if said.get(key) == (verdict.fingerprint(), target.storage_id if target else None):
            context.log.info(f"{spec.name} [{key}]: differs as the last verification said; "
                             "not alerted again")
            continue
        lines = verdict.lines()
        notifier.notify(Alert(
            kind="verification", source=spec.name, period=key, job_status="differs",
            error_class="verification", error_kind=verdict.status.value.replace(" ", "_"),
            message="; ".join(lines[:SHOWN_LINES])
            + (f"; ... ({len(lines) - SHOWN_LINES} more lines in the check's metadata)"
               if len(lines) > SHOWN_LINES else ""),
            link=notifier.asset_link(spec.name), run_id=context.run_id), context.log)
    context.log.info(f"{spec.name}: {len(keys)} partition(s) verified against the {against}: "
                     f"{len(keys) - len(differing)} match"
                     + (f", differing: {', '.join(differing)}" if differing else ""))


def lookback_partitions(engine, spec: SourceSpec, now: datetime) -> list[str]:
    """The loaded partitions of the source's lookback whose period has closed: a day (or a
    sync's window, past its settle time) that ended within it; a file version loaded within
    it. The ledger says which are loaded."""
    since = now - spec.catch_up.lookback
    with read_only(engine) as connection:
        entries = ledger_entries(connection, spec.table.name)
    partitions_def = spec.partitions_def
    if not isinstance(partitions_def, TimeWindowPartitionsDefinition):
        return sorted(entry.key for entry in entries if entry.loaded_at >= since)
    settle = spec.catch_up.settle if spec.job_type is JobType.SYNC else timedelta(0)
    keys = []
    for entry in entries:
        try:
            window = partitions_def.time_window_for_partition_key(entry.key)
        except Exception:  # a line the source's partitions no longer include
            continue
        if since < window.end and window.end + settle <= now:
            keys.append(entry.key)
    return sorted(keys)


def _evaluation(spec: SourceSpec, verdict: PartitionVerdict,
                target: AssetCheckEvaluationTargetMaterializationData | None,
                ) -> AssetCheckEvaluation:
    metadata = {
        "against": verdict.against, "status": verdict.status.value,
        "source_rows": MetadataValue.int(verdict.source_rows),
        "stored_rows": MetadataValue.int(verdict.stored_rows),
        **{name: MetadataValue.int(n) for name, n in verdict.counts.items()},
        "payload": verdict.payload or "-",
    }
    if not verdict.agrees:
        metadata[FINGERPRINT_KEY] = verdict.fingerprint()
        metadata["differences"] = MetadataValue.md("\n".join(
            f"- {line.strip()}" for line in verdict.lines()))
    return AssetCheckEvaluation(
        asset_key=AssetKey(spec.name), check_name=MATCHES_SOURCE, passed=verdict.agrees,
        partition=verdict.partition_key, description=verdict.summary(), metadata=metadata,
        severity=AssetCheckSeverity.ERROR, blocking=False,
        target_materialization_data=target)


def _latest_materialization(instance: DagsterInstance, spec: SourceSpec, key: str,
                            ) -> AssetCheckEvaluationTargetMaterializationData | None:
    records = instance.fetch_materializations(
        AssetRecordsFilter(asset_key=AssetKey(spec.name), asset_partitions=[key]), limit=1,
        ascending=False).records
    if not records:
        return None
    return AssetCheckEvaluationTargetMaterializationData(
        storage_id=records[0].storage_id, run_id=records[0].run_id,
        timestamp=records[0].timestamp)


def _said_before(instance: DagsterInstance, spec: SourceSpec,
                 keys: Sequence[str]) -> dict[str, tuple[str, int | None]]:
    """Per partition whose latest verdict failed: its differences' fingerprint and the
    materialisation it judged (the same again on the same load is not said again)."""
    history = instance.event_log_storage.get_asset_check_execution_history(
        verification_check_key(spec), limit=4 * len(keys) + 50)
    said: dict[str, tuple[str, int | None]] = {}
    seen: set[str] = set()
    for record in history:  # newest first
        if record.partition is None or record.partition in seen:
            continue
        seen.add(record.partition)
        evaluation = record.event.asset_check_evaluation if record.event else None
        if evaluation is None or evaluation.passed or FINGERPRINT_KEY not in evaluation.metadata:
            continue
        target = evaluation.target_materialization_data
        said[record.partition] = (str(evaluation.metadata[FINGERPRINT_KEY].value),
                                  target.storage_id if target else None)
    return said
