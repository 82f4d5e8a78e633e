"""Dagster runs in processes of their own, as `dagster job execute` starts them in CI."""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import signal
import subprocess
import sys
from pathlib import Path

from dagster import DagsterInstance

from mostovik_pipelines.platform.claims import hold_driver_claim, hold_run_claim

REPO = Path(__file__).resolve().parents[2]
DAGSTER = str(Path(sys.executable).parent / "dagster")
RERUN_IN_PROCESS = (
    "import sys; from dagster import DagsterInstance; "
    "from mostovik_pipelines.platform.recovery import rerun_from_failure; "
    "rerun_from_failure(DagsterInstance.get(), sys.argv[1])")
"""``python -c`` code of a re-execution from failure of run ``argv[1]`` executed in its process
(``mostovik jobs rerun`` queues one for the daemon instead)."""


def local_dagster_home(work_dir: Path) -> Path:
    """A DAGSTER_HOME with the repository's local dagster.yaml, its storage under ``work_dir``,
    initialised once here so that processes started together do not race to create it."""
    home = work_dir / "dagster_home"
    if not (home / "dagster.yaml").exists():
        home.mkdir(exist_ok=True)
        config = (REPO / "dagster.yaml").read_text()
        (home / "dagster.yaml").write_text(
            config.replace(".mostovik/dagster", str(work_dir / "dagster"))
        )
        DagsterInstance.from_config(str(home)).dispose()
    return home


def run_environment(work_dir: Path, warehouse_url: str, cbr_url: str) -> dict[str, str]:
    return {
        **os.environ,
        "DAGSTER_HOME": str(local_dagster_home(work_dir)),
        "MOSTOVIK_DATABASE_URL": warehouse_url,
        "MOSTOVIK_CBR_URL": cbr_url,
        "MOSTOVIK_DATA_DIR": str(work_dir / "data"),
    }


def start_job_execute(partition: str, env: dict[str, str], cwd: Path) -> subprocess.Popen:
    """`dagster job execute` of the CBR job for one partition, started, not waited for."""
    return subprocess.Popen(
        [DAGSTER, "job", "execute", "-m", "mostovik_pipelines", "-j", "cbr_daily_rates_job",
         "--tags", json.dumps({"dagster/partition": partition})],
        env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )


def start_range_materialize(start: str, end: str, env: dict[str, str],
                            cwd: Path) -> subprocess.Popen:
    """A single-run backfill of a partition range, as `dagster asset materialize` runs it."""
    return subprocess.Popen(
        [DAGSTER, "asset", "materialize", "-m", "mostovik_pipelines", "--select",
         "cbr_daily_rates", "--partition-range", f"{start}...{end}"],
        env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )


def stop_session(process: subprocess.Popen | None, grace: float) -> None:
    """SIGTERM to the session ``process`` leads (started with ``start_new_session``), SIGKILL to
    whatever is left of it after ``grace`` seconds."""
    if process is None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=grace)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    if process.poll() is None:
        process.wait(timeout=10)


def stop_process(process: subprocess.Popen | None, grace: float) -> None:
    """SIGTERM to ``process`` if it still runs, SIGKILL if it has not ended after ``grace``
    seconds."""
    if process is None or process.poll() is not None:
        return
    process.terminate()
    try:
        process.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=10)


def _hold_claim_until_killed(home: str, run_id: str, driver: bool, ready) -> None:
    hold = hold_driver_claim if driver else hold_run_claim
    with DagsterInstance.from_config(home) as instance, hold(instance, run_id):
        ready.set()
        signal.pause()


def claim_holder(home: str, run_id: str, *, driver: bool = False) -> multiprocessing.Process:
    """A process of its own holding ``run_id``'s claim (with ``driver``, as the process driving
    a run does: its driver claim too) until it is killed; returned once it holds it."""
    context = multiprocessing.get_context("spawn")
    ready = context.Event()
    process = context.Process(target=_hold_claim_until_killed, args=(home, run_id, driver, ready),
                              daemon=True)
    process.start()
    assert ready.wait(120), f"the holder of {run_id} never took its claim"
    return process
