"""The real ``dagster-webserver`` and ``dagster-daemon`` for tests, and a GraphQL client that talks
to the webserver the way the Dagster UI does.

:class:`DagsterServices` starts both, in sessions of their own, on a DAGSTER_HOME (e.g. the
production instance of :func:`~mostovik_pipelines_tests.support.instances.production_instance`),
serving this project's code location from a workspace file, and kills both whole process groups
(their code servers and the run workers the daemon launched included) when it exits.

:class:`DagsterGraphQL` sends the queries and mutations of the UI's own bundle (the UI's Apollo
client adds ``__typename`` to every selection, so the payloads match what a browser sends), and
turns any error the API answers with (``PythonError``, ``InvalidStepError``, ...) into an
``AssertionError`` that shows it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from mostovik_pipelines_tests.support import dagster_daemon
from mostovik_pipelines_tests.support.instances import (
    RUN_QUEUE_INTERVAL_SECONDS,
    create_instance_storage,
)
from mostovik_pipelines_tests.support.postgres import free_port
from mostovik_pipelines_tests.support.processes import DAGSTER, REPO
from mostovik_pipelines_tests.support.waiting import PROCESS_START_MARGIN_SECONDS, limit_for

BIN = Path(DAGSTER).parent
LOCATION_NAME = "mostovik_pipelines"
REPOSITORY_NAME = "__repository__"
"""The repository a ``Definitions`` object is served as."""
TERMINAL_RUN_STATUSES = frozenset({"SUCCESS", "FAILURE", "CANCELED"})
TERMINAL_BACKFILL_STATUSES = frozenset(
    {"COMPLETED", "COMPLETED_SUCCESS", "COMPLETED_FAILED", "FAILED", "CANCELED"}
)
LOG_TAIL_CHARS = 4000
BACKFILL_LIMIT_SECONDS = limit_for(dagster_daemon.BACKFILL_INTERVAL_SECONDS, ticks=3)
"""A backfill: one pass of the tests' backfill daemon launches the runs whose partitions are
due, a later one marks the backfill done."""
RUN_LIMIT_SECONDS = limit_for(RUN_QUEUE_INTERVAL_SECONDS) + PROCESS_START_MARGIN_SECONDS
"""A queued run: launched by the queue, its worker process started, its steps run."""
SUPERVISOR_RESTART_SECONDS = 5.0
"""deploy/systemd's ``RestartSec`` for the webserver and the daemon."""
ANSI_COLOUR = re.compile(r"\x1b\[[0-9;]*m")


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


PYTHON_ERROR_FRAGMENT = """
  fragment PythonErrorFragment on PythonError {
    __typename
    message
    stack
    errorChain {
      isExplicitLink
      error {
        message
        stack
      }
    }
  }
"""

LOCATION_STATUSES_QUERY = """
  query CodeLocationStatusQuery {
    locationStatusesOrError {
      __typename
      ... on WorkspaceLocationStatusEntries {
        entries {
          id
          name
          loadStatus
          updateTimestamp
        }
      }
      ...PythonErrorFragment
    }
  }
""" + PYTHON_ERROR_FRAGMENT

WORKSPACE_QUERY = """
  query WorkspaceLocationsQuery {
    workspaceOrError {
      __typename
      ... on Workspace {
        id
        locationEntries {
          id
          name
          loadStatus
          locationOrLoadError {
            __typename
            ... on RepositoryLocation {
              id
              name
              repositories {
                id
                name
              }
            }
            ...PythonErrorFragment
          }
        }
      }
      ...PythonErrorFragment
    }
  }
""" + PYTHON_ERROR_FRAGMENT

DAEMON_HEALTH_QUERY = """
  query InstanceHealthQuery {
    instance {
      id
      daemonHealth {
        id
        allDaemonStatuses {
          id
          daemonType
          required
          healthy
          lastHeartbeatTime
          lastHeartbeatErrors {
            ...PythonErrorFragment
          }
        }
      }
    }
  }
""" + PYTHON_ERROR_FRAGMENT

