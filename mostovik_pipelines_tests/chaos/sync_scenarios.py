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

A change is stamped the way a real ERP's clock would stamp it: after the last item a window's
checkpoint has committed, if an interrupted run left one, and after the last item of the pages
the window's runs landed since its last success (a killed window's next run takes those up
instead of asking again): a change can never land before what was read earlier, since
``updated_at`` only grows.

The judge, once every window of the pool has been synced successfully by a run started after the
last source change: the table equals the stand-in's oracle for the union of the pool's windows
(every record whose latest version lies in a pool window, on every field, ``window_date`` the
Moscow day of its ``updated_at``), no id is held twice, no quarantine, and no ``sync_progress``
row is left. Every run of a window that had a checkpoint of k pages must fetch no page <= k: in
the stand-in's log, its requests for the whole window carry a token of a page greater than k
(or one refused as expired), and any other starts at or after the last committed item (the
window narrowed after an expired token).

Its runs start, die and are judged dead through the one harness of every suite
(:class:`~.harness.Workspace`).

``python -m mostovik_pipelines_tests.chaos.sync_scenarios --scenarios 50 --seed N`` runs it at
length on its own PostgreSQL and stand-in and prints the summary.
"""

from __future__ import annotations

import argparse
import base64
import dataclasses
import json
import random
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from datetime import UTC, date, datetime, timedelta, timezone
from decimal import Decimal
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, quote
from zoneinfo import ZoneInfo

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
    wait_until,
)
from mostovik_pipelines_tests.chaos.tally import Tally, named, tallied
from mostovik_pipelines_tests.support.postgres import ThrowawayPostgres

MOSCOW = ZoneInfo("Europe/Moscow")
SOURCE = erp_work_orders.SOURCE.name
TABLE = erp_work_orders.erp_work_orders.name
PAGE_SIZE = erp_work_orders.PAGE_SIZE
WARM_RETRY = RetryPolicy(max_attempts=5, base_delay_seconds=0.05, max_delay_seconds=0.2)
"""The source's five attempts with short delays: a run survives the few faults it is given."""
ROWS_PER_COMMIT = 250
"""Windows of 300-2,000 records commit in groups of three pages (the last may be smaller), so
a kill finds committed groups to resume after and a group is never a page."""
KILL_POINTS = {"committed": 5, "extract": 2, "load_start": 1, "random": 2}
"""Kill points and their weights: a kill after k committed pages leaves a checkpoint to resume."""
SETTLE_ATTEMPTS = 4
OFFSETS = (timedelta(hours=3), timedelta(0), timedelta(hours=5), timedelta(hours=-4))
"""The offsets changes are written with: the stand-in prints ``updated_at`` as it was given."""
STATUSES = erp_work_orders.STATUSES
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
TOKEN_MAC_BYTES = 16
"""The MAC that ends a stand-in page token."""
ROW_COLUMNS = ("id, object_code, title, status, planned_start, planned_finish, amount::text, "
               "updated_at, version, deleted, window_date")

def counts_text(counter: Counter) -> str:
    return ", ".join(f"{key} {n}" for key, n in sorted(counter.items())) or "none"


def status_text(status: DagsterRunStatus | None) -> str:
    return status.value.lower() if status else "none"


# --- the sync suite -----------------------------------------------------------------------------


@dataclass
class SyncTotals:
    scenarios: int = 0
    runs: Counter = field(default_factory=Counter)
    """Runs started, by kind (warm, cli)."""
    settle_runs: int = 0
    kills: Counter = field(default_factory=Counter)
    """Kills delivered, by point."""
    cli_kills: int = 0
    faults: Counter = field(default_factory=Counter)
    source_changes: Counter = field(default_factory=Counter)
    duplicate_runs: int = 0
    old_window_reruns: int = 0
    """Runs of a window older than the window run just before it."""
    resumes_checked: int = 0
    """Runs of a window holding a checkpoint whose requests were checked."""
    resumes_narrowed: int = 0
    """Of those, runs that resumed through a narrowed window (the token had expired)."""
    resume_violations: int = 0
    differences: int = 0
    duplicates: int = 0
    stale_checkpoints: int = 0
    unsettled: int = 0
    failures: list[str] = field(default_factory=list)
    distinct_problems: set[str] = field(default_factory=set)
    """Problems as judged, once each: a difference left standing is found again by every later
    judgement."""


