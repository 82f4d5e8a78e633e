"""Randomized scenarios of the ERP work-orders sync (issue 13), and their judge.

The pool is 3-4 consecutive daily windows of a few hundred to 2,000 work orders each (tens of
pages of 100). A scenario mixes, at random:

* source changes between runs, through the stand-in's controls with explicit timestamps inside
  the pool's windows: updates within a record's window, late updates of old records into a newer
  window, tombstones, restores, and nightly-import batches stamping several records with the
  very same instant (page boundaries then fall inside a run of equal ``updated_at``);
* runs of random windows in random order (old windows re-run after newer ones), warm (a forked
  process that has the code location loaded) or real ``dagster job execute`` processes with
  ``MOSTOVIK_ERP_URL`` set;
* faults on random pages: 429 with Retry-After 0-1, 503 (with or without Retry-After), an
  ``expire_token`` at page k; and expiring every page token while a window waits to resume;
* kill -9 of a run mid-window: once ``sync_progress`` shows k pages committed by it, once it has
  landed j pages, at the start of its load step, or at a random moment;
* duplicate concurrent runs of one window, and re-runs after kills, which must resume.

The source's changes are drawn in :mod:`.sync_source`, the judge is :mod:`.sync_judge` and the
counts :mod:`.sync_totals`; this module runs the windows, their faults and kills. Its runs
start, die and are judged dead through the one harness of every suite
(:class:`~.harness.Workspace`).

``python -m mostovik_pipelines_tests.chaos.sync_scenarios --scenarios 50 --seed N`` runs it at
length on its own PostgreSQL and stand-in and prints the summary.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import signal
import sys
import time
from datetime import date, datetime, timedelta
from pathlib import Path
from typing import Any
from urllib.parse import quote

import psycopg
from dagster import (
    DagsterEventType,
    DagsterRunStatus,
)

from mostovik_pipelines.core.retries import RetryPolicy
from mostovik_pipelines.framework.load.lock import partition_lock_keys
from mostovik_pipelines.resources import HttpSourceResource
from mostovik_pipelines.sources import erp_work_orders
from mostovik_pipelines.standin import StandinClient, StandinServer
from mostovik_pipelines_tests.chaos.harness import (
    RunHandle,
    Workspace,
    a_load_waits_for_a_lock,
    status_text,
    wait_until,
)
from mostovik_pipelines_tests.chaos.sync_judge import SyncJudge
from mostovik_pipelines_tests.chaos.sync_source import (
    MOSCOW,
    SOURCE,
    TABLE,
    Checkpoint,
    SyncSourceChanges,
    instant,
)
from mostovik_pipelines_tests.chaos.sync_totals import SyncTotals, sync_faults, sync_summary
from mostovik_pipelines_tests.chaos.tally import Tally, tallied
from mostovik_pipelines_tests.support.postgres import ThrowawayPostgres

WARM_RETRY = RetryPolicy(max_attempts=5, base_delay_seconds=0.05, max_delay_seconds=0.2)
"""The source's five attempts with short delays: a run survives the few faults it is given."""
ROWS_PER_COMMIT = 250
"""Windows of 300-2,000 records commit in groups of three pages (the last may be smaller), so
a kill finds committed groups to resume after and a group is never a page."""
KILL_POINTS = {"committed": 5, "extract": 2, "load_start": 1, "random": 2}
"""Kill points and their weights: a kill after k committed pages leaves a checkpoint to resume."""
SETTLE_ATTEMPTS = 4


def pool_windows(today: date, size: int) -> list[str]:
    """``size`` consecutive past days, oldest first, a week before ``today`` (Moscow)."""
    last = today - timedelta(days=7)
    return [(last - timedelta(days=size - 1 - n)).isoformat() for n in range(size)]