REPOSITORY_QUERY = """
  query RepositoryContentsQuery($repositorySelector: RepositorySelector!) {
    repositoryOrError(repositorySelector: $repositorySelector) {
      __typename
      ... on Repository {
        id
        name
        jobs {
          id
          name
        }
        schedules {
          id
          name
          scheduleState {
            id
            status
          }
        }
        sensors {
          id
          name
          sensorState {
            id
            status
          }
        }
        assetNodes {
          id
          assetKey {
            path
          }
          assetChecksOrError {
            __typename
            ... on AssetChecks {
              checks {
                name
              }
            }
          }
        }
      }
      ... on RepositoryNotFoundError {
        message
      }
      ...PythonErrorFragment
    }
  }
""" + PYTHON_ERROR_FRAGMENT

STOP_SCHEDULE_MUTATION = """
  mutation StopRunningSchedule($id: String!) {
    stopRunningSchedule(id: $id) {
      __typename
      ... on ScheduleStateResult {
        scheduleState {
          id
          status
        }
      }
      ... on PythonError {
        message
        stack
      }
      ... on UnauthorizedError {
        message
      }
    }
  }
"""

LAUNCH_PARTITION_BACKFILL_MUTATION = """
  mutation LaunchPartitionBackfill($backfillParams: LaunchBackfillParams!) {
    launchPartitionBackfill(backfillParams: $backfillParams) {
      __typename
      ... on LaunchBackfillSuccess {
        backfillId
      }
      ... on PartitionSetNotFoundError {
        message
      }
      ... on PartitionKeysNotFoundError {
        message
      }
      ... on InvalidStepError {
        invalidStepKey
      }
      ... on InvalidOutputError {
        stepKey
        invalidOutputName
      }
      ... on UnauthorizedError {
        message
      }
      ... on PipelineNotFoundError {
        message
      }
      ... on RunConflict {
        message
      }
      ... on ConflictingExecutionParamsError {
        message
      }
      ... on PresetNotFoundError {
        message
      }
      ... on RunConfigValidationInvalid {
        pipelineName
        errors {
          message
          path
          reason
        }
      }
      ...PythonErrorFragment
    }
  }
""" + PYTHON_ERROR_FRAGMENT

BACKFILL_QUERY = """
  query BackfillStatusQuery($backfillId: String!) {
    partitionBackfillOrError(backfillId: $backfillId) {
      __typename
      ... on PartitionBackfill {
        id
        status
        partitionNames
        error {
          ...PythonErrorFragment
        }
      }
      ... on BackfillNotFoundError {
        message
      }
      ...PythonErrorFragment
    }
  }
""" + PYTHON_ERROR_FRAGMENT

RUN_FIELDS = """
  fragment RunInfoFragment on Run {
    id
    runId
    jobName
    status
    parentRunId
    rootRunId
    tags {
      key
      value
    }
  }
"""

RUNS_QUERY = """
  query RunsByTagQuery($filter: RunsFilter, $limit: Int) {
    runsOrError(filter: $filter, limit: $limit) {
      __typename
      ... on Runs {
        results {
          ...RunInfoFragment
        }
      }
      ... on InvalidPipelineRunsFilterError {
        message
      }
      ...PythonErrorFragment
    }
  }
""" + RUN_FIELDS + PYTHON_ERROR_FRAGMENT

RUN_QUERY = """
  query RunRootQuery($runId: ID!) {
    runOrError(runId: $runId) {
      __typename
      ...RunInfoFragment
      ... on RunNotFoundError {
        message
      }
      ...PythonErrorFragment
    }
  }
""" + RUN_FIELDS + PYTHON_ERROR_FRAGMENT

RUN_ERRORS_QUERY = """
  query RunErrorsQuery($runId: ID!) {
    runOrError(runId: $runId) {
      __typename
      ... on Run {
        id
        eventConnection {
          events {
            __typename
            ... on ExecutionStepFailureEvent {
              stepKey
              message
              error {
                message
                errorChain {
                  error {
                    message
                  }
                }
              }
              failureMetadata {
                description
              }
            }
            ... on RunFailureEvent {
              message
              error {
                message
              }
            }
          }
        }
      }
      ... on RunNotFoundError {
        message
      }
      ...PythonErrorFragment
    }
  }
""" + PYTHON_ERROR_FRAGMENT

