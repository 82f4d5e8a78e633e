"""What the sync suite does to the ERP source between runs, and the windows it lives in.

Changes go through the stand-in's controls with explicit timestamps inside the pool's windows:
updates within a record's window, late updates of old records into a newer window, tombstones,
restores, and nightly-import batches stamping several records with the very same instant (page
boundaries then fall inside a run of equal ``updated_at``).

A change is stamped the way a real ERP's clock would stamp it: after the last item a window's
checkpoint (:class:`Checkpoint`) has committed, if an interrupted run left one, and after the
last item of the pages the window's runs landed since its last success (a killed window's next
run takes those up instead of asking again): a change can never land before what was read
earlier, since ``updated_at`` only grows.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta, timezone
from decimal import Decimal
from typing import Any
from zoneinfo import ZoneInfo

from mostovik_pipelines.sources import erp_work_orders

MOSCOW = ZoneInfo("Europe/Moscow")
SOURCE = erp_work_orders.SOURCE.name
TABLE = erp_work_orders.erp_work_orders.name
PAGE_SIZE = erp_work_orders.PAGE_SIZE
OFFSETS = (timedelta(hours=3), timedelta(0), timedelta(hours=5), timedelta(hours=-4))
"""The offsets changes are written with: the stand-in prints ``updated_at`` as it was given."""
STATUSES = erp_work_orders.STATUSES
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


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



class SyncSourceChanges:
    """Changes of the source, for :class:`.sync_scenarios.SyncSuite`: it reads the suite's
    stand-in, windows, records and what its runs read (``read_up_to``), and counts into its
    totals."""
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
            current = instant(record["updated_at"])
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
                      and instant(item["updated_at"]) < window_start]
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
        count = sum(start <= instant(item["updated_at"]) < end
                    for item in self.records.values())
        return max(1, -(-count // PAGE_SIZE))


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


def instant(text: str) -> datetime:
    return datetime.fromisoformat(text)

