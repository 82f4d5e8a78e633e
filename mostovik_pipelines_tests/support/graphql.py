"""A GraphQL client that talks to the Dagster webserver the way the Dagster UI does.

:class:`DagsterGraphQL` sends the UI's queries and mutations (:mod:`.graphql_queries`), turns any
error the API answers with (``PythonError``, ``InvalidStepError``, ...) into a
:class:`GraphQLError` that shows it, and waits on the records the UI shows (a run's status, a
backfill's, a sensor's ticks), never a fixed time.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import httpx

from mostovik_pipelines_tests.support import dagster_daemon
from mostovik_pipelines_tests.support.graphql_queries import (
    ASSET_CHECK_EXECUTIONS_QUERY,
    ASSET_MATERIALIZATIONS_QUERY,
    ASSET_NODE_QUERY,
    ASSET_PARTITION_STATUS_QUERY,
    BACKFILL_QUERY,
    DAEMON_HEALTH_QUERY,
    LAUNCH_PARTITION_BACKFILL_MUTATION,
    LAUNCH_PIPELINE_EXECUTION_MUTATION,
    LAUNCH_PIPELINE_REEXECUTION_MUTATION,
    LOCATION_STATUSES_QUERY,
    REPOSITORY_QUERY,
    RUN_ERRORS_QUERY,
    RUN_QUERY,
    RUNS_QUERY,
    SENSOR_TICKS_QUERY,
    STOP_SCHEDULE_MUTATION,
    WORKSPACE_QUERY,
)
from mostovik_pipelines_tests.support.instances import RUN_QUEUE_INTERVAL_SECONDS
from mostovik_pipelines_tests.support.waiting import (
    PROCESS_START_MARGIN_SECONDS,
    limit_for,
    wait_until,
)

LOCATION_NAME = "mostovik_pipelines"
REPOSITORY_NAME = "__repository__"
"""The repository a ``Definitions`` object is served as."""
TERMINAL_RUN_STATUSES = frozenset({"SUCCESS", "FAILURE", "CANCELED"})
TERMINAL_BACKFILL_STATUSES = frozenset(
    {"COMPLETED", "COMPLETED_SUCCESS", "COMPLETED_FAILED", "FAILED", "CANCELED"}
)
BACKFILL_LIMIT_SECONDS = limit_for(dagster_daemon.BACKFILL_INTERVAL_SECONDS, ticks=3)
"""A backfill: one pass of the tests' backfill daemon launches the runs whose partitions are
due, a later one marks the backfill done."""
RUN_LIMIT_SECONDS = limit_for(RUN_QUEUE_INTERVAL_SECONDS) + PROCESS_START_MARGIN_SECONDS
"""A queued run: launched by the queue, its worker process started, its steps run."""


class GraphQLError(AssertionError):
    """The webserver answered with an error: a GraphQL error or an error member of a union."""


@dataclass(frozen=True)
class RunInfo:
    """A run as the UI's run page shows it."""

    run_id: str
    job_name: str
    status: str
    tags: dict[str, str]
    parent_run_id: str | None
    root_run_id: str | None


@dataclass(frozen=True)
class BackfillInfo:
    """A backfill as the UI's backfill page shows it."""

    backfill_id: str
    status: str
    partition_names: list[str]
    error: str | None


@dataclass(frozen=True)
class RepositoryContents:
    """What the code location defines, as the UI's overview lists it."""

    asset_keys: list[str]
    """Asset keys, path parts joined with ``/``."""
    jobs: list[str]
    schedules: dict[str, str]
    """Schedule name -> ``RUNNING`` or ``STOPPED``."""
    sensors: dict[str, str]
    """Sensor name -> ``RUNNING`` or ``STOPPED``."""
    asset_checks: list[str]
    """``<asset key>:<check name>``."""