@dataclass(frozen=True)
class Checkpoint:
    """A window's committed progress, as an interrupted run left it."""

    pages: int
    last_updated_at: datetime | None
    last_id: str | None
    run_id: str

    @property
    def last_key(self) -> tuple[int, str] | None:
        """The last committed item's (updated_at in microseconds since the epoch, id): the
        stand-in's keyset order."""
        if self.last_updated_at is None or self.last_id is None:
            return None
        return (self.last_updated_at - EPOCH) // timedelta(microseconds=1), self.last_id


def pool_windows(today: date, size: int) -> list[str]:
    """``size`` consecutive past days, oldest first, a week before ``today`` (Moscow)."""
    last = today - timedelta(days=7)
    return [(last - timedelta(days=size - 1 - n)).isoformat() for n in range(size)]


class SyncSuite:
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

    def _read_records(self) -> None:
        start, end = self.bounds[self.windows[0]][0], self.bounds[self.windows[-1]][1]
        self.records = {item["id"]: item for item in self.standin.erp_window_state(start, end)}

    def _change_source(self, rng: random.Random, notes: list[str]) -> None:
        """1-6 changes, or a batch stamped with one instant; every window is due again."""
        checkpoints = self._checkpoints()
        made: list[str] = []
        if rng.random() < 0.2:
            made += self._batch(rng, checkpoints)
        else:
            for _ in range(rng.randint(1, 6)):
                made += self._one_change(rng, checkpoints)
        if made:
            for kind in made:
                self.totals.source_changes[kind] += 1
            self.synced = dict.fromkeys(self.windows, False)
            notes.append(f"changes[{','.join(sorted(set(made)))}]x{len(made)}")

    def _one_change(self, rng: random.Random, checkpoints: dict[str, Checkpoint]) -> list[str]:
        deleted = [i for i, item in self.records.items() if item["deleted"]]
        live = [i for i, item in self.records.items() if not item["deleted"]]
        kind = rng.choices(("update", "late", "tombstone", "restore"), (4, 3, 2, 1))[0]
        if kind == "restore" and not deleted:
            kind = "update"
        for _ in range(20):
            record = self.records[rng.choice(deleted if kind == "restore" else live)]
            current = _instant(record["updated_at"])
            here = self._window_of(current)
            later = self.windows[self.windows.index(here) + 1:]
            target = (rng.choice(later) if kind == "late" and later
                      else rng.choice([here, *later]) if kind != "update" else here)
            moment = self._moment(rng, target, current, checkpoints)
            if moment is None:
                continue
            op = {"tombstone": "delete", "restore": "restore"}.get(kind, "update")
            change = {"op": op, "id": record["id"], "updated_at": moment}
            if op != "delete":
                change.update(_random_fields(rng))
            self._apply([change])
            return [kind if op != "update" else "late" if here != target else "update"]
        return []

    def _batch(self, rng: random.Random, checkpoints: dict[str, Checkpoint]) -> list[str]:
        """A nightly import: several live records of earlier windows stamped with one instant."""
        target = rng.choice(self.windows)
        window_start = self.bounds[target][0]
        candidates = [item for item in self.records.values() if not item["deleted"]
                      and _instant(item["updated_at"]) < window_start]
        if len(candidates) < 2:
            return []
        moment = self._moment(rng, target, window_start - timedelta(microseconds=1), checkpoints)
        if moment is None:
            return []
        chosen = rng.sample(candidates, min(len(candidates), rng.randint(3, 12)))
        self._apply([{"op": "update", "id": item["id"], "updated_at": moment,
                      **_random_fields(rng)} for item in chosen])
        return ["batch"] * len(chosen)

    def _moment(self, rng: random.Random, window: str, after: datetime,
                checkpoints: dict[str, Checkpoint]) -> str | None:
        """A random instant of ``window`` later than ``after`` and than the last item the
        window's checkpoint committed, written with a random offset; None if there is none."""
        start, end = self.bounds[window]
        low = max(start, after + timedelta(microseconds=1))
        checkpoint = checkpoints.get(window)
        if checkpoint and checkpoint.last_updated_at:
            low = max(low, checkpoint.last_updated_at + timedelta(microseconds=1))
        if window in self.read_up_to:
            low = max(low, self.read_up_to[window] + timedelta(microseconds=1))
        span = int((end - low) / timedelta(microseconds=1))
        if span <= 1:
            return None
        moment = low + timedelta(microseconds=rng.randrange(span))
        return moment.astimezone(timezone(rng.choice(OFFSETS))).isoformat(
            timespec="microseconds")

    def _apply(self, changes: list[dict]) -> None:
        for item in self.standin.change_erp_work_orders(changes):
            self.records[item["id"]] = item

    def _window_of(self, moment: datetime) -> str:
        return moment.astimezone(MOSCOW).date().isoformat()

    def _pages(self, window: str) -> int:
        start, end = self.bounds[window]
        count = sum(start <= _instant(item["updated_at"]) < end
                    for item in self.records.values())
        return max(1, -(-count // PAGE_SIZE))

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
            instants += [_instant(item["updated_at"]) for item in page.get("items", [])]
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

    def _check_resume(self, window: str, checkpoint: Checkpoint, started: float,
                      ended: float) -> str | None:
        """The run's requests for the window fetched nothing the checkpoint's k pages hold: a
        request with a token continues after an item at or past the last committed one (and,
        for the whole window's query, asks for a page after k); one without a token starts
        at or after the last committed item (the window narrowed after an expired token)."""
        self.totals.resumes_checked += 1
        start, end = self.bounds[window]
        last = checkpoint.last_key
        narrowed = False
        for request in self.standin.requests("erp"):
            query = parse_qs(request["query"])
            if not started <= request["at"] <= ended or (
                    _instant(query["updated_to"][0]) != end):
                continue
            asked_from = _instant(query["updated_from"][0])
            if query.get("page_token"):
                cursor = _token_cursor(query["page_token"][0])
                if last is not None and cursor is not None and cursor < last:
                    return (f"a re-run after {checkpoint.pages} committed pages continued after "
                            f"{cursor}, before the last committed item {last}")
                if (asked_from == start and request["page"] is not None
                        and request["page"] <= checkpoint.pages):
                    return (f"a re-run after {checkpoint.pages} committed pages fetched page "
                            f"{request['page']} of the window again")
            elif checkpoint.last_updated_at is None or asked_from < checkpoint.last_updated_at:
                return (f"a re-run after {checkpoint.pages} committed pages asked for the window "
                        f"from {asked_from.isoformat()} again")
            else:
                narrowed = True
        self.totals.resumes_narrowed += narrowed
        return None

    def _judge(self) -> list[str]:
        problems: list[str] = []
        start, end = self.bounds[self.windows[0]][0], self.bounds[self.windows[-1]][1]
        oracle = {item["id"]: item for item in self.standin.erp_window_state(start, end)}
        with psycopg.connect(self.ws.dsn) as connection:
            rows = connection.execute(f"SELECT {ROW_COLUMNS} FROM {TABLE}").fetchall()
            checkpoints = connection.execute(
                "SELECT partition_key FROM sync_progress WHERE source = %s",
                (SOURCE,)).fetchall()
            quarantined = connection.execute(
                "SELECT count(*) FROM quarantined_rows WHERE source = %s",
                (SOURCE,)).fetchone()[0]
        table: dict[str, tuple] = {}
        duplicated = 0
        for row in rows:
            duplicated += row[0] in table
            table[row[0]] = row
        missing = sorted(set(oracle) - set(table))
        extra = sorted(set(table) - set(oracle))
        different = [i for i in sorted(set(oracle) & set(table))
                     if _expected_row(oracle[i]) != _actual_row(table[i])]
        if missing:
            problems.append(f"{len(missing)} records missing, e.g. {missing[:3]}")
        if extra:
            problems.append(f"{len(extra)} records not in the source's pool, e.g. {extra[:3]}")
        for record in different[:3]:
            problems.append(f"{record}: expected {_expected_row(oracle[record])}, "
                            f"got {_actual_row(table[record])}")
        if len(different) > 3:
            problems.append(f"... {len(different)} records differ")
        self.totals.differences += len(missing) + len(extra) + len(different)
        if duplicated:
            self.totals.duplicates += duplicated
            problems.append(f"{duplicated} ids held twice")
        if checkpoints:
            self.totals.stale_checkpoints += len(checkpoints)
            problems.append(f"checkpoints left for finished windows {sorted(checkpoints)}")
        if quarantined:
            self.totals.differences += quarantined
            problems.append(f"{quarantined} rows quarantined from a clean source")
        return problems

    def _checkpoints(self) -> dict[str, Checkpoint]:
        with psycopg.connect(self.ws.dsn, autocommit=True) as connection:
            rows = connection.execute(
                "SELECT partition_key, pages_committed, resume_after, run_id FROM sync_progress "
                "WHERE source = %s", (SOURCE,)).fetchall()
        found = {}
        for window, pages, resume_after, run_id in rows:
            after = json.loads(resume_after) if resume_after else {}
            last = _instant(after["updated_at"]) if after.get("updated_at") else None
            found[window] = Checkpoint(pages, last, after.get("id"), run_id)
        return found

    def _fail(self, message: str) -> None:
        self.totals.failures.append(message)
        self.log(f"  FAILURE: {message}")


def _random_fields(rng: random.Random) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    if rng.random() < 0.7:
        fields["status"] = rng.choice(STATUSES)
    if rng.random() < 0.7:
        fields["amount"] = f"{Decimal(rng.randint(1, 5_000_000_000)) / 100:.2f}"
    if rng.random() < 0.3:
        fields["title"] = rng.choice(("Пролёт №3: «доработка»", "Опора 7; ревизия", 'Шов "А"'))
    if rng.random() < 0.2:
        fields["planned_finish"] = rng.choice((None, "2026-12-24"))
    return fields


def _instant(text: str) -> datetime:
    return datetime.fromisoformat(text)


def _token_cursor(token: str) -> tuple[int, str] | None:
    """The (updated_at in microseconds, id) after which a stand-in page token continues: its
    tokens are their keyset cursor as JSON followed by a MAC (:mod:`mostovik_pipelines.standin.
    erp`); None for a token that is not one."""
    try:
        signed = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
        cursor_us, cursor_id = json.loads(signed[:-TOKEN_MAC_BYTES])["c"]
    except (ValueError, KeyError, TypeError):
        return None
    return int(cursor_us), str(cursor_id)


def _expected_row(item: dict) -> tuple:
    updated_at = _instant(item["updated_at"])
    return (item["object_code"], item["title"], item["status"],
            item["planned_start"] and date.fromisoformat(item["planned_start"]),
            item["planned_finish"] and date.fromisoformat(item["planned_finish"]),
            Decimal(item["amount"]), updated_at.astimezone(UTC), item["version"],
            item["deleted"], updated_at.astimezone(MOSCOW).date())


def _actual_row(row: tuple) -> tuple:
    (_, object_code, title, status, planned_start, planned_finish, amount, updated_at, version,
     deleted, window_date) = row
    return (object_code, title, status, planned_start, planned_finish, Decimal(amount),
            updated_at.astimezone(UTC), version, deleted, window_date)


def sync_summary(totals: SyncTotals, replay: str, seconds: float) -> str:
    return "\n".join([
        "",
        "sync chaos summary (erp_work_orders)",
        f"  scenarios run:        {totals.scenarios}",
        f"  runs started:         {sum(totals.runs.values())} ({counts_text(totals.runs)}); "
        f"settling runs {totals.settle_runs}",
        f"  kills delivered:      {sum(totals.kills.values())} ({counts_text(totals.kills)}); "
        f"of dagster job execute processes: {totals.cli_kills}",
        f"  faults injected:      {sum(totals.faults.values())} ({counts_text(totals.faults)})",
        f"  source changes:       {sum(totals.source_changes.values())} "
        f"({counts_text(totals.source_changes)})",
        f"  duplicate runs:       {totals.duplicate_runs}",
        f"  old windows re-run after newer ones: {totals.old_window_reruns}",
        f"  resumes checked:      {totals.resumes_checked} (narrowed after an expired token: "
        f"{totals.resumes_narrowed}); violations: {totals.resume_violations}",
        f"  differences found:    {totals.differences} (distinct problems: "
        f"{len(totals.distinct_problems)})",
        f"  duplicates found:     {totals.duplicates}",
        f"  stale checkpoints:    {totals.stale_checkpoints}",
        f"  unsettled windows:    {totals.unsettled}",
        f"  failures:             {len(totals.failures)}",
        f"  wall time:            {seconds:.0f} s",
        f"  replay:               python -m mostovik_pipelines_tests.chaos.sync_scenarios "
        f"{replay}",
    ])


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


def sync_faults(totals: SyncTotals) -> Counter:
    """What a sync scenario met: source faults, kills by point, source changes, duplicate runs,
    old windows re-run after newer ones."""
    return (named("source", totals.faults) + named("kill at", totals.kills)
            + named("change", totals.source_changes)
            + Counter({"duplicate run": totals.duplicate_runs,
                       "old window re-run": totals.old_window_reruns}))


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
