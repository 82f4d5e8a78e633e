"""Randomized scenarios of the file kind (material deliveries, issue 14), and their judge.

An inbox of a few delivery reports with overlapping lifetimes. A scenario mixes, at random:

* drops, as an uploader makes them (:mod:`.file_drops`): new files, corrections, the same
  bytes again, bad rows, lines claimed from other files, defective files;
* sensor ticks (the inbox sensor evaluated with ``build_sensor_context``, its partitions added)
  and runs of the versions it requests, skipping run keys already launched as the daemon does,
  warm (forked) or real ``dagster job execute`` with ``MOSTOVIK_INBOX_DIR`` and
  ``MOSTOVIK_ARCHIVE_DIR``;
* kill -9 of a run: at the start of its extract, once it has landed the file, inside its load
  transaction (the suite holds the file's business lock), right after its load committed (the
  ledger names the run; the archive step is next) or at a random moment;
* duplicate concurrent runs of one version (an operator's re-run beside the sensor's), and
  re-uploads racing a run: a corrected version dropped while the older version's run is in
  flight, at the same points, and its run started at once;
* an operator's re-run of an older version's landed payload (``reuse_landed``) once a newer
  version is loaded: its load must be refused as superseded.

Then, as an operator would, it ticks the sensor once more and re-runs the newest version of each
file whose runs were killed, until a run succeeds.

The uploads are drawn in :mod:`.file_drops`, judged after each scenario by :mod:`.file_judge`
and counted in :mod:`.file_totals`; this module runs the sensor and the runs.

``--reverts`` adds one more drop: the bytes of an older version of a file dropped again as its
newest (the sensor runs such a revert under a run key of its own).
``--no-claims`` leaves out the lines claimed from other files (a re-load of a version with such
a line used to empty its quarantine, until loads that leave rows out stopped recording a digest).

``python -m mostovik_pipelines_tests.chaos.file_scenarios --scenarios 50 --seed N`` runs it at
length on its own PostgreSQL and prints the summary.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import random
import signal
import sys
import time
from pathlib import Path
from urllib.parse import quote

import psycopg
from dagster import (
    AssetKey,
    DagsterEventType,
    DagsterRunStatus,
    RunsFilter,
    build_sensor_context,
)
from dagster._core.storage.tags import RUN_KEY_TAG, SENSOR_NAME_TAG

from mostovik_pipelines.core.tags import PARTITION_TAG
from mostovik_pipelines.framework.load.lock import partition_lock_keys
from mostovik_pipelines.resources.inbox import InboxResource, file_name_of
from mostovik_pipelines.sources import material_deliveries
from mostovik_pipelines_tests.chaos.file_drops import SOURCE, TABLE, FileDrops, ReportFile
from mostovik_pipelines_tests.chaos.file_judge import FileJudge
from mostovik_pipelines_tests.chaos.file_totals import FileTotals, file_faults, file_summary
from mostovik_pipelines_tests.chaos.harness import RunHandle, Workspace, status_text, wait_until
from mostovik_pipelines_tests.chaos.tally import Tally, tallied
from mostovik_pipelines_tests.support.locations import FAST_RETRY
from mostovik_pipelines_tests.support.postgres import ThrowawayPostgres

SENSOR = f"{SOURCE}_inbox_sensor"
RESOURCE_KEY = f"{SOURCE}_source"
KILL_POINTS = ("extract", "landed", "load", "committed", "random")
RACE_POINTS = ("extract", "landed", "load", "random")
SETTLE_ATTEMPTS = 3
REUSE_LANDED = {SOURCE: {"ops": {f"extract_{SOURCE}": {"config": {"reuse_landed": True}}}}}


class FileSuite(FileDrops, FileJudge):
    """The scenarios and their judge, against one :class:`Workspace` whose source is the inbox."""

    def __init__(self, workspace: Workspace, seed: int, *, lines: tuple[int, int] = (20, 80),
                 cli_share: float = 0.25, claims: bool = True, reverts: bool = False,
                 log=print) -> None:
        self.ws = workspace
        self.seed = seed
        self.line_counts = lines
        self.cli_share = cli_share
        self.claims = claims
        self.reverts = reverts
        self.log = log
        self.totals = FileTotals()
        self.inbox: InboxResource = workspace.resource
        self.inbox_dir, self.archive_dir = Path(self.inbox.inbox_dir), Path(self.inbox.archive_dir)
        self.sensor = workspace.location.get_sensor_def(SENSOR)
        self.cursor: str | None = None
        self.launched_keys: set[str] = set()
        self.requested: set[str] = set()
        """Versions the sensor asked to run: the daemon would have a run record of each."""
        self.files: dict[str, ReportFile] = {}
        self.drops = 0
        self.clock_ns = time.time_ns() - 86_400 * 10**9
        """Modification time of the latest drop: every drop is newer than the one before."""
        self.observations_cursor: str | None = None
        self.archive_seen: dict[str, str] = {}
        """Archive entries seen by earlier judgements, with their sha256: never to vanish."""
        self.copies_left = 0

    def run(self, scenarios: int) -> FileTotals:
        for number in range(1, scenarios + 1):
            self.scenario(number)
        return self.totals

    def scenario(self, number: int) -> None:
        rng = random.Random(f"{self.seed}:files:{number}")
        notes: list[str] = []
        for step in range(rng.randint(3, 5)):
            action = rng.random()
            if step == 0 or action < 0.55:
                self._drop_action(rng, notes)
            elif action < 0.9 or not self._replay_older(rng, notes):
                self._tick_and_run(rng, notes)
        self._settle(rng, notes)
        problems = self._judge()
        self.totals.distinct_problems.update(problems)
        self.totals.scenarios += 1
        if problems:
            self._fail(f"scenario {number} ({' '.join(notes)}): {'; '.join(problems)}")
        self.log(f"  #{number:<4} {' '.join(notes)}{'  DIFFERENT' if problems else ''}")

    # --- the sensor and runs --------------------------------------------------------------------

    def _tick(self) -> list[tuple[str, str]]:
        """One sensor evaluation, its partitions added: the (version, run key) pairs the daemon
        would launch (a run key launched before is skipped)."""
        self.totals.ticks += 1
        context = build_sensor_context(instance=self.ws.instance, cursor=self.cursor,
                                       resources={RESOURCE_KEY: self.inbox})
        context.log.setLevel(logging.WARNING)  # each tick's new versions: not in the output
        result = self.sensor(context)
        for request in result.dynamic_partitions_requests:
            self.ws.instance.add_dynamic_partitions(request.partitions_def_name,
                                                    list(request.partition_keys))
        self.cursor = result.cursor
        wanted = []
        for request in result.run_requests:
            if request.run_key in self.launched_keys or self.ws.instance.get_run_records(
                    RunsFilter(tags={RUN_KEY_TAG: request.run_key, SENSOR_NAME_TAG: SENSOR}),
                    limit=1):
                self.totals.requests_skipped += 1
                continue
            self.launched_keys.add(request.run_key)
            self.requested.add(request.partition_key)
            wanted.append((request.partition_key, request.run_key))
        return wanted

    def _start(self, version: str, run_key: str | None, cli: bool = False) -> RunHandle:
        tags = {RUN_KEY_TAG: run_key, SENSOR_NAME_TAG: SENSOR} if run_key else {}
        self.totals.runs["operator" if run_key is None else
                         "sensor, cli" if cli else "sensor, warm"] += 1
        return self.ws.start_cli(version, tags) if cli else self.ws.start_warm(version, tags)

    def _tick_and_run(self, rng: random.Random, notes: list[str]) -> None:
        wanted = self._tick()
        if not wanted:
            notes.append("tick:-")
            return
        runs = [(version, self._start(version, run_key, rng.random() < self.cli_share))
                for version, run_key in wanted]
        note = [f"tick:{len(runs)}"]
        if rng.random() < 0.2:
            version, _ = rng.choice(runs)
            runs.append((version, self._start(version, None)))
            self.totals.duplicate_runs += 1
            note.append("dup")
        version, handle = runs[0]
        report = self.files[file_name_of(version)]
        if report.drops[-1].version == version and report.drops[-1].loadable and (
                rng.random() < 0.3):
            runs += self._race(rng, report, handle, note)
        elif rng.random() < 0.4 + 0.4 * (handle.kind == "cli"):
            point = rng.choice(KILL_POINTS)
            killed = self._kill_at(rng, handle, point, version)
            note.append(f"{'kill' if killed else 'nokill'}@{point}")
        statuses = [self.ws.finish(h, rng) for _, h in runs]
        note.append("/".join(status_text(s) for s in statuses))
        notes.append("[" + " ".join(note) + "]")

    def _race(self, rng: random.Random, report: ReportFile, handle: RunHandle,
              note: list[str]) -> list[tuple[str, RunHandle]]:
        """Drop a corrected version while the run of the file's version is at a random point,
        and start the runs the next tick asks for at once."""
        point = rng.choice(RACE_POINTS)
        started: list[tuple[str, RunHandle]] = []
        with psycopg.connect(self.ws.dsn, autocommit=True) as holder:
            if point == "load":
                holder.execute("SELECT pg_advisory_lock(%s, %s)",
                               partition_lock_keys(TABLE, report.name))
            reached = self._reach(rng, handle, point, handle.partition, holder)
            self._correction(rng, report, bad_rows=False, systematic=False)
            started = [(version, self._start(version, run_key, rng.random() < self.cli_share))
                       for version, run_key in self._tick()]
            if point == "load":
                # Both versions' loads meet at the file's lock, the older one waiting first.
                newer = next((h for version, h in started
                              if file_name_of(version) == report.name), handle)
                wait_until(lambda: self.ws.has_event(newer, DagsterEventType.STEP_START,
                                                     f"{SOURCE}.load_"), newer, 30, 0.02)
                holder.execute("SELECT pg_advisory_unlock(%s, %s)",
                               partition_lock_keys(TABLE, report.name))
        self.totals.reupload_races[point] += 1
        note.append(f"race@{point}{'' if reached else '(late)'}")
        return started

    def _kill_at(self, rng: random.Random, handle: RunHandle, point: str, version: str) -> bool:
        with psycopg.connect(self.ws.dsn, autocommit=True) as holder:
            if point == "load":
                lock = partition_lock_keys(TABLE, file_name_of(version))
                holder.execute("SELECT pg_advisory_lock(%s, %s)", lock)
                try:
                    reached = self._reach(rng, handle, point, version, holder)
                    killed = reached and handle.kill()
                finally:
                    holder.execute("SELECT pg_advisory_unlock(%s, %s)", lock)
            else:
                killed = self._reach(rng, handle, point, version, holder) and handle.kill()
        if killed:
            self.totals.kills[point] += 1
            self.totals.cli_kills += handle.kind == "cli"
        return killed

    def _reach(self, rng: random.Random, handle: RunHandle, point: str, version: str,
               observer: psycopg.Connection) -> bool:
        """Wait until the run is at ``point``; False if it ended first."""
        ws = self.ws
        patience = 90.0 if handle.kind == "cli" else 40.0
        if point == "extract":
            return wait_until(lambda: ws.has_event(handle, DagsterEventType.STEP_START,
                                                   f"{SOURCE}.extract_"), handle, patience, 0.005)
        if point == "landed":
            return wait_until(lambda: self._landed_by(handle, version), handle, patience, 0.003)
        if point == "load":
            lock = partition_lock_keys(TABLE, file_name_of(version))
            return wait_until(lambda: _waiting_for(observer, lock), handle, patience, 0.005)
        if point == "committed":
            name = file_name_of(version)
            return wait_until(lambda: ws.run_id_of(handle) is not None
                              and _loaded_by(observer, name) == ws.run_id_of(handle),
                              handle, patience, 0.002)
        wait_until(lambda: False, handle, rng.uniform(0, 8.0 if handle.kind == "cli" else 2.5),
                   0.02)
        return handle.alive()

    def _landed_by(self, handle: RunHandle, version: str) -> bool:
        run_id = self.ws.run_id_of(handle)
        folder = (self.ws.data_dir / "landing" / quote(SOURCE, safe="")
                  / quote(version, safe="") / "fetches")
        if run_id is None or not folder.exists():
            return False
        for record in folder.glob("*.json"):
            try:
                if json.loads(record.read_text()).get("run_id") == run_id:
                    return True
            except (OSError, ValueError):
                continue
        return False

    def _replay_older(self, rng: random.Random, notes: list[str]) -> bool:
        """An operator re-transforms the landed payload of a version older than the file's
        loaded one (``reuse_landed``): its load must be refused as superseded, the table left
        as it is. False if no file has such a version."""
        older = [drop for report in self.files.values()
                 if (loaded := self._expected(report)) is not None
                 and self._loaded(loaded.version)
                 for drop in report.drops
                 if drop.number < loaded.number and drop.loadable
                 and drop.version != loaded.version and self._landed(drop.version)]
        if not older:
            return False
        drop = rng.choice(older)
        self.totals.replays += 1
        handle = self.ws.start_warm(drop.version, ops_config=REUSE_LANDED)
        self.totals.runs["operator"] += 1
        notes.append(f"replay[{drop.name[:14]}]:{status_text(self.ws.finish(handle, rng))}")
        return True

    def _landed(self, version: str) -> bool:
        return (self.ws.data_dir / "landing" / quote(SOURCE, safe="")
                / quote(version, safe="") / "fetches").exists()

    # --- settling -------------------------------------------------------------------------------

    def _settle(self, rng: random.Random, notes: list[str]) -> None:
        """Tick once more and run what the sensor asks for, then re-run the newest version of
        each file that no run has loaded (its runs were killed), as an operator does."""
        runs = [self._start(version, run_key) for version, run_key in self._tick()]
        for handle in runs:
            self.ws.finish(handle, rng)
        rerun = [report for report in self.files.values()
                 if self._settle_file(rng, report)]
        superseded = self._count_superseded()
        notes.append(f"settled[{len(runs)} sensor, {len(rerun)} re-run]"
                     + (f" superseded {superseded}" if superseded else ""))

    def _settle_file(self, rng: random.Random, report: ReportFile) -> bool:
        """Re-run the file's newest version until a run succeeds, if it is loadable and its
        runs (the sensor asked for it) loaded nothing; whether it had to."""
        last = report.drops[-1]
        if (not last.loadable or last.version not in self.requested
                or self._loaded(last.version)):
            return False
        for _ in range(SETTLE_ATTEMPTS):
            self.totals.settle_runs += 1
            if self.ws.finish(self._start(last.version, None), rng) == DagsterRunStatus.SUCCESS:
                return True
        self.totals.unsettled += 1
        self._fail(f"{last.version}: no run succeeded after {SETTLE_ATTEMPTS} re-runs")
        return True

    def _loaded(self, version: str) -> bool:
        """Whether a run of the version succeeded (the newest version of a file: it loaded)."""
        return bool(self.ws.instance.get_run_records(
            RunsFilter(tags={PARTITION_TAG: version}, statuses=[DagsterRunStatus.SUCCESS]),
            limit=1))

    def _count_superseded(self) -> int:
        """Loads refused as superseded since the last count, from the observations runs record
        of the partitions they left out."""
        refused = 0
        while True:
            result = self.ws.instance.fetch_observations(
                AssetKey(SOURCE), limit=1000, cursor=self.observations_cursor, ascending=True)
            for record in result.records:
                observation = record.event_log_entry.asset_observation
                skipped = observation.metadata.get("mostovik/skipped") if observation else None
                refused += skipped is not None and "superseded" in json.dumps(skipped.value)
            self.observations_cursor = result.cursor
            if not result.has_more:
                break
        self.totals.superseded += refused
        return refused


    def _fail(self, message: str) -> None:
        self.totals.failures.append(message)
        self.log(f"  FAILURE: {message}")



def _waiting_for(observer: psycopg.Connection, lock: tuple[int, int]) -> bool:
    """Whether a session waits for the advisory lock ``lock`` (two int4 keys)."""
    return observer.execute(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted "
        "AND classid = %s::bigint::oid AND objid = %s::bigint::oid AND objsubid = 2 "
        "AND database = (SELECT oid FROM pg_database WHERE datname = current_database())",
        tuple(key % 2**32 for key in lock)).fetchone()[0] > 0


def _loaded_by(observer: psycopg.Connection, name: str) -> str | None:
    row = observer.execute(
        "SELECT loaded_by_run FROM partition_loads WHERE table_name = %s AND partition_key = %s",
        (TABLE, name)).fetchone()
    return row[0] if row else None


def file_workspace(postgres: ThrowawayPostgres, template: str | None = None,
                   keep: bool = False) -> Workspace:
    """The workspace of the delivery reports, its inbox and archive under its root; CLI runs
    find them through ``MOSTOVIK_INBOX_DIR`` and ``MOSTOVIK_ARCHIVE_DIR``."""
    source = dataclasses.replace(material_deliveries.SOURCE, extract_retry=FAST_RETRY,
                                 load_retry=FAST_RETRY)

    def wiring(root: Path) -> tuple[InboxResource, dict[str, str]]:
        inbox, archive = root / "inbox", root / "archive"
        return (InboxResource(inbox_dir=str(inbox), archive_dir=str(archive)),
                {"MOSTOVIK_INBOX_DIR": str(inbox), "MOSTOVIK_ARCHIVE_DIR": str(archive)})

    return Workspace(postgres, source, wiring, template=template, keep=keep)



def run_file_chaos(postgres: ThrowawayPostgres, seed: int, scenarios: int, *,
                   lines: tuple[int, int] = (20, 80), cli_share: float = 0.25,
                   claims: bool = True, reverts: bool = False, template: str | None = None,
                   keep: bool = False, log=print, tally: Tally | None = None) -> FileTotals:
    """Run the scenarios in a workspace of their own and print the summary (and, per scenario
    and fault, ``tally`` it)."""
    started = time.monotonic()
    workspace = file_workspace(postgres, template, keep)
    try:
        suite = FileSuite(workspace, seed, lines=lines, cli_share=cli_share, claims=claims,
                          reverts=reverts, log=log)

        def findings(totals: FileTotals) -> dict[str, int]:
            return {"differences": totals.differences, "duplicates": totals.duplicates,
                    "unsettled": totals.unsettled, "stuck": len(workspace.stuck_runs())}

        if tally is not None:
            tallied(suite, "file", tally, file_faults, findings)
        totals = suite.run(scenarios)
        if tally is not None:
            tally.settle("file", "end", **findings(totals))
    finally:
        if keep:
            log(f"work dir kept: {workspace.root}")
        workspace.close()
    replay = (f"--seed {seed} --scenarios {scenarios} --min-lines {lines[0]} "
              f"--max-lines {lines[1]} --cli-share {cli_share}"
              f"{'' if claims else ' --no-claims'}{' --reverts' if reverts else ''}")
    log(file_summary(totals, replay, time.monotonic() - started))
    return totals


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mostovik_pipelines_tests.chaos.file_scenarios")
    parser.add_argument("--seed", type=int, default=None, help="default: a random seed")
    parser.add_argument("--scenarios", type=int, default=50)
    parser.add_argument("--min-lines", type=int, default=20)
    parser.add_argument("--max-lines", type=int, default=200)
    parser.add_argument("--cli-share", type=float, default=0.25,
                        help="share of sensor runs started as `dagster job execute`")
    parser.add_argument("--no-claims", dest="claims", action="store_false",
                        help="no file claims a waybill line another file holds")
    parser.add_argument("--reverts", action="store_true",
                        help="also drop an older version's bytes again as a file's newest")
    parser.add_argument("--keep", action="store_true", help="keep the work dir (run logs)")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 31)
    print(f"file chaos: seed {seed}, {args.scenarios} scenarios", flush=True)
    # A plain kill must still stop the servers started here (the finally blocks below).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    postgres = ThrowawayPostgres().start()
    try:
        totals = run_file_chaos(postgres, seed, args.scenarios,
                                lines=(args.min_lines, args.max_lines), cli_share=args.cli_share,
                                claims=args.claims, reverts=args.reverts, keep=args.keep,
                                log=lambda line: print(line, flush=True))
    finally:
        postgres.stop()
    return 1 if totals.failures or totals.duplicates or totals.differences else 0


if __name__ == "__main__":
    sys.exit(main())
