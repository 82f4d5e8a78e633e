"""The real ``dagster-daemon`` on a fake clock, so that schedules are tested as they run, at the
instant they are due, without waiting hours for it.

libfaketime (the Debian package ``faketime``) is preloaded into the daemon with a relative offset
(``FAKETIME=+Ns``): its clock reads the instant a test asks for when it starts and then runs at
the real pace, and every process it starts (the code server, the run workers) inherits the
environment and so the same clock. The monotonic clock is left alone (waits measure real time)
and ``fake_clock_site/sitecustomize.py`` makes ``time.sleep`` work under the library.

A running daemon's clock is never moved: the daemon's controller takes heartbeats older than its
tolerance for dead daemons and exits. A test that needs another instant stops the daemon and
starts it again (:meth:`FakeClockDaemon.restart`); instants should only move forward (a sensor or
schedule whose last tick lies in the daemon's future waits for it).

The instance (:func:`fake_clock_instance`) is local SQLite, so every timestamp the daemon, the
code server and the runs write to it is on the fake clock. The test process reads it on the real
clock: compare what it reads with fake instants, never with the real now, and create no run from
the test process (its timestamps would be real). A PostgreSQL warehouse stamps rows with its own
``now()``, on the real clock.

Which private Dagster names this uses, and why: schedule states are written before the daemon
starts (:func:`hold_schedules_from`) with ``InstigatorState`` / ``ScheduleInstigatorData`` and
the code location's origin as Dagster reads it from the workspace file, so that ticks are
counted from the fake start whatever time the daemon takes to load the code location.
"""

from __future__ import annotations

import contextlib
import glob
import importlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Collection, Mapping, Sequence
from datetime import UTC, datetime
from pathlib import Path
from zoneinfo import ZoneInfo

import yaml
from dagster import DagsterInstance, DagsterRunStatus
from dagster._core.remote_origin import RemoteInstigatorOrigin, RemoteRepositoryOrigin
from dagster._core.scheduler.instigation import (
    InstigatorState,
    InstigatorStatus,
    InstigatorTick,
    InstigatorType,
    ScheduleInstigatorData,
    TickStatus,
)
from dagster._core.storage.dagster_run import DagsterRun, RunsFilter
from dagster._core.workspace.load import location_origins_from_yaml_paths

from mostovik_pipelines.operator.local_runs import standin_environment
from mostovik_pipelines.standin import StandinServer
from mostovik_pipelines_tests.support import dagster_daemon
from mostovik_pipelines_tests.support.graphql import LOCATION_NAME, REPOSITORY_NAME
from mostovik_pipelines_tests.support.instances import RUN_QUEUE_INTERVAL_SECONDS
from mostovik_pipelines_tests.support.machine import MachineNotReady
from mostovik_pipelines_tests.support.processes import REPO
from mostovik_pipelines_tests.support.waiting import (
    PROCESS_START_MARGIN_SECONDS,
    limit_for,
    wait_until,
)
from mostovik_pipelines_tests.support.webserver import ANSI_COLOUR, daemon_unit_environment

MOSCOW = ZoneInfo("Europe/Moscow")
"""Every schedule of the code location runs on Moscow time (UTC+3, no DST)."""
LIBFAKETIME_GLOB = "/usr/lib/*/faketime/libfaketime.so.1"
SITE_DIR = Path(__file__).resolve().parent / "fake_clock_site"
"""Holds the ``sitecustomize`` that makes ``time.sleep`` work under libfaketime."""
MARKER_ENV = "MOSTOVIK_FAKE_CLOCK_DAEMON"
"""Set to a daemon's own id in its environment: every process it started carries it, so that
:meth:`FakeClockDaemon.stop` finds one that left the daemon's process group."""
SCHEDULER_INTERVAL_SECONDS = 60
"""Dagster's scheduler evaluates at the start of every minute (of the daemon's clock)."""
TICK_LIMIT_SECONDS = limit_for(SCHEDULER_INTERVAL_SECONDS)
"""A tick due within a minute of the daemon's clock: recorded and its runs requested."""
RUN_LIMIT_SECONDS = limit_for(RUN_QUEUE_INTERVAL_SECONDS) + PROCESS_START_MARGIN_SECONDS
"""Queued runs: launched by the queue, their worker processes started, their steps run."""
IN_PROGRESS = frozenset({DagsterRunStatus.QUEUED, DagsterRunStatus.NOT_STARTED,
                         DagsterRunStatus.STARTING, DagsterRunStatus.STARTED,
                         DagsterRunStatus.CANCELING})