LAUNCH_RESULT_MEMBERS = """
      ... on PipelineNotFoundError {
        message
      }
      ... on InvalidSubsetError {
        message
      }
      ... on RunConfigValidationInvalid {
        errors {
          message
        }
      }
      ... on InvalidStepError {
        invalidStepKey
      }
      ... on InvalidOutputError {
        stepKey
        invalidOutputName
      }
      ... on RunConflict {
        message
      }
      ... on UnauthorizedError {
        message
      }
      ... on ConflictingExecutionParamsError {
        message
      }
      ... on PresetNotFoundError {
        message
      }
      ... on NoModeProvidedError {
        message
      }
      ...PythonErrorFragment
"""

LAUNCH_PIPELINE_EXECUTION_MUTATION = """
  mutation LaunchPipelineExecution($executionParams: ExecutionParams!) {
    launchPipelineExecution(executionParams: $executionParams) {
      __typename
      ... on LaunchRunSuccess {
        run {
          id
          runId
          pipelineName
        }
      }
""" + LAUNCH_RESULT_MEMBERS + """
    }
  }
""" + PYTHON_ERROR_FRAGMENT

LAUNCH_PIPELINE_REEXECUTION_MUTATION = """
  mutation LaunchPipelineReexecution(
    $executionParams: ExecutionParams
    $reexecutionParams: ReexecutionParams
  ) {
    launchPipelineReexecution(
      executionParams: $executionParams
      reexecutionParams: $reexecutionParams
    ) {
      __typename
      ... on LaunchRunSuccess {
        run {
          id
          runId
          pipelineName
          rootRunId
          parentRunId
        }
      }
""" + LAUNCH_RESULT_MEMBERS + """
    }
  }
""" + PYTHON_ERROR_FRAGMENT


ASSET_NODE_QUERY = """
  query AssetNodeQuery($assetKey: AssetKeyInput!) {
    assetNodeOrError(assetKey: $assetKey) {
      __typename
      ... on AssetNode {
        id
        description
        groupName
        kinds
        isPartitioned
        owners {
          __typename
          ... on TeamAssetOwner {
            team
          }
          ... on UserAssetOwner {
            email
          }
        }
        metadataEntries {
          __typename
          label
          ... on TableSchemaMetadataEntry {
            schema {
              columns {
                name
                type
                description
              }
            }
          }
        }
        internalFreshnessPolicy {
          __typename
          ... on CronFreshnessPolicy {
            deadlineCron
            timezone
          }
          ... on TimeWindowFreshnessPolicy {
            failWindowSeconds
          }
        }
        freshnessStatusInfo {
          freshnessStatus
        }
      }
      ... on AssetNotFoundError {
        message
      }
    }
  }
"""

ASSET_MATERIALIZATIONS_QUERY = """
  query AssetPartitionEventsQuery($assetKey: AssetKeyInput!, $partitions: [String!]) {
    assetNodeOrError(assetKey: $assetKey) {
      __typename
      ... on AssetNode {
        id
        assetMaterializations(partitions: $partitions) {
          partition
          runId
          metadataEntries {
            __typename
            label
            ... on IntMetadataEntry {
              intValue
            }
            ... on FloatMetadataEntry {
              floatValue
            }
            ... on TextMetadataEntry {
              text
            }
            ... on MarkdownMetadataEntry {
              mdStr
            }
          }
        }
      }
      ... on AssetNotFoundError {
        message
      }
    }
  }
"""

ASSET_PARTITION_STATUS_QUERY = """
  query AssetPartitionStatusQuery($assetKey: AssetKeyInput!) {
    assetNodeOrError(assetKey: $assetKey) {
      __typename
      ... on AssetNode {
        id
        assetPartitionStatuses {
          __typename
          ... on TimePartitionStatuses {
            ranges {
              status
              startKey
              endKey
            }
          }
        }
      }
      ... on AssetNotFoundError {
        message
      }
    }
  }
"""

ASSET_CHECK_EXECUTIONS_QUERY = """
  query AssetCheckExecutionsQuery(
    $assetKey: AssetKeyInput!
    $checkName: String!
    $partition: String
    $limit: Int!
  ) {
    assetCheckExecutions(
      assetKey: $assetKey
      checkName: $checkName
      partition: $partition
      limit: $limit
    ) {
      id
      runId
      status
      partition
      evaluation {
        severity
        description
      }
    }
  }
"""

