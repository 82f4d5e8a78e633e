"""The GraphQL documents the tests send to the webserver: the queries and mutations the Dagster UI
sends, for the fields the tests read, each selection with ``__typename`` where the UI's Apollo
client adds it. Read by :class:`~.graphql.DagsterGraphQL`.

Each selection is written once: what every error shows (:data:`ERROR_FRAGMENT`), a run, a
schedule's or sensor's state, a metadata entry are fragments; :func:`document` appends to a
query the fragments it spreads; :func:`operation` writes the ``...OrError`` shape nearly every
query answers with (the member asked for, or an error). Short selections stand on one line."""

ERROR_FRAGMENT = """
  fragment ErrorFragment on Error {
    __typename
    message
    ... on PythonError {
      stack
      errorChain {
        isExplicitLink
        error {
          message
          stack
        }
      }
    }
  }
"""
"""What any error member of a result union shows: its message, and a Python error's stack and
the errors it was raised from."""

RUN_FRAGMENT = """
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

INSTIGATION_STATE_FRAGMENT = """
  fragment InstigationStateFragment on InstigationState {
    id
    status
  }
"""
"""A schedule's or a sensor's state: ``RUNNING`` or ``STOPPED``."""

METADATA_ENTRY_FRAGMENT = """
  fragment MetadataEntryFragment on MetadataEntry {
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
"""

FRAGMENTS = {
    "ErrorFragment": ERROR_FRAGMENT,
    "RunInfoFragment": RUN_FRAGMENT,
    "InstigationStateFragment": INSTIGATION_STATE_FRAGMENT,
    "MetadataEntryFragment": METADATA_ENTRY_FRAGMENT,
}


def document(operation: str) -> str:
    """``operation`` with the definitions of the fragments it spreads (GraphQL refuses a
    document that defines a fragment it does not use)."""
    return operation + "".join(definition for name, definition in FRAGMENTS.items()
                               if f"...{name}" in operation)


def result_union(field: str, member: str, selection: str, other_members: str = "") -> str:
    """``field`` (with its arguments), a union answering ``member`` with ``selection``, or an
    error: any error type of Dagster's schema, and ``other_members`` (the three that are not,
    :data:`LAUNCH_ERRORS`)."""
    return f"""
    {field} {{
      __typename
      ... on {member} {{
        {selection}
      }}{other_members}
      ...ErrorFragment
    }}"""


def operation(signature: str, field: str, member: str, selection: str,
              other_members: str = "") -> str:
    """The document of operation ``signature`` (``query Name($variable: Type)`` or
    ``mutation ...``) asking for :func:`result_union` ``field``."""
    return document(f"""
  {signature} {{{result_union(field, member, selection, other_members)}
  }}
""")


LAUNCH_ERRORS = """
      ... on InvalidStepError {
        invalidStepKey
      }
      ... on InvalidOutputError {
        stepKey
        invalidOutputName
      }
      ... on RunConfigValidationInvalid {
        pipelineName
        errors {
          message
          path
          reason
        }
      }"""
"""The members of a launch's result union that are errors without a message of their own."""

LAUNCHED_RUN = "run { ...RunInfoFragment }"

LOCATION_STATUSES_QUERY = operation(
    "query CodeLocationStatusQuery", "locationStatusesOrError", "WorkspaceLocationStatusEntries",
    "entries { id name loadStatus updateTimestamp }")

LOCATION_OR_LOAD_ERROR = result_union("locationOrLoadError", "RepositoryLocation",
                                      "id name repositories { id name }")

WORKSPACE_QUERY = operation(
    "query WorkspaceLocationsQuery", "workspaceOrError", "Workspace",
    "id locationEntries { id name loadStatus " + LOCATION_OR_LOAD_ERROR + " }")

DAEMON_HEALTH_QUERY = document("""
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
            ...ErrorFragment
          }
        }
      }
    }
  }
""")

REPOSITORY_QUERY = operation(
    "query RepositoryContentsQuery($repositorySelector: RepositorySelector!)",
    "repositoryOrError(repositorySelector: $repositorySelector)", "Repository", """
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
            ...InstigationStateFragment
          }
        }
        sensors {
          id
          name
          sensorState {
            ...InstigationStateFragment
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
        }""")