class SyncSuite(SyncSourceChanges, SyncJudge):
    """The scenarios and their judge, against one :class:`Workspace` and the stand-in."""

    def __init__(self, workspace: Workspace, standin: StandinClient, seed: int, *,
                 windows: int = 4, records: tuple[int, int] = (300, 2000),
                 cli_share: float = 0.3, max_steps: int = 3, today: date | None = None,
                 log=print) -> None:
        self.ws = workspace
        self.standin = standin
        self.seed = seed
        self.cli_share = cli_share
        self.max_steps = max_steps
        self.log = log
        self.totals = SyncTotals()
        rng = random.Random(f"{seed}:pool")
        self.windows = pool_windows(today or datetime.now(MOSCOW).date(), windows)
        self.bounds = {w: erp_work_orders.window_bounds(w) for w in self.windows}
        standin.reset_erp()
        standin.clear_faults()
        for window in self.windows:
            standin.set_erp_volume(window, rng.randint(*records))
        self.records: dict[str, dict] = {}
        self.synced: dict[str, bool] = dict.fromkeys(self.windows, False)
        """Whether a run started after the last source change has synced the window, and no
        run of it has failed since."""
        self.last_window: str | None = None
        self.read_up_to: dict[str, datetime] = {}
        """Per window, the last item of the pages its runs landed since its last success: what
        a next run may take up instead of asking the source again."""

    def run(self, scenarios: int) -> SyncTotals:
        for number in range(1, scenarios + 1):
            self.scenario(number)
        return self.totals

    def scenario(self, number: int) -> None:
        rng = random.Random(f"{self.seed}:sync:{number}")
        notes: list[str] = []
        self._read_records()
        for step in range(rng.randint(1, self.max_steps)):
            if rng.random() < (0.6 if step == 0 else 0.15):
                self._change_source(rng, notes)
            self._run_action(rng, notes)
        self.standin.clear_faults()
        self._settle(rng, notes)
        problems = self._judge()
        self.totals.distinct_problems.update(problems)
        self.totals.scenarios += 1
        if problems:
            self._fail(f"scenario {number} ({' '.join(notes)}): {'; '.join(problems)}")
        self.log(f"  #{number:<4} {' '.join(notes)}{'  DIFFERENT' if problems else ''}")

    # --- the source -----------------------------------------------------------------------------

    # --- runs -----------------------------------------------------------------------------------

    def _run_action(self, rng: random.Random, notes: list[str]) -> None:
        """Run a window: maybe with faults, a duplicate and a kill, maybe resumed at once."""
        checkpoints = self._checkpoints()
        if checkpoints and rng.random() < 0.5:
            window = rng.choice(sorted(checkpoints))
        else:
            window = rng.choice(self.windows)
        checkpoint = checkpoints.get(window)
        pages = self._pages(window)
        cli = rng.random() < self.cli_share
        note = [f"{window[5:]}:{'cli' if cli else 'warm'}"]
        if checkpoint:
            self._maybe_expire_tokens(rng, note)
        note += self._queue_faults(rng, window, pages, cli)
        duplicate = rng.random() < 0.2
        kill_point = (rng.choices(list(KILL_POINTS), list(KILL_POINTS.values()))[0]
                      if rng.random() < (0.8 if cli else 0.45) else None)
        started = time.time()
        handles = [self._start(window, cli)]
        if duplicate:
            self.totals.duplicate_runs += 1
            handles.append(self._start(window, rng.random() < self.cli_share))
            note.append("dup")
        killed = bool(kill_point) and self._kill_at(rng, handles[0], kill_point, window, pages)
        if kill_point:
            note.append(f"{'kill' if killed else 'nokill'}@{kill_point}")
        statuses = [self.ws.finish(handle, rng) for handle in handles]
        note.append("/".join(status_text(s) for s in statuses))
        self._book(window, handles, statuses, checkpoint, started, note)
        if killed and rng.random() < 0.6:
            # The operator's re-run right after the crash: it must resume.
            self._maybe_expire_tokens(rng, note)
            status = self._run_once(rng, window, rng.random() < self.cli_share, note)
            note.append(f"resume:{status_text(status)}")
        notes.append("[" + " ".join(note) + "]")

    def _maybe_expire_tokens(self, rng: random.Random, note: list[str]) -> None:
        """The committed token expires while the window waits: the resume narrows the window."""
        if rng.random() < 0.4:
            self.standin.expire_erp_page_tokens()
            self.totals.faults["expire_all"] += 1
            note.append("expired")

    def _run_once(self, rng: random.Random, window: str, cli: bool,
                  note: list[str]) -> DagsterRunStatus | None:
        checkpoint = self._checkpoints().get(window)
        started = time.time()
        handle = self._start(window, cli)
        status = self.ws.finish(handle, rng)
        self._book(window, [handle], [status], checkpoint, started, note)
        return status

    def _book(self, window: str, handles: list[RunHandle],
              statuses: list[DagsterRunStatus | None], checkpoint: Checkpoint | None,
              started: float, note: list[str]) -> None:
        """The runs' outcome: the window is synced if they all succeeded, else unfinished (a
        killed run of a duplicate pair may be the later one, leaving its checkpoint, and what
        they landed is read); a single run of a window that held a checkpoint when it started
        must have resumed."""
        self.synced[window] = all(s == DagsterRunStatus.SUCCESS for s in statuses)
        if self.synced[window]:
            self.read_up_to.pop(window, None)
        else:
            landed = [moment for handle in handles
                      for moment in self._landed_instants(handle, window)]
            if window in self.read_up_to:
                landed.append(self.read_up_to[window])
            if landed:
                self.read_up_to[window] = max(landed)
        if checkpoint is None or len(statuses) != 1:
            return  # the requests of a duplicate pair cannot be told apart
        problem = self._check_resume(window, checkpoint, started, time.time())
        if problem:
            self.totals.resume_violations += 1
            note.append("RESUME-VIOLATION")
            self._fail(f"{window}: {problem}")

    def _queue_faults(self, rng: random.Random, window: str, pages: int, cli: bool) -> list[str]:
        if rng.random() >= 0.5:
            return []
        match = f"updated_to={self.bounds[window][1].isoformat()}"
        queued = []
        for _ in range(rng.randint(1, 2)):
            page = rng.randint(1, pages)
            kind = rng.choice(("429", "503", "expire_token") if pages >= 2 else ("429", "503"))
            if kind == "expire_token":
                page = max(page, 2)
                self.standin.fault("expire_token", route="erp", page=page, match=match)
            else:
                options: dict[str, Any] = {"status": int(kind)}
                # A CLI run backs off for seconds without Retry-After: give it one.
                if kind == "429" or cli or rng.random() < 0.5:
                    options["retry_after"] = rng.randint(0, 1)
                self.standin.fault("status", route="erp", page=page, match=match, **options)
            self.totals.faults[kind] += 1
            queued.append(f"{kind}@p{page}")
        return queued

    def _start(self, window: str, cli: bool) -> RunHandle:
        self.totals.runs["cli" if cli else "warm"] += 1
        if self.last_window is not None and window < self.last_window:
            self.totals.old_window_reruns += 1
        self.last_window = window
        return self.ws.start_cli(window) if cli else self.ws.start_warm(window)

    def _kill_at(self, rng: random.Random, handle: RunHandle, point: str, window: str,
                 pages: int) -> bool:
        ws = self.ws
        patience = 90.0 if handle.kind == "cli" else 50.0
        if point == "committed":
            reached = self._held_after_its_first_commit(handle, window, patience)
        elif point == "extract":
            wanted = rng.randint(1, pages)
            reached = wait_until(lambda: self._landed_by(handle, window) >= wanted, handle,
                                 patience, 0.003)
        elif point == "load_start":
            reached = wait_until(lambda: ws.has_event(
                handle, DagsterEventType.STEP_START, f"{SOURCE}.load_"), handle, patience, 0.005)
        else:
            wait_until(lambda: False, handle, rng.uniform(0, 8.0 if handle.kind == "cli" else 3.0),
                       0.02)
            reached = handle.alive()
        if not (reached and handle.kill()):
            return False
        self.totals.kills[point] += 1
        self.totals.cli_kills += handle.kind == "cli"
        return True

    def _held_after_its_first_commit(self, handle: RunHandle, window: str,
                                     patience: float) -> bool:
        """Hold the run between its first commit and its next one: the window's business lock
        is taken before the run loads, let go for its first group's transaction and taken
        again at once (the lock queue grants it before the run's next group asks), so a kill
        now finds the checkpoint that commit left, however slow the machine. False for a
        window of one group (its only commit ends it) or a run that ended first."""
        keys = partition_lock_keys(TABLE, erp_work_orders.SOURCE.load_target.partition_scope(
            window))
        with psycopg.connect(self.ws.dsn, autocommit=True) as holder:
            holder.execute("SELECT pg_advisory_lock(%s, %s)", keys)
            try:
                if not wait_until(lambda: a_load_waits_for_a_lock(holder), handle, patience, 0.01):
                    return False
                holder.execute("SELECT pg_advisory_unlock(%s, %s)", keys)
                holder.execute("SELECT pg_advisory_lock(%s, %s)", keys)
                with psycopg.connect(self.ws.dsn, autocommit=True) as observer:
                    return (self._committed_by(observer, handle, window) > 0
                            and wait_until(lambda: a_load_waits_for_a_lock(holder), handle,
                                           patience, 0.01))
            finally:
                holder.execute("SELECT pg_advisory_unlock_all()")

    def _committed_by(self, observer: psycopg.Connection, handle: RunHandle,
                      window: str) -> int:
        """Pages of the window the run has committed, by its checkpoint."""
        run_id = self.ws.run_id_of(handle)
        row = observer.execute(
            "SELECT pages_committed, run_id FROM sync_progress WHERE source = %s "
            "AND partition_key = %s", (SOURCE, window)).fetchone()
        return row[0] if row and row[1] == run_id else 0

    def _landed_pages(self, handle: RunHandle, window: str) -> list[Path]:
        """The landing records of the pages the run fetched for the window itself."""
        run_id = self.ws.run_id_of(handle)
        folder = (self.ws.data_dir / "landing" / quote(SOURCE, safe="")
                  / quote(window, safe="") / "fetches")
        return list(folder.glob(f"*-{run_id}-p*.json")) if run_id else []

    def _landed_by(self, handle: RunHandle, window: str) -> int:
        return len(self._landed_pages(handle, window))

    def _landed_instants(self, handle: RunHandle, window: str) -> list[datetime]:
        """The ``updated_at`` of every item in the pages the run landed (a page whose bytes
        a kill left unwritten holds none)."""
        instants = []
        for record in self._landed_pages(handle, window):
            try:
                page = json.loads(Path(json.loads(record.read_text())["blob_path"]).read_bytes())
            except (OSError, ValueError, KeyError):
                continue
            instants += [instant(item["updated_at"]) for item in page.get("items", [])]
        return instants

    def _settle(self, rng: random.Random, notes: list[str]) -> None:
        """Sync every window not synced since the last change, one warm run at a time, until a
        run succeeds: the judge's precondition."""
        due = [w for w in self.windows if not self.synced[w]]
        rng.shuffle(due)
        for window in due:
            for _ in range(SETTLE_ATTEMPTS):
                self.totals.settle_runs += 1
                if self._run_once(rng, window, False, notes) == DagsterRunStatus.SUCCESS:
                    break
            else:
                self.totals.unsettled += 1
                self._fail(f"{window}: no run succeeded after {SETTLE_ATTEMPTS} settling runs")
        if due:
            notes.append(f"settled {','.join(w[5:] for w in due)}")

    # --- the judge ------------------------------------------------------------------------------

    def _fail(self, message: str) -> None:
        self.totals.failures.append(message)
        self.log(f"  FAILURE: {message}")