SENSOR_TICKS_QUERY = """
  query SensorTicksQuery($sensorSelector: SensorSelector!) {
    sensorOrError(sensorSelector: $sensorSelector) {
      __typename
      ... on Sensor {
        id
        sensorState {
          id
          status
          ticks(limit: 5) {
            id
            status
            timestamp
          }
        }
      }
      ... on SensorNotFoundError {
        message
      }
      ...PythonErrorFragment
    }
  }
""" + PYTHON_ERROR_FRAGMENT


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
        deadline = time.monotonic() + timeout
        while True:
            runs = self.runs_of_backfill(backfill_id)
            if runs and all(run.status in TERMINAL_RUN_STATUSES for run in runs):
                return runs
            if time.monotonic() > deadline:
                raise AssertionError(f"backfill {backfill_id}: runs {runs} not finished after "
                                     f"{timeout:.0f} s\n{self.diagnostics()}")
            time.sleep(0.5)

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
        deadline = time.monotonic() + timeout
        while True:
            run = self.run(run_id)
            if run.status in TERMINAL_RUN_STATUSES:
                return run
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"run {run_id} still {run.status} after {timeout:.0f} s\n{self.diagnostics()}"
                )
            time.sleep(0.5)

    def wait_for_backfill(self, backfill_id: str,
                          timeout: float = BACKFILL_LIMIT_SECONDS) -> BackfillInfo:
        """The backfill once the daemon has finished it; fails after ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            backfill = self.backfill_status(backfill_id)
            if backfill.status in TERMINAL_BACKFILL_STATUSES:
                return backfill
            if time.monotonic() > deadline:
                runs = [(run.run_id, run.status) for run in self.runs_of_backfill(backfill_id)]
                raise AssertionError(
                    f"backfill {backfill_id} still {backfill.status} after {timeout:.0f} s; "
                    f"its runs: {runs}\n{self.diagnostics()}"
                )
            time.sleep(1)

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

    def check_executions(self, asset_key: str, check_name: str,
                         partition: str | None = None, limit: int = 50) -> list[dict[str, Any]]:
        """The executions of an asset check (of one partition), newest first: run id, status
        (``SUCCEEDED``, ``FAILED``...), partition, and the evaluation's severity."""
        return self.execute(ASSET_CHECK_EXECUTIONS_QUERY, {
            "assetKey": {"path": [asset_key]}, "checkName": check_name,
            "partition": partition, "limit": limit,
        })["assetCheckExecutions"]

    def sensor_ticks(self, sensor_name: str) -> list[dict[str, Any]]:
        """The latest ticks of a sensor, newest first."""
        sensor = _expect(self.execute(SENSOR_TICKS_QUERY, {"sensorSelector": {
            **self._repository_selector(), "sensorName": sensor_name,
        }})["sensorOrError"], "Sensor")
        return sensor["sensorState"]["ticks"]

    def wait_for_sensor_tick(self, sensor_name: str, interval_seconds: float) -> None:
        """Once the daemon has evaluated the sensor (every ``interval_seconds``) at least
        once."""
        timeout = limit_for(interval_seconds)
        deadline = time.monotonic() + timeout
        while not self.sensor_ticks(sensor_name):
            if time.monotonic() > deadline:
                raise AssertionError(f"sensor {sensor_name} has no tick after {timeout:.0f} s\n"
                                     f"{self.diagnostics()}")
            time.sleep(1)

    def wait_for_more_ticks(self, sensor_name: str, count: int,
                            interval_seconds: float) -> None:
        """Until the daemon has evaluated the sensor (every ``interval_seconds``) ``count`` more
        times than so far."""
        timeout = limit_for(interval_seconds, count)
        seen = {tick["id"] for tick in self.sensor_ticks(sensor_name)}
        deadline = time.monotonic() + timeout
        while len({tick["id"] for tick in self.sensor_ticks(sensor_name)} - seen) < count:
            if time.monotonic() > deadline:
                raise AssertionError(f"sensor {sensor_name}: fewer than {count} new ticks in "
                                     f"{timeout:.0f} s\n{self.diagnostics()}")
            time.sleep(1)

    def _repository_selector(self) -> dict[str, str]:
        return {"repositoryLocationName": self.location_name,
                "repositoryName": self.repository_name}


DAEMON_UNIT = REPO / "deploy" / "systemd" / "mostovik-daemon.service"


