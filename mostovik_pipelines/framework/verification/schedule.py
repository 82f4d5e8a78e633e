"""The scheduled verification of a source: a job over its lookback, off by default.

Every source gets ``<source>_verification_job`` and its schedule ``<source>_verification``
(daily at ``MOSTOVIK_VERIFY_CRON``, 05:30 by default, in the source's time zone), stopped
unless ``MOSTOVIK_VERIFY_SOURCES`` names the source (or says ``all``): it asks the source again
for every loaded partition of the lookback whose period has closed (a sync's window past its
settle time; a file version loaded within it) and compares (:mod:`.verify`). It is a run like
any other (the UI's run list, ``mostovik jobs list``), and per partition:

* the asset check ``matches_source`` records the verdict on the partition: failed, with the
  differences as metadata, where the table differs from the source (or the partition could not
  be verified). Every load of a partition plans the check without evaluating it, so a re-load
  leaves no stale verdict standing; ``mostovik jobs rerun --only differing`` re-runs the
  partitions whose latest verdict is failed and current;
* a partition that differs raises one alert through the alert notifier, said once: not again
  while the next verification finds the same differences on the same load.

Its op imports what it runs when it runs, so loading the code location imports no pandas.
"""

from dagster import (
    Config,
    DefaultScheduleStatus,
    Definitions,
    OpExecutionContext,
    ScheduleDefinition,
    job,
    op,
)

from mostovik_pipelines.core.settings import setting
from mostovik_pipelines.core.tags import JOB_TYPE_TAG, SOURCE_TAG
from mostovik_pipelines.framework.assets.resource_keys import (
    LANDING_KEY,
    WAREHOUSE_KEY,
    source_resource_key,
)
from mostovik_pipelines.framework.runs.alerts import ALERT_NOTIFIER_KEY
from mostovik_pipelines.framework.spec import SourceSpec

VERIFY_SOURCES_SETTING = "MOSTOVIK_VERIFY_SOURCES"
VERIFY_CRON_SETTING = "MOSTOVIK_VERIFY_CRON"
VERIFICATION_TAG = "mostovik/verification"
"""On a verification run: what it compared with (``source``)."""
VERIFICATION = "verification"
"""A verification run's job type: the run list and ``mostovik jobs list`` show it under its
source, never as a load of the source's kind."""
DEFAULT_TIMEZONE = "Europe/Moscow"


def verified_sources() -> set[str]:
    """The sources whose scheduled verification runs (``MOSTOVIK_VERIFY_SOURCES``)."""
    return {name.strip() for name in setting(VERIFY_SOURCES_SETTING, "").split(",")
            if name.strip()}


class VerificationConfig(Config):
    """Run config of a verification job."""

    against: str = "source"
    """``source`` (ask it again) or ``landed`` (the payload the stored rows came from)."""
    partitions: list[str] | None = None
    """The partitions to verify; default: the loaded, closed partitions of the lookback."""


def verification_definitions(spec: SourceSpec) -> Definitions:
    """The source's verification job and its schedule."""
    resources = {WAREHOUSE_KEY, LANDING_KEY, source_resource_key(spec), ALERT_NOTIFIER_KEY}

    @op(name=f"verify_{spec.name}", required_resource_keys=resources,
        description=f"Compare the loaded partitions of {spec.name}'s lookback with the source; "
                    "record the check matches_source per partition, alert once per partition "
                    "that differs.")
    def verify_lookback(context: OpExecutionContext, config: VerificationConfig) -> None:
        from mostovik_pipelines.framework.verification.scheduled import run_verification

        run_verification(context, spec, config.against, config.partitions)

    @job(name=f"{spec.name}_verification_job",
         description=f"Verify {spec.name}'s loaded partitions of the lookback against the "
                     "source (read-only).",
         tags={SOURCE_TAG: spec.name, JOB_TYPE_TAG: VERIFICATION, VERIFICATION_TAG: "source"})
    def verification_job():
        verify_lookback()

    timezone = spec.schedule.timezone if spec.schedule else DEFAULT_TIMEZONE
    on = spec.name in verified_sources() or "all" in verified_sources()
    schedule = ScheduleDefinition(
        name=f"{spec.name}_verification", job=verification_job,
        cron_schedule=setting(VERIFY_CRON_SETTING, "30 5 * * *"), execution_timezone=timezone,
        default_status=DefaultScheduleStatus.RUNNING if on else DefaultScheduleStatus.STOPPED,
        description=f"Verify {spec.name}'s last {spec.catch_up.lookback.days} days against the "
                    f"source (on when {VERIFY_SOURCES_SETTING} names it).")
    return Definitions(jobs=[verification_job], schedules=[schedule])