class DagsterGraphQL:
    """The webserver's GraphQL API at ``url``, used as the Dagster UI uses it.

    ``diagnostics`` returns text (log tails) appended to timeout failures."""

    def __init__(self, url: str, *, location_name: str = LOCATION_NAME,
                 repository_name: str = REPOSITORY_NAME,
                 diagnostics: Callable[[], str] = lambda: "") -> None:
        self.url = url
        self.location_name = location_name
        self.repository_name = repository_name
        self.diagnostics = diagnostics
        self._http = httpx.Client(timeout=60)

    def close(self) -> None:
        self._http.close()

    def execute(self, query: str, variables: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """The ``data`` of one GraphQL request; top-level GraphQL errors raise."""
        response = self._http.post(self.url, json={"query": query,
                                                   "variables": dict(variables or {})})
        try:
            body = response.json()
        except ValueError:
            raise GraphQLError(
                f"HTTP {response.status_code} from {self.url}: {response.text[:2000]}"
            ) from None
        if body.get("errors"):
            raise GraphQLError(f"GraphQL errors: {json.dumps(body['errors'], indent=1)[:4000]}")
        if response.status_code != 200:
            raise GraphQLError(f"HTTP {response.status_code} from {self.url}: {body}")
        return body["data"]

    def location_statuses(self) -> dict[str, str]:
        """Code location name -> ``LOADING`` or ``LOADED``."""
        result = _expect(self.execute(LOCATION_STATUSES_QUERY)["locationStatusesOrError"],
                         "WorkspaceLocationStatusEntries")
        return {entry["name"]: entry["loadStatus"] for entry in result["entries"]}

    def location_load_error(self) -> str | None:
        """The error the code location failed to load with, ``None`` if it loaded."""
        name = self.location_name
        workspace = _expect(self.execute(WORKSPACE_QUERY)["workspaceOrError"], "Workspace")
        for entry in workspace["locationEntries"]:
            if entry["name"] != name:
                continue
            location = entry["locationOrLoadError"]
            if location is None:
                return f"code location {name} is {entry['loadStatus']} with no location yet"
            if location["__typename"] != "RepositoryLocation":
                return _describe(location)
            return None
        raise GraphQLError(f"no code location {name} in the workspace: {workspace}")

    def daemon_statuses(self) -> dict[str, dict[str, Any]]:
        """Daemon type -> its status (``required``, ``healthy``, ``lastHeartbeatErrors``)."""
        statuses = self.execute(DAEMON_HEALTH_QUERY)["instance"]["daemonHealth"]
        return {status["daemonType"]: status for status in statuses["allDaemonStatuses"]}

    def repository_contents(self) -> RepositoryContents:
        """Asset keys, jobs, schedules and sensors (with status) and asset checks."""
        repository = _expect(
            self.execute(REPOSITORY_QUERY, {"repositorySelector": self._repository_selector()})[
                "repositoryOrError"],
            "Repository",
        )
        asset_keys, checks = [], []
        for node in repository["assetNodes"]:
            key = "/".join(node["assetKey"]["path"])
            asset_keys.append(key)
            node_checks = node["assetChecksOrError"]
            if node_checks["__typename"] == "AssetChecks":
                checks.extend(f"{key}:{check['name']}" for check in node_checks["checks"])
        return RepositoryContents(
            asset_keys=sorted(asset_keys),
            jobs=sorted(job["name"] for job in repository["jobs"]),
            schedules={s["name"]: s["scheduleState"]["status"] for s in repository["schedules"]},
            sensors={s["name"]: s["sensorState"]["status"] for s in repository["sensors"]},
            asset_checks=sorted(checks),
        )

    def stop_schedule(self, name: str) -> None:
        """Stop schedule ``name`` as the UI's toggle on the schedule's page does."""
        repository = _expect(
            self.execute(REPOSITORY_QUERY, {"repositorySelector": self._repository_selector()})[
                "repositoryOrError"],
            "Repository",
        )
        [state_id] = [s["scheduleState"]["id"] for s in repository["schedules"]
                      if s["name"] == name]
        result = _expect(self.execute(STOP_SCHEDULE_MUTATION, {"id": state_id})[
            "stopRunningSchedule"], "ScheduleStateResult")
        assert result["scheduleState"]["status"] == "STOPPED", result

    def launch_partition_backfill(self, asset_keys: Sequence[str | Sequence[str]],
                                  partition_names: Sequence[str],
                                  tags: Mapping[str, str] | None = None) -> str:
        """An asset backfill of ``partition_names``, as the UI's "Materialize selected" dialog
        launches it (with the dialog's ``tags``, which its runs carry); its backfill id. A
        string key is a one-part asset key path."""
        backfill_params = {
            "assetSelection": [{"path": [key] if isinstance(key, str) else list(key)}
                               for key in asset_keys],
            "partitionNames": list(partition_names),
            "fromFailure": False,
            "tags": [{"key": key, "value": value} for key, value in (tags or {}).items()],
        }
        result = _expect(
            self.execute(LAUNCH_PARTITION_BACKFILL_MUTATION,
                         {"backfillParams": backfill_params})["launchPartitionBackfill"],
            "LaunchBackfillSuccess",
        )
        return result["backfillId"]

    def backfill_status(self, backfill_id: str) -> BackfillInfo:
        backfill = _expect(
            self.execute(BACKFILL_QUERY, {"backfillId": backfill_id})["partitionBackfillOrError"],
            "PartitionBackfill",
        )
        return BackfillInfo(
            backfill_id=backfill["id"],
            status=backfill["status"],
            partition_names=backfill["partitionNames"] or [],
            error=_describe(backfill["error"]) if backfill["error"] else None,
        )

    def runs_of_backfill(self, backfill_id: str) -> list[RunInfo]:
        """The runs a backfill launched (tagged ``dagster/backfill``), newest first."""
        return self.runs({"tags": [{"key": "dagster/backfill", "value": backfill_id}]})

    def wait_for_backfill_runs(self, backfill_id: str,
                               timeout: float = BACKFILL_LIMIT_SECONDS) -> list[RunInfo]:
        """The backfill's runs once the daemon has launched one and they are all finished,
        without waiting for the daemon to mark the backfill itself finished (its next pass)."""
        def finished() -> list[RunInfo]:
            runs = self.runs_of_backfill(backfill_id)
            return runs if runs and all(r.status in TERMINAL_RUN_STATUSES for r in runs) else []

        return wait_until(finished, timeout, f"backfill {backfill_id}: its runs finished",
                          lambda: f"runs {self.runs_of_backfill(backfill_id)}\n"
                                  f"{self.diagnostics()}", poll=0.5)

    def runs(self, runs_filter: Mapping[str, Any], limit: int = 100) -> list[RunInfo]:
        """Runs matching a GraphQL ``RunsFilter``, newest first."""
        result = _expect(
            self.execute(RUNS_QUERY, {"filter": dict(runs_filter), "limit": limit})["runsOrError"],
            "Runs",
        )
        return [_run_info(run) for run in result["results"]]

    def launch_job_run(self, job_name: str, partition_key: str | None = None,
                       tags: Mapping[str, str] | None = None) -> str:
        """A run of ``job_name`` (for one partition), as the launchpad launches it; its run id."""
        run_tags = dict(tags or {})
        if partition_key is not None:
            run_tags["dagster/partition"] = partition_key
        execution_params = {
            "selector": {
                "repositoryLocationName": self.location_name,
                "repositoryName": self.repository_name,
                "jobName": job_name,
            },
            "runConfigData": {},
            "mode": "default",
            "executionMetadata": {
                "tags": [{"key": key, "value": value} for key, value in run_tags.items()]
            },
        }
        result = _expect(
            self.execute(LAUNCH_PIPELINE_EXECUTION_MUTATION,
                         {"executionParams": execution_params})["launchPipelineExecution"],
            "LaunchRunSuccess",
        )
        return result["run"]["runId"]

    def launch_reexecution(self, parent_run_id: str, strategy: str) -> str:
        """A re-execution of ``parent_run_id`` (``FROM_FAILURE``, ``ALL_STEPS`` or
        ``FROM_ASSET_FAILURE``), as the run page's "Re-execute" menu launches it; its run id."""
        result = _expect(
            self.execute(LAUNCH_PIPELINE_REEXECUTION_MUTATION, {
                "reexecutionParams": {"parentRunId": parent_run_id, "strategy": strategy},
            })["launchPipelineReexecution"],
            "LaunchRunSuccess",
        )
        return result["run"]["runId"]

    def run(self, run_id: str) -> RunInfo:
        run = _expect(self.execute(RUN_QUERY, {"runId": run_id})["runOrError"], "Run")
        return _run_info(run)

    def run_errors(self, run_id: str) -> list[str]:
        """The messages of the run's step and run failures, as its event log shows them."""
        run = _expect(self.execute(RUN_ERRORS_QUERY, {"runId": run_id})["runOrError"], "Run")
        messages = []
        for event in run["eventConnection"]["events"]:
            if event["__typename"] not in ("ExecutionStepFailureEvent", "RunFailureEvent"):
                continue
            parts = [event.get("stepKey") or "run", event["message"]]
            if (event.get("failureMetadata") or {}).get("description"):
                parts.append(event["failureMetadata"]["description"])
            if event.get("error"):
                parts.append(event["error"]["message"])
                # What the step's own code raised: Dagster wraps it, naming only the op.
                parts += [link["error"]["message"]
                          for link in event["error"].get("errorChain") or ()]
            messages.append(": ".join(part.strip() for part in parts if part))
        return messages

    def wait_for_run(self, run_id: str, timeout: float = RUN_LIMIT_SECONDS) -> RunInfo:
        """The run once it is SUCCESS, FAILURE or CANCELED; fails after ``timeout`` seconds."""
        def finished() -> RunInfo | None:
            run = self.run(run_id)
            return run if run.status in TERMINAL_RUN_STATUSES else None

        return wait_until(finished, timeout, f"run {run_id} finished",
                          lambda: f"status {self.run(run_id).status}\n{self.diagnostics()}",
                          poll=0.5)

    def wait_for_backfill(self, backfill_id: str,
                          timeout: float = BACKFILL_LIMIT_SECONDS) -> BackfillInfo:
        """The backfill once the daemon has finished it; fails after ``timeout`` seconds."""
        def finished() -> BackfillInfo | None:
            backfill = self.backfill_status(backfill_id)
            return backfill if backfill.status in TERMINAL_BACKFILL_STATUSES else None

        def state() -> str:
            runs = [(run.run_id, run.status) for run in self.runs_of_backfill(backfill_id)]
            return (f"still {self.backfill_status(backfill_id).status}; its runs: {runs}\n"
                    f"{self.diagnostics()}")

        return wait_until(finished, timeout, f"backfill {backfill_id} finished", state, poll=1)

    def asset_node(self, asset_key: str) -> dict[str, Any]:
        """What the asset graph and the asset page show of an asset: description, group,
        kinds, owners, metadata (the column schema), freshness policy and status."""
        return _expect(self.execute(ASSET_NODE_QUERY, {"assetKey": {"path": [asset_key]}})[
            "assetNodeOrError"], "AssetNode")

    def partition_metadata(self, asset_key: str,
                           partitions: Sequence[str]) -> dict[str, dict[str, Any]]:
        """Partition -> the metadata of its latest materialisation, as the asset's partition
        view shows it and its plots read it (numbers as numbers, Markdown as text)."""
        node = _expect(self.execute(ASSET_MATERIALIZATIONS_QUERY, {
            "assetKey": {"path": [asset_key]}, "partitions": list(partitions),
        })["assetNodeOrError"], "AssetNode")
        latest: dict[str, dict[str, Any]] = {}
        for event in node["assetMaterializations"]:  # newest first
            if event["partition"] in latest:
                continue
            latest[event["partition"]] = {"run_id": event["runId"], **{
                entry["label"]: next((entry[field] for field in (
                    "intValue", "floatValue", "text", "mdStr") if field in entry), None)
                for entry in event["metadataEntries"]}}
        return latest

    def partition_status_ranges(self, asset_key: str) -> list[tuple[str, str, str]]:
        """The partition bar of a time-partitioned asset's page: ``(status, first key, last
        key)`` per range of partitions ``MATERIALIZED``, ``FAILED`` or ``MATERIALIZING``;
        a partition in no range is missing."""
        node = _expect(self.execute(ASSET_PARTITION_STATUS_QUERY, {
            "assetKey": {"path": [asset_key]}})["assetNodeOrError"], "AssetNode")
        return [(entry["status"], entry["startKey"], entry["endKey"])
                for entry in node["assetPartitionStatuses"]["ranges"]]

    def materialized_partitions(self, asset_key: str,
                                partition_keys: Sequence[str]) -> list[str]:
        """The partitions the asset's page shows materialised, of ``partition_keys`` (the
        asset's own, in order: a time-partitioned asset's ranges are read against them)."""
        node = _expect(self.execute(ASSET_PARTITION_STATUS_QUERY, {
            "assetKey": {"path": [asset_key]}})["assetNodeOrError"], "AssetNode")
        statuses = node["assetPartitionStatuses"]
        if "materializedPartitions" in statuses:
            return [key for key in partition_keys if key in statuses["materializedPartitions"]]
        shown = set()
        for entry in statuses["ranges"]:
            if entry["status"] == "MATERIALIZED":
                first = partition_keys.index(entry["startKey"])
                shown.update(partition_keys[first:partition_keys.index(entry["endKey"]) + 1])
        return [key for key in partition_keys if key in shown]

    def check_executions(self, asset_key: str, check_name: str,
                         partition: str | None = None, limit: int = 50) -> list[dict[str, Any]]:
        """The executions of an asset check (of one partition), newest first: run id, status
        (``SUCCEEDED``, ``FAILED``...), partition, and the evaluation's severity."""
        return self.execute(ASSET_CHECK_EXECUTIONS_QUERY, {
            "assetKey": {"path": [asset_key]}, "checkName": check_name,
            "partition": partition, "limit": limit,
        })["assetCheckExecutions"]

    def sensor_ticks(self, sensor_name: str, limit: int = 5) -> list[dict[str, Any]]:
        """The latest ``limit`` ticks of a sensor, newest first, as its page lists them."""
        sensor = _expect(self.execute(SENSOR_TICKS_QUERY, {"sensorSelector": {
            **self._repository_selector(), "sensorName": sensor_name,
        }, "limit": limit})["sensorOrError"], "Sensor")
        return sensor["sensorState"]["ticks"]

    def wait_for_sensor_tick(self, sensor_name: str, interval_seconds: float) -> None:
        """Once the daemon has evaluated the sensor (every ``interval_seconds``) at least
        once."""
        wait_until(lambda: self.sensor_ticks(sensor_name), limit_for(interval_seconds),
                   f"sensor {sensor_name}: a tick", self.diagnostics, poll=1)

    def wait_for_more_ticks(self, sensor_name: str, count: int,
                            interval_seconds: float) -> None:
        """Until the daemon has evaluated the sensor (every ``interval_seconds``) ``count`` more
        times than so far."""
        seen = {tick["id"] for tick in self.sensor_ticks(sensor_name)}
        wait_until(
            lambda: len({tick["id"] for tick in self.sensor_ticks(sensor_name)} - seen) >= count,
            limit_for(interval_seconds, count), f"sensor {sensor_name}: {count} new ticks",
            self.diagnostics, poll=1)

    def _repository_selector(self) -> dict[str, str]:
        return {"repositoryLocationName": self.location_name,
                "repositoryName": self.repository_name}


def _expect(result: Mapping[str, Any], typename: str) -> dict[str, Any]:
    """``result`` if it is a ``typename``; any other member of the union (an error) raises."""
    if result.get("__typename") != typename:
        raise GraphQLError(f"expected {typename}, got {_describe(result)}")
    return dict(result)


def _describe(error: Mapping[str, Any]) -> str:
    """An error member of a result union as text: its type, message and any details."""
    details = {key: value for key, value in error.items()
               if key not in ("__typename", "message", "stack", "errorChain")}
    text = f"{error.get('__typename', 'error')}: {error.get('message', '')}"
    if details:
        text += f" {json.dumps(details)}"
    if error.get("stack"):
        text += "\n" + "".join(error["stack"])[-3000:]
    for link in error.get("errorChain") or []:
        text += f"\ncaused by: {link['error']['message']}"
    return text


def _run_info(run: Mapping[str, Any]) -> RunInfo:
    return RunInfo(
        run_id=run["runId"],
        job_name=run["jobName"],
        status=run["status"],
        tags={tag["key"]: tag["value"] for tag in run["tags"]},
        parent_run_id=run["parentRunId"],
        root_run_id=run["rootRunId"],
    )