def daemon_unit_environment() -> dict[str, str]:
    """The ``Environment=`` settings of the deployment's daemon unit: the tests' daemon runs
    with them, as systemd starts it."""
    return dict(line.removeprefix("Environment=").split("=", 1)
                for line in DAEMON_UNIT.read_text().splitlines()
                if line.startswith("Environment="))


class DagsterServices:
    """``dagster-webserver`` and ``dagster-daemon`` on ``dagster_home``, serving this project's
    code location, with logs and the workspace file under ``work_dir``; a context manager.

    ``environment`` is added to this process's environment for both (and so for their code
    servers and run workers): the instance's settings and the code location's ``MOSTOVIK_*``.
    ``code_location_module``'s ``defs`` is the location served (the project's by default).
    """

    def __init__(self, work_dir: Path, dagster_home: Path, environment: Mapping[str, str],
                 *, location_name: str = LOCATION_NAME,
                 stopped_schedules: Sequence[str] = (),
                 workspace_file: Path | None = None,
                 code_location_module: str = "mostovik_pipelines") -> None:
        self.work_dir = work_dir
        self.given_workspace = workspace_file
        """A workspace file to serve (e.g. deploy/workspace.yaml: a code server over gRPC)
        instead of the package loaded by each service."""
        self.code_location_module = code_location_module
        self.stopped_schedules = tuple(stopped_schedules)
        self.dagster_home = dagster_home
        self.environment = {**os.environ, **environment, "DAGSTER_HOME": str(dagster_home)}
        self.location_name = location_name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.workspace_file = work_dir / "workspace.yaml"
        self.webserver_log = work_dir / "webserver.log"
        self.daemon_log = work_dir / "daemon.log"
        self.graphql = DagsterGraphQL(f"{self.url}/graphql", location_name=location_name,
                                      diagnostics=self.log_tails)
        self._processes: dict[str, subprocess.Popen] = {}
        self._left_behind: list[int] = []
        """Process groups of killed processes: what they left running (code servers, run
        workers) is ended with the services."""
        self._daemon_started_at = 0.0
        """When the running daemon was started: only its heartbeats since count as healthy (a
        killed daemon's last heartbeats still read as healthy for a while)."""

    def __enter__(self) -> DagsterServices:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self, timeout: float = 180) -> None:
        """Start both, then wait until the code location is loaded and every daemon the
        instance requires is healthy. The ``stopped_schedules`` are stopped in the UI before
        the daemon starts, so none of them ever ticks."""
        self._write_workspace()
        create_instance_storage(self.dagster_home, self.environment)
        self._start_webserver()
        deadline = time.monotonic() + timeout
        if self.stopped_schedules:
            self._wait_for_location(deadline)
            for name in self.stopped_schedules:
                self.graphql.stop_schedule(name)
        self._start_daemon()
        self._wait_for_location(deadline)
        self._wait_for_daemons(deadline)

    def kill_daemon(self, with_its_group: bool = False) -> list[int]:
        """SIGKILL to the daemon process alone, as a crash: the code servers it started and
        the runs they launched go on until they notice. ``with_its_group``: to the daemon, its
        code servers and the run workers they started, as a lost host or systemd's stop of the
        unit (its whole control group) ends them. Returns the ids of the processes killed."""
        process = self._processes.pop("daemon")
        killed = processes_in_group(process.pid) if with_its_group else [process.pid]
        if with_its_group:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
        else:
            process.kill()
        process.wait(timeout=10)
        self._left_behind.append(process.pid)
        return killed

    def start_daemon(self, timeout: float = 180) -> None:
        """A new daemon, as systemd restarts one; returns once every daemon is healthy."""
        self._start_daemon()
        self.wait_healthy(timeout)

    def wait_healthy(self, timeout: float = 180) -> None:
        """Returns once every daemon the instance requires reports healthy to the webserver,
        with a heartbeat of the daemon running now."""
        self._wait_for_daemons(time.monotonic() + timeout)

    def revive(self, restart_seconds: float = SUPERVISOR_RESTART_SECONDS) -> list[str]:
        """What the deployment's supervisor does (``Restart=on-failure``, ``RestartSec=5`` in
        deploy/systemd): the webserver or daemon found exited is started again after
        ``restart_seconds``. Returns the names of those started again."""
        revived = []
        for name, process in list(self._processes.items()):
            if process.poll() is None:
                continue
            time.sleep(restart_seconds)
            self._left_behind.append(process.pid)
            if name == "daemon":
                self._start_daemon()
            else:
                self._start_webserver()
            revived.append(name)
        return revived

    def _start_daemon(self) -> None:
        self._daemon_started_at = time.time()
        self._start("daemon", [
            sys.executable, dagster_daemon.__file__, "run", "--workspace", str(self.workspace_file),
        ], self.daemon_log, daemon_unit_environment())

    def _start_webserver(self) -> None:
        self._start("webserver", [
            str(BIN / "dagster-webserver"), "--host", "127.0.0.1", "--port", str(self.port),
            "--workspace", str(self.workspace_file),
        ], self.webserver_log)

    def stop(self, grace: float = 10) -> None:
        """SIGTERM to both process groups, SIGKILL to whatever is left after ``grace`` seconds:
        the webserver, the daemon, their code servers and any run worker still going."""
        # An open keep-alive connection would hold up the webserver's graceful shutdown.
        self.graphql.close()
        for process in self._processes.values():
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        for process in self._processes.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
        for process in self._processes.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            if process.poll() is None:
                process.wait(timeout=10)
        for group in self._left_behind:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)
        self._processes.clear()
        self._left_behind.clear()

    def log_tails(self, chars: int = LOG_TAIL_CHARS) -> str:
        """The end of both logs, for failure messages."""
        return "\n".join(
            f"--- {path.name} (last {chars} chars) ---\n"
            + (ANSI_COLOUR.sub("", path.read_text(errors="replace"))[-chars:]
               if path.exists() else "(no log)")
            for path in (self.webserver_log, self.daemon_log)
        )

    def _write_workspace(self) -> None:
        if self.given_workspace is not None:
            self.workspace_file.write_text(self.given_workspace.read_text())
            return
        self.workspace_file.write_text(yaml.safe_dump({"load_from": [{"python_module": {
            "module_name": self.code_location_module,
            "attribute": "defs",
            "location_name": self.location_name,
            "working_directory": str(REPO),
        }}]}))

    def _start(self, name: str, command: list[str], log_path: Path,
               unit_environment: Mapping[str, str] | None = None) -> None:
        with log_path.open("ab") as log:
            self._processes[name] = subprocess.Popen(
                command, env={**self.environment, **(unit_environment or {})},
                cwd=self.work_dir, stdout=log,
                stderr=subprocess.STDOUT, start_new_session=True,
            )

    def _check_alive(self, waiting_for: str) -> None:
        for name, process in self._processes.items():
            if process.poll() is not None:
                raise AssertionError(f"dagster {name} exited with {process.returncode} while "
                                     f"waiting for {waiting_for}\n{self.log_tails()}")

    def _wait_for_location(self, deadline: float) -> None:
        status = "not answering"
        while True:
            self._check_alive(f"code location {self.location_name}")
            with contextlib.suppress(httpx.TransportError):
                status = self.graphql.location_statuses().get(self.location_name, "missing")
                if status == "LOADED":
                    error = self.graphql.location_load_error()
                    if error is not None:
                        raise AssertionError(
                            f"code location {self.location_name} failed to load:\n{error}\n"
                            f"{self.log_tails()}")
                    return
            if time.monotonic() > deadline:
                raise AssertionError(f"code location {self.location_name} not loaded in time "
                                     f"(webserver: {status})\n{self.log_tails()}")
            time.sleep(0.5)

    def _wait_for_daemons(self, deadline: float) -> None:
        unhealthy: dict[str, Any] = {}
        while True:
            self._check_alive("healthy daemons")
            statuses = self.graphql.daemon_statuses()
            unhealthy = {kind: status for kind, status in statuses.items()
                         if status["required"] and not (
                             status["healthy"]
                             and (status["lastHeartbeatTime"] or 0.0) >= self._daemon_started_at)}
            if statuses and not unhealthy:
                return
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"daemons not healthy in time: {json.dumps(unhealthy, indent=1)[:3000]}\n"
                    f"{self.log_tails()}")
            time.sleep(1)


def processes_in_group(group: int) -> list[int]:
    """The ids of the live processes of process group ``group``."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError):
            # pid (comm) state ppid pgrp ...: comm may hold spaces, so split after its ")".
            fields = stat.read_text().rpartition(")")[2].split()
            if int(fields[2]) == group:
                members.append(int(stat.parent.name))
    return sorted(members)


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