def sync_workspace(postgres: ThrowawayPostgres, standin_server: StandinServer,
                   template: str | None = None, keep: bool = False) -> Workspace:
    """The workspace of the ERP source, wired to the stand-in; CLI runs reach it through
    ``MOSTOVIK_ERP_URL``."""
    source = dataclasses.replace(erp_work_orders.SOURCE, extract_retry=WARM_RETRY,
                                 load_retry=WARM_RETRY, rows_per_commit=ROWS_PER_COMMIT)
    resource = HttpSourceResource(base_url=standin_server.erp_url, timeout_seconds=10.0)
    environment = {"MOSTOVIK_ERP_URL": standin_server.erp_url,
                   "MOSTOVIK_ERP_TIMEOUT_SECONDS": "10",
                   "MOSTOVIK_ERP_ROWS_PER_COMMIT": str(ROWS_PER_COMMIT)}
    return Workspace(postgres, source, lambda _root: (resource, environment),
                     template=template, keep=keep)



def run_sync_chaos(postgres: ThrowawayPostgres, standin_server: StandinServer, seed: int,
                   scenarios: int, *, windows: int = 4, records: tuple[int, int] = (300, 2000),
                   cli_share: float = 0.3, max_steps: int = 3, template: str | None = None,
                   keep: bool = False, log=print, tally: Tally | None = None) -> SyncTotals:
    """Run the scenarios in a workspace of their own and print the summary (and, per scenario
    and fault, ``tally`` it)."""
    started = time.monotonic()
    workspace = sync_workspace(postgres, standin_server, template, keep)
    standin = StandinClient(standin_server.url)
    try:
        suite = SyncSuite(workspace, standin, seed, windows=windows, records=records,
                          cli_share=cli_share, max_steps=max_steps, log=log)

        def findings(totals: SyncTotals) -> dict[str, int]:
            return {"differences": totals.differences, "duplicates": totals.duplicates,
                    "unsettled": totals.unsettled, "stuck": len(workspace.stuck_runs())}

        if tally is not None:
            tallied(suite, "sync", tally, sync_faults, findings)
        totals = suite.run(scenarios)
        if tally is not None:
            tally.settle("sync", "end", **findings(totals))
    finally:
        standin.clear_faults()
        standin.reset_erp()
        if keep:
            log(f"work dir kept: {workspace.root}")
        workspace.close()
    replay = (f"--seed {seed} --scenarios {scenarios} --windows {windows} "
              f"--min-records {records[0]} --max-records {records[1]} --cli-share {cli_share} "
              f"--max-steps {max_steps}")
    log(sync_summary(totals, replay, time.monotonic() - started))
    return totals


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mostovik_pipelines_tests.chaos.sync_scenarios")
    parser.add_argument("--seed", type=int, default=None, help="default: a random seed")
    parser.add_argument("--scenarios", type=int, default=50)
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--min-records", type=int, default=300)
    parser.add_argument("--max-records", type=int, default=2000)
    parser.add_argument("--cli-share", type=float, default=0.3,
                        help="share of runs started as `dagster job execute`")
    parser.add_argument("--max-steps", type=int, default=3,
                        help="most run actions in a scenario (each may change the source first)")
    parser.add_argument("--keep", action="store_true", help="keep the work dir (run logs)")
    args = parser.parse_args(argv)
    seed = args.seed if args.seed is not None else random.SystemRandom().randrange(1 << 31)
    print(f"sync chaos: seed {seed}, {args.scenarios} scenarios", flush=True)
    # A plain kill must still stop the servers started here (the finally blocks below).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    postgres = ThrowawayPostgres().start()
    standin_server = StandinServer().start()
    try:
        totals = run_sync_chaos(postgres, standin_server, seed, args.scenarios,
                                windows=args.windows,
                                records=(args.min_records, args.max_records),
                                cli_share=args.cli_share, max_steps=args.max_steps,
                                keep=args.keep,
                                log=lambda line: print(line, flush=True))
    finally:
        standin_server.stop()
        postgres.stop()
    return 1 if totals.failures or totals.duplicates or totals.differences else 0


if __name__ == "__main__":
    sys.exit(main())
