"""The GraphQL documents the tests send to the webserver: the queries and mutations of the Dagster
UI's own bundle, each selection with ``__typename`` as the UI's Apollo client adds it, so the
payloads match what a browser sends. Read by :class:`~.graphql.DagsterGraphQL`."""

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