STOP_SCHEDULE_MUTATION = operation(
    "mutation StopRunningSchedule($id: String!)", "stopRunningSchedule(id: $id)",
    "ScheduleStateResult", "scheduleState { ...InstigationStateFragment }")

RELOAD_LOCATION_MUTATION = operation(
    "mutation ReloadRepositoryLocationMutation($location: String!)",
    "reloadRepositoryLocation(repositoryLocationName: $location)", "WorkspaceLocationEntry",
    "id loadStatus " + LOCATION_OR_LOAD_ERROR)

LAUNCH_PARTITION_BACKFILL_MUTATION = operation(
    "mutation LaunchPartitionBackfill($backfillParams: LaunchBackfillParams!)",
    "launchPartitionBackfill(backfillParams: $backfillParams)", "LaunchBackfillSuccess",
    "backfillId", LAUNCH_ERRORS)

BACKFILL_QUERY = operation(
    "query BackfillStatusQuery($backfillId: String!)",
    "partitionBackfillOrError(backfillId: $backfillId)", "PartitionBackfill",
    "id status partitionNames error { ...ErrorFragment }")

RUNS_QUERY = operation(
    "query RunsByTagQuery($filter: RunsFilter, $limit: Int)",
    "runsOrError(filter: $filter, limit: $limit)", "Runs", "results { ...RunInfoFragment }")

RUN_QUERY = operation("query RunRootQuery($runId: ID!)", "runOrError(runId: $runId)", "Run",
                      "...RunInfoFragment")

RUN_ERRORS_QUERY = operation(
    "query RunErrorsQuery($runId: ID!)", "runOrError(runId: $runId)", "Run", """
        id
        eventConnection {
          events {
            __typename
            ... on ExecutionStepFailureEvent {
              stepKey
              message
              error {
                ...ErrorFragment
              }
              failureMetadata {
                description
              }
            }
            ... on RunFailureEvent {
              message
              error {
                ...ErrorFragment
              }
            }
          }
        }""")

LAUNCH_PIPELINE_EXECUTION_MUTATION = operation(
    "mutation LaunchPipelineExecution($executionParams: ExecutionParams!)",
    "launchPipelineExecution(executionParams: $executionParams)", "LaunchRunSuccess",
    LAUNCHED_RUN, LAUNCH_ERRORS)

LAUNCH_PIPELINE_REEXECUTION_MUTATION = operation(
    "mutation LaunchPipelineReexecution($executionParams: ExecutionParams, "
    "$reexecutionParams: ReexecutionParams)",
    "launchPipelineReexecution(executionParams: $executionParams, "
    "reexecutionParams: $reexecutionParams)", "LaunchRunSuccess", LAUNCHED_RUN, LAUNCH_ERRORS)


def asset_node_query(name: str, variables: str, selection: str) -> str:
    """Query ``name`` of ``selection`` on the asset node of ``$assetKey`` (and ``variables``)."""
    return operation(f"query {name}($assetKey: AssetKeyInput!{variables})",
                     "assetNodeOrError(assetKey: $assetKey)", "AssetNode", "id " + selection)


ASSET_NODE_QUERY = asset_node_query("AssetNodeQuery", "", """
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
          ...MetadataEntryFragment
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
        }""")

ASSET_MATERIALIZATIONS_QUERY = asset_node_query(
    "AssetPartitionEventsQuery", ", $partitions: [String!]",
    "assetMaterializations(partitions: $partitions) "
    "{ partition runId metadataEntries { ...MetadataEntryFragment } }")

ASSET_PARTITION_STATUS_QUERY = asset_node_query("AssetPartitionStatusQuery", "", """
        assetPartitionStatuses {
          __typename
          ... on TimePartitionStatuses {
            ranges {
              status
              startKey
              endKey
            }
          }
          ... on DefaultPartitionStatuses {
            materializedPartitions
            failedPartitions
          }
        }""")

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

SENSOR_TICKS_QUERY = operation(
    "query SensorTicksQuery($sensorSelector: SensorSelector!, $limit: Int)",
    "sensorOrError(sensorSelector: $sensorSelector)", "Sensor", """
        id
        sensorState {
          id
          status
          ticks(limit: $limit) {
            id
            status
            timestamp
            endTimestamp
            runIds
            runKeys
            skipReason
            error {
              ...ErrorFragment
            }
          }
        }""")
