"""The sensor of a file source: every new file version in the inbox becomes a partition and a run.

Each tick lists the inbox (one directory read, or one listing of an ``s3://`` prefix) and hashes
only the files whose size or modification time changed since the cursor saw them, so a tick over
10,000 waiting files opens none of them (on object storage none ever: a version is the ETag and
size the listing gives). A new version (``<name>@<hash>``) is added as a dynamic partition,
checked against the partitions that exist in one query, and gets a run keyed by its content hash:
the same bytes are never processed twice in a row by the sensor, a new version always is (so is
an older version dropped again after a newer one loaded: a revert). The partitions are added
before the runs are submitted, in the same tick; a tick that fails advances no cursor, so the
next one asks again and Dagster's run-key check keeps that from running anything twice. After a
cursor reset every file is hashed once more and the run keys again keep the work from repeating.

A version whose run failed on a transient error (the inbox's share unreadable, the warehouse
away past the run's budget, a lost worker) is asked for again within the source's lookback,
after a backoff (:func:`.automation.catch_up.file_versions_to_retry`), while it is still the
file's version in the inbox; one that failed for a permanent reason waits for an operator.

Re-processing a version on purpose goes around the run key: ``mostovik jobs rerun``, or a run of
the job for that partition launched from the UI.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from dagster import (
    AddDynamicPartitionsRequest,
    AssetKey,
    AssetRecordsFilter,
    DefaultSensorStatus,
    RunRequest,
    SensorEvaluationContext,
    SensorResult,
    sensor,
)

from mostovik_pipelines.core.settings import setting
from mostovik_pipelines.core.tags import REQUESTED_BECAUSE_TAG
from mostovik_pipelines.framework.automation.catch_up import Reason, file_versions_to_retry
from mostovik_pipelines.resources.inbox import InboxResource, file_name_of, version_key

if TYPE_CHECKING:
    from mostovik_pipelines.framework.spec import SourceSpec

MINIMUM_INTERVAL_SECONDS = int(setting("MOSTOVIK_INBOX_SENSOR_INTERVAL_SECONDS", "15"))
"""Seconds between two looks at the inbox."""


def new_file_versions_sensor(spec: SourceSpec, job: Any, resource_key: str):
    """The sensor of ``spec``'s inbox (its resource under ``resource_key``), requesting ``job``."""
    partitions_name = spec.partitions_def.name

    @sensor(
        name=f"{spec.name}_inbox_sensor",
        job=job,
        minimum_interval_seconds=MINIMUM_INTERVAL_SECONDS,
        default_status=DefaultSensorStatus.RUNNING,
        required_resource_keys={resource_key},
        description=f"Start a run of {spec.name} for every new file version in its inbox.",
    )
    def new_file_versions(context: SensorEvaluationContext, **_: Any) -> SensorResult:
        # (A direct invocation, as in tests, also passes the resources by keyword.)
        inbox: InboxResource = getattr(context.resources, resource_key)
        seen: dict[str, list] = json.loads(context.cursor) if context.cursor else {}
        now_seen: dict[str, list] = {}
        new_versions: dict[str, str] = {}
        for file in inbox.files():
            previous = seen.get(file.name)
            if previous and previous[0] == file.size and previous[1] == file.modified_ns:
                now_seen[file.name] = previous
                continue
            try:
                content_hash = inbox.version_hash(file)
            except (FileNotFoundError, PermissionError):
                continue  # gone or not readable yet: the next tick looks again
            now_seen[file.name] = [file.size, file.modified_ns, content_hash]
            new_versions[version_key(file.name, content_hash)] = content_hash
        existing = set(context.instance.get_dynamic_partitions(partitions_name))
        missing = sorted(key for key in new_versions if key not in existing)
        if new_versions:
            context.log.info(f"{len(new_versions)} new file version(s): {sorted(new_versions)}")
        run_keys = {key: _run_key(context, spec, key, content_hash, existing)
                    for key, content_hash in new_versions.items()}
        in_inbox = {version_key(name, seen_file[2]) for name, seen_file in now_seen.items()}
        retries = {key: failed_run for key, failed_run in file_versions_to_retry(
            context.instance, spec, datetime.now(UTC)).items()
            if key in in_inbox and key not in new_versions}
        if retries:
            context.log.info(f"asking again after a transient failure: {sorted(retries)}")
        return SensorResult(
            run_requests=[
                *(RunRequest(partition_key=key, run_key=run_keys[key],
                             tags={REQUESTED_BECAUSE_TAG: Reason.NEW_FILE.value})
                  for key in sorted(new_versions)),
                # One run per failed run: a version whose retry fails too is asked for again
                # once its backoff has passed, never twice for the same failure.
                *(RunRequest(partition_key=key, run_key=f"after:{failed_run}",
                             tags={REQUESTED_BECAUSE_TAG: Reason.AFTER_FAILURE.value})
                  for key, failed_run in sorted(retries.items())),
            ],
            dynamic_partitions_requests=[AddDynamicPartitionsRequest(partitions_name, missing)]
            if missing else [],
            cursor=json.dumps(now_seen, separators=(",", ":")),
        )

    return new_file_versions


def _run_key(context: SensorEvaluationContext, spec: SourceSpec, key: str, content_hash: str,
             existing: set[str]) -> str:
    """The content hash, so the same bytes are not processed again, unless they are a version
    of the file loaded before and dropped again after a newer one was loaded (a revert): then
    the newest load of the file is part of the key, and the revert runs once. (A version that
    never loaded, a failed file, keeps its key: it runs again only on purpose.)"""
    if key not in existing:
        return content_hash
    name = file_name_of(key)
    versions = [other for other in existing if file_name_of(other) == name]
    asset_key = AssetKey(spec.name)
    newest = context.instance.fetch_materializations(
        AssetRecordsFilter(asset_key=asset_key, asset_partitions=versions),
        limit=1, ascending=False).records
    if not newest or newest[0].partition_key == key or not (
            context.instance.fetch_materializations(
                AssetRecordsFilter(asset_key=asset_key, asset_partitions=[key]), limit=1).records):
        return content_hash
    context.log.info(f"{key}: dropped again after {newest[0].partition_key} was loaded")
    return f"{content_hash}:after:{newest[0].storage_id}"