LOG_TAIL_CHARS = 4000


def libfaketime_path() -> str:
    """The preloadable libfaketime of this machine, or an error naming how to install it."""
    found = sorted(glob.glob(LIBFAKETIME_GLOB))
    if not found:
        with contextlib.suppress(OSError, subprocess.CalledProcessError):
            listed = subprocess.run(["dpkg", "-L", "libfaketime"], check=True,
                                    capture_output=True, text=True).stdout.splitlines()
            found = [line for line in listed if line.endswith("/libfaketime.so.1")]
    if not found:
        raise MachineNotReady("libfaketime not found: install the Debian package faketime "
                              "(`make system-deps` as root does it with apt-get)")
    return found[0]


def fake_clock_environment(at: datetime, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """What makes a process started now read ``at`` (timezone-aware) on its clock, then run on
    at the real pace: libfaketime preloaded with the offset from the real now, the monotonic
    clock left alone, and the ``sitecustomize`` that mends ``time.sleep`` first on the
    ``PYTHONPATH`` (``base``'s, by default this process's)."""
    return _environment_for_offset(_offset_to(at), base)


def _offset_to(at: datetime) -> float:
    if at.tzinfo is None:
        raise ValueError(f"a fake instant needs a timezone: {at!r}")
    return at.timestamp() - time.time()


def _environment_for_offset(offset: float, base: Mapping[str, str] | None = None) -> dict[str, str]:
    python_path = (os.environ if base is None else base).get("PYTHONPATH", "")
    return {
        "LD_PRELOAD": libfaketime_path(),
        "FAKETIME": f"{offset:+.3f}s",
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
        "PYTHONPATH": os.pathsep.join(part for part in (str(SITE_DIR), python_path) if part),
    }


def fake_clock_instance(work_dir: Path) -> Path:
    """A DAGSTER_HOME under ``work_dir`` with the repository's local dagster.yaml (SQLite storage,
    the run queue and its tag limits, run monitoring), its storage under ``work_dir``, the queue
    read every :data:`RUN_QUEUE_INTERVAL_SECONDS`, and freshness evaluation off (it would record
    states for the whole code location that no schedule test looks at). The storage is created
    here, once, so that the daemon and its code server do not race to create it."""
    home = work_dir / "dagster_home"
    home.mkdir(parents=True, exist_ok=True)
    settings = yaml.safe_load((REPO / "dagster.yaml").read_text())
    storage = work_dir / "dagster"
    settings["storage"]["sqlite"]["base_dir"] = str(storage / "storage")
    settings["local_artifact_storage"]["config"]["base_dir"] = str(storage)
    settings["compute_logs"]["config"]["base_dir"] = str(storage / "logs")
    settings["run_coordinator"].setdefault("config", {})[
        "dequeue_interval_seconds"] = RUN_QUEUE_INTERVAL_SECONDS
    settings["freshness"] = {"enabled": False}
    (home / "dagster.yaml").write_text(yaml.safe_dump(settings, sort_keys=False))
    DagsterInstance.from_config(str(home)).dispose()
    return home


def write_workspace(work_dir: Path, location_name: str = LOCATION_NAME) -> Path:
    """A workspace file that serves this project's code location, as the deployment's does."""
    workspace = work_dir / "workspace.yaml"
    workspace.write_text(yaml.safe_dump({"load_from": [{"python_module": {
        "module_name": "mostovik_pipelines",
        "attribute": "defs",
        "location_name": location_name,
        "working_directory": str(REPO),
    }}]}))
    return workspace


def code_location_environment(work_dir: Path, warehouse_url: str,
                              standin_server: StandinServer) -> dict[str, str]:
    """The ``MOSTOVIK_*`` settings of a code location run by the daemon in a test: the
    warehouse, every source with a stand-in endpoint pointed at it (by its declaration's
    ``url_setting``), local state, inbox and archive under ``work_dir``, and runs in one
    process (no Celery)."""
    return {
        "MOSTOVIK_DATABASE_URL": warehouse_url,
        **standin_environment(standin_server.url),
        "MOSTOVIK_DATA_DIR": str(work_dir / "data"),
        "MOSTOVIK_INBOX_DIR": str(work_dir / "inbox"),
        "MOSTOVIK_ARCHIVE_DIR": str(work_dir / "archive"),
        "MOSTOVIK_EXECUTOR": "in_process",
    }


def hold_schedules_from(instance: DagsterInstance, workspace_file: Path, at: datetime,
                        stopped: Collection[str] = ()) -> None:
    """Every schedule of the workspace's code location counts its ticks from ``at``: one due at
    or after it is evaluated, even when the daemon's first pass comes later (a slow start); none
    before it is caught up. This is a daemon that was running at ``at``. Without it, Dagster
    starts a schedule that is on in code from the daemon's first pass (a tick due while the code
    location loads is missed), and a restarted daemon evaluates, at once, the newest tick it
    missed while it was down (only the newest: the schedules' jobs have no partition set).

    The ``stopped`` schedules are stopped, as from the UI: they never tick; the others keep the
    status they had (on in code, unless a test stopped one)."""
    [origin] = location_origins_from_yaml_paths([str(workspace_file)])
    repository = RemoteRepositoryOrigin(origin, REPOSITORY_NAME)
    target = origin.loadable_target_origin
    definitions = getattr(importlib.import_module(target.module_name), target.attribute or "defs")
    crons = {schedule.name: schedule.cron_schedule
             for schedule in definitions.get_repository_def().schedule_defs}
    unknown = set(stopped) - set(crons)
    if unknown:
        raise ValueError(f"no such schedules in {origin.location_name}: {sorted(unknown)}")
    stored = {state.selector_id: state for state in instance.all_instigator_state(
        repository_selector_id=repository.get_selector_id(),
        instigator_type=InstigatorType.SCHEDULE)}
    for name, cron in crons.items():
        origin_of = RemoteInstigatorOrigin(repository, name)
        earlier = stored.get(origin_of.get_selector().get_id())
        status = (InstigatorStatus.STOPPED if name in stopped
                  else earlier.status if earlier is not None
                  else InstigatorStatus.DECLARED_IN_CODE)
        state = InstigatorState(origin_of, InstigatorType.SCHEDULE, status,
                                ScheduleInstigatorData(cron, at.timestamp(), at.timestamp()))
        if earlier is not None:
            instance.update_instigator_state(state)
        else:
            instance.add_instigator_state(state)


def schedule_ticks(instance: DagsterInstance, schedule_name: str) -> list[InstigatorTick]:
    """The ticks recorded for ``schedule_name``, newest first (none before its first pass)."""
    for state in instance.all_instigator_state(instigator_type=InstigatorType.SCHEDULE):
        if state.instigator_name == schedule_name:
            return list(instance.get_ticks(state.instigator_origin_id, state.selector_id))
    return []


def wait_for_tick(instance: DagsterInstance, schedule_name: str, scheduled_at: datetime,
                  limit: float = TICK_LIMIT_SECONDS,
                  diagnostics: Callable[[], str] = lambda: "") -> InstigatorTick:
    """The first tick of ``schedule_name`` due at or after ``scheduled_at`` (a fake instant; a
    schedule tick's timestamp is the instant it was due), once it has finished: its runs
    requested, or it skipped or failed."""
    due = scheduled_at.timestamp()

    def finished() -> InstigatorTick | None:
        ticks = [tick for tick in schedule_ticks(instance, schedule_name)
                 if tick.timestamp >= due]
        first = min(ticks, key=lambda tick: tick.timestamp, default=None)
        return first if first is not None and first.status != TickStatus.STARTED else None

    return wait_until(
        finished, limit, f"a finished tick of {schedule_name} due at or after {scheduled_at}",
        lambda: (f"ticks: {[_describe_tick(t) for t in schedule_ticks(instance, schedule_name)]}"
                 f"\n{diagnostics()}"))


def wait_for_runs_done(instance: DagsterInstance, limit: float = RUN_LIMIT_SECONDS,
                       diagnostics: Callable[[], str] = lambda: "") -> list[DagsterRun]:
    """Every run of the instance, once none is queued, starting, running or canceling."""
    def settled() -> tuple[list[DagsterRun]] | None:
        runs = list(instance.get_runs())
        return None if any(run.status in IN_PROGRESS for run in runs) else (runs,)

    def in_progress() -> str:
        runs = instance.get_runs(RunsFilter(statuses=list(IN_PROGRESS)))
        return (f"in progress: {[(r.run_id, r.job_name, r.status.value) for r in runs]}"
                f"\n{diagnostics()}")

    [runs] = wait_until(settled, limit, "every run finished", in_progress)
    return runs


def run_times(instance: DagsterInstance, run_id: str) -> tuple[datetime, datetime | None,
                                                               datetime | None]:
    """When run storage says a run was created, started and ended (UTC; on the clock of the
    process that wrote each: the daemon creates a scheduled run, its worker starts and ends
    it)."""
    record = instance.get_run_record_by_id(run_id)
    assert record is not None, f"no run {run_id}"

    def at(timestamp: float | None) -> datetime | None:
        return None if timestamp is None else datetime.fromtimestamp(timestamp, UTC)

    return (record.create_timestamp.replace(tzinfo=record.create_timestamp.tzinfo or UTC),
            at(record.start_time), at(record.end_time))


def _describe_tick(tick: InstigatorTick) -> str:
    due = datetime.fromtimestamp(tick.timestamp, MOSCOW).isoformat()
    error = f" {tick.error.message.strip()[:300]}" if tick.error else ""
    return f"{due} {tick.status.value} runs={list(tick.run_ids)}{error}"


class FakeClockDaemon:
    """The real ``dagster-daemon`` (the tests' entry point with the short backfill interval, with
    the deployment unit's environment) on ``dagster_home``, serving ``workspace_file``, on a
    fake clock; a context manager that stops it on exit.

    ``environment`` is added to this process's for the daemon (and so for its code server and run
    workers): the code location's ``MOSTOVIK_*`` settings. Its output goes to ``daemon.log`` in
    ``work_dir``, every start after the last."""

    def __init__(self, work_dir: Path, dagster_home: Path, environment: Mapping[str, str],
                 *, workspace_file: Path | None = None,
                 stopped_schedules: Sequence[str] = ()) -> None:
        self.work_dir = work_dir
        self.dagster_home = dagster_home
        self.environment = {**environment, "DAGSTER_HOME": str(dagster_home)}
        self.workspace_file = workspace_file or write_workspace(work_dir)
        self.stopped_schedules = tuple(stopped_schedules)
        self.log_path = work_dir / "daemon.log"
        self.instance = DagsterInstance.from_config(str(dagster_home))
        """The daemon's instance, read by the test on the real clock."""
        self._process: subprocess.Popen | None = None
        self._marker = ""
        self._offset = 0.0

    def __enter__(self) -> FakeClockDaemon:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()
        self.instance.dispose()

    def now(self) -> datetime:
        """What the running (or last) daemon's clock reads now, in Moscow time."""
        return datetime.fromtimestamp(time.time() + self._offset, MOSCOW)

    def start(self, at: datetime, *, catch_up: bool = False,
              timeout: float = PROCESS_START_MARGIN_SECONDS) -> None:
        """Start the daemon with its clock reading ``at`` (timezone-aware), and return once
        every daemon the instance requires has sent a heartbeat from it.

        Unless ``catch_up``, the schedules count from ``at`` (:func:`hold_schedules_from`): a
        tick due after ``at`` is evaluated however long the daemon takes to start, and the ticks
        between the last daemon's time and ``at`` are not caught up. With ``catch_up`` the
        states are left as the last daemon left them, and Dagster catches up as after an
        outage."""
        if self._process is not None:
            raise RuntimeError("the daemon is running: stop it first, or restart(at)")
        if not catch_up:
            hold_schedules_from(self.instance, self.workspace_file, at, self.stopped_schedules)
        before = {kind: beat.daemon_id
                  for kind, beat in self.instance.get_daemon_heartbeats().items()}
        self._marker = uuid.uuid4().hex
        self._offset = _offset_to(at)
        environment = {**os.environ, **self.environment, **daemon_unit_environment(),
                       MARKER_ENV: self._marker}
        # The entry point runs as a module of the tests' package (importable from the
        # repository), not as a script: a script's folder comes first on sys.path, and a module
        # of support/ named like one of the standard library's would hide it from Dagster.
        environment["PYTHONPATH"] = os.pathsep.join(
            part for part in (str(REPO), environment.get("PYTHONPATH", "")) if part)
        environment.update(_environment_for_offset(self._offset, environment))
        with self.log_path.open("a") as log:
            log.write(f"\n=== daemon started at {at.isoformat()} "
                      f"(FAKETIME={environment['FAKETIME']}) ===\n")
            log.flush()
            self._process = subprocess.Popen(
                [sys.executable, "-m", dagster_daemon.__name__, "run",
                 "--workspace", str(self.workspace_file)],
                env=environment, cwd=self.work_dir, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True)
        required = set(self.instance.get_required_daemon_types())

        def up() -> bool:
            if self._process is not None and self._process.poll() is not None:
                raise AssertionError(f"dagster-daemon exited with {self._process.returncode}"
                                     f"\n{self.log_tail()}")
            beats = self.instance.get_daemon_heartbeats()
            return all(kind in beats and beats[kind].daemon_id != before.get(kind)
                       and beats[kind].timestamp >= at.timestamp() for kind in required)

        try:
            wait_until(up, timeout, f"dagster-daemon's heartbeats since {at.isoformat()}",
                       self.log_tail)
        except BaseException:
            self.stop()
            raise

    def stop(self, grace: float = 10) -> None:
        """SIGTERM to the daemon's process group (its code server and run workers included),
        then SIGKILL to whatever it started that is still there after ``grace`` seconds (in the
        group or not). A run still going is cut off (recorded as failed if its worker ends
        within the grace): wait for the runs first."""
        process, self._process = self._process, None
        if process is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and (
                process.poll() is None or _processes_marked(self._marker)):
            time.sleep(0.1)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        for pid in _processes_marked(self._marker):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        process.wait(timeout=10)

    def restart(self, at: datetime, *, catch_up: bool = False,
                timeout: float = PROCESS_START_MARGIN_SECONDS) -> None:
        """Stop the daemon and start it again with its clock reading ``at``."""
        self.stop()
        self.start(at, catch_up=catch_up, timeout=timeout)

    def log_tail(self, chars: int = LOG_TAIL_CHARS) -> str:
        """The end of the daemon's log (every start), for failure messages."""
        text = (ANSI_COLOUR.sub("", self.log_path.read_text(errors="replace"))
                if self.log_path.exists() else "(no log)")
        return f"--- {self.log_path.name} (last {chars} chars) ---\n{text[-chars:]}"


def _processes_marked(marker: str) -> list[int]:
    """The processes whose environment carries ``MARKER_ENV=marker``."""
    if not marker:
        return []
    needle = f"{MARKER_ENV}={marker}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            if needle in (entry / "environ").read_bytes().split(b"\0"):
                found.append(int(entry.name))
    return found
