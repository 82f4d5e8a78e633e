"""The bodies of every source's three ops (:mod:`..factory` declares them and calls these)."""

from __future__ import annotations

from dagster import AssetKey, OpExecutionContext

from mostovik_pipelines.framework.spec import SourceSpec
from mostovik_pipelines.framework.steps.extract import extract_partition
from mostovik_pipelines.framework.steps.lifecycle import (
    older_run_stops_this_one,
    running_step,
    stopped,
)
from mostovik_pipelines.framework.steps.load import load_partitions
from mostovik_pipelines.framework.steps.outcomes import LandedPages, StepOutcomes
from mostovik_pipelines.framework.steps.reexecution import inherited, redo
from mostovik_pipelines.framework.steps.transform import known_payloads, transform_partition
from mostovik_pipelines.resources.landing import LandedPayload


def extract(context: OpExecutionContext, spec: SourceSpec, reuse_landed: bool,
            full_resync: bool) -> StepOutcomes:
    """Land every partition of the run (the run's first step)."""
    with running_step(context, spec):
        reason = older_run_stops_this_one(context, spec)
        if reason:
            return stopped(context, reason)
        outcomes = {key: extract_partition(context, spec, key, reuse_landed, full_resync)
                    for key in context.partition_keys}
        landed = [payload for o in outcomes.values()
                  for payload in (o.pages if isinstance(o, LandedPages) else [o])
                  if isinstance(payload, LandedPayload)]
        context.log.info(
            f"{spec.name}: landed {len(landed)} payload(s) for {len(outcomes)} partition(s), "
            f"{sum(o.size_bytes for o in landed)} bytes"
        )
        return StepOutcomes(context.run_id, outcomes)


def transform(context: OpExecutionContext, spec: SourceSpec,
              extracted: StepOutcomes) -> StepOutcomes:
    """Parse and validate what extract landed; a re-execution's first step lands it again."""
    with running_step(context, spec):
        if inherited(context, extracted):
            reason = older_run_stops_this_one(context, spec)
            if reason:
                return stopped(context, reason)
            return StepOutcomes(context.run_id, redo(context, spec, transform=True))
        stored = known_payloads(context, spec)
        outcomes = {
            key: transform_partition(context, spec, key, landed, stored)
            if isinstance(landed, LandedPayload | LandedPages) else landed
            for key, landed in extracted.partitions.items()
        }
        return StepOutcomes(context.run_id, outcomes)


def load(context: OpExecutionContext, spec: SourceSpec, transformed: StepOutcomes) -> str:
    """Load and check every partition transform validated; the job's status and figures."""
    with running_step(context, spec):
        if inherited(context, transformed):
            reason = older_run_stops_this_one(context, spec)
            outcomes = (stopped(context, reason) if reason
                        else StepOutcomes(context.run_id, redo(context, spec, transform=True)))
        else:
            outcomes = transformed
        return load_partitions(context, spec, AssetKey(spec.name), outcomes)
