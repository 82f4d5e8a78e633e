"""A local instance's claim files: the one a killed run's process left behind is removed by the
prune once it is older than the grace, a live run's never, however old its file looks."""

from __future__ import annotations

import os
import signal
import uuid
from datetime import UTC, datetime, timedelta

from dagster import DagsterInstance, DagsterRun, DagsterRunStatus

from mostovik_pipelines.maintenance.policy import CLAIM_FILES, RetentionPolicy
from mostovik_pipelines.maintenance.prune import prune
from mostovik_pipelines.platform.claims import (
    claim_files_dir,
    run_claim_held,
)
from mostovik_pipelines_tests.support.processes import claim_holder, local_dagster_home

A_YEAR = timedelta(days=365)


def _prune(instance: DagsterInstance, tmp_path, now: datetime):
    return prune(instance, landing_dir=tmp_path / "landing", op_output_dir=tmp_path / "storage",
                 check_keys=[], policy=RetentionPolicy(), now=now)


def test_a_killed_runs_claim_file_is_pruned_after_the_grace_and_a_live_ones_never(tmp_path):
    home = str(local_dagster_home(tmp_path))
    killed_run, live_run = str(uuid.uuid4()), str(uuid.uuid4())
    killed, live = claim_holder(home, killed_run), claim_holder(home, live_run)
    try:
        with DagsterInstance.from_config(home) as instance:
            # Run storage says "started" for both: a killed `dagster job execute` never ends.
            for run_id in (killed_run, live_run):
                instance.add_run(DagsterRun(job_name="cbr_daily_rates_job", run_id=run_id,
                                            status=DagsterRunStatus.STARTED))
            os.kill(killed.pid, signal.SIGKILL)
            killed.join(60)
            folder = claim_files_dir(instance)
            killed_file, live_file = folder / f"{killed_run}.lock", folder / f"{live_run}.lock"
            assert killed_file.exists() and live_file.exists()
            assert not run_claim_held(instance, killed_run)
            assert run_claim_held(instance, live_run)

            # Within the grace both stay: a run that is just taking its claim looks the same.
            now = datetime.now(UTC)
            report = _prune(instance, tmp_path, now)
            assert report.counts[CLAIM_FILES] == 0
            assert killed_file.exists() and live_file.exists()

            # Both files a year old: the killed run's goes, the live run's stays, still held.
            a_year_ago = (now - A_YEAR).timestamp()
            for path in (killed_file, live_file):
                os.utime(path, (a_year_ago, a_year_ago))
            later = now + timedelta(days=2)
            dry = prune(instance, landing_dir=tmp_path / "landing",
                        op_output_dir=tmp_path / "storage", check_keys=[],
                        policy=RetentionPolicy(), now=later, dry_run=True)
            assert dry.counts[CLAIM_FILES] == 1 and killed_file.exists()
            report = _prune(instance, tmp_path, later)
            assert report.counts[CLAIM_FILES] == 1 and report.size_bytes[CLAIM_FILES] == 0
            assert not killed_file.exists()
            assert live_file.exists() and run_claim_held(instance, live_run)
            assert not _prune(instance, tmp_path, later).removed_anything
            assert run_claim_held(instance, live_run)
    finally:
        for process in (killed, live):
            if process.is_alive():
                os.kill(process.pid, signal.SIGKILL)
            process.join(60)
