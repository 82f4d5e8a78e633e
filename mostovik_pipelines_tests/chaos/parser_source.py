"""What the parser suite does to the CBR source: changes of a date's rates (values, removed
currencies, a currency that turns unreadable) and the faults queued on the stand-in.

:class:`SourceModel` keeps what the stand-in was asked to change, so that every date stays
loadable; :class:`SourceChanges` applies a change, noting the rows that the partitions it reaches
keep under a currency that turns unreadable, and queues transient and permanent faults.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from datetime import date, timedelta
from decimal import Decimal

from mostovik_pipelines.sources.cbr_daily_rates.standin import CURRENCIES, effective_date
from mostovik_pipelines_tests.chaos.environment import (
    CLI_TIMEOUT_SECONDS,
    WARM_TIMEOUT_SECONDS,
)
from mostovik_pipelines_tests.chaos.parser_judge import stored_row

CODES = [currency[2] for currency in CURRENCIES]
TRANSIENT_FAULTS = ("503", "429", "drop", "hang")
PERMANENT_FAULTS = ("malformed", "truncate", "html", "wrong_encoding", "rename_element", "404")
RANGE_FAULTS = ("404", "malformed")
"""Permanent faults that fail a partition of a range in extract and in transform."""
UNREADABLE_VALUES = ("n/a", "-5,0", "1e9", "12,34,56", "'; DROP TABLE x;--")
MAX_REMOVED = 2
"""Removed currencies per date: with one unreadable currency among 10 the share is 10%, still
a partial load; among 9 it would be a systematic defect that no re-run can settle."""


@dataclass
class Change:
    """One revision of a date's rates, and what it does to the date's unreadable currency."""

    values: dict[str, str]
    remove: list[str]
    readable_again: str | None = None
    """The currency that was unreadable and is readable (or removed) now."""
    unreadable: str | None = None
    """The currency this change makes unreadable."""
    again: bool = False
    """The unreadable currency stays unreadable, with another unreadable value."""


class SourceModel:
    """What the harness has asked the stand-in to change, per effective date, so that the final
    state of every date stays loadable (at most one unreadable currency, at most two removed)."""

    def __init__(self) -> None:
        self.bad: dict[str, str] = {}
        self.removed: dict[str, set[str]] = {}

    def random_change(self, rng: random.Random, day: str,
                      force_unreadable: bool = False) -> Change:
        removed = self.removed.setdefault(day, set())
        present = [c for c in CODES if c not in removed]
        values = {code: random_rate(rng) for code in rng.sample(present, rng.randint(1, 3))}
        remove: list[str] = []
        if len(removed) < MAX_REMOVED and rng.random() < 0.3:
            remove = [rng.choice([c for c in present if c not in values])]
        change = Change(values, remove)
        bad = self.bad.get(day)
        if bad in values or bad in remove:
            change.readable_again = self.bad.pop(day)
            bad = None
        if bad is not None and (force_unreadable or rng.random() < 0.3):
            values[bad] = rng.choice(UNREADABLE_VALUES)
            change.again = True
        elif bad is None and (force_unreadable or rng.random() < 0.45):
            code = rng.choice([c for c in present
                               if c not in remove and c != change.readable_again])
            values[code] = rng.choice(UNREADABLE_VALUES)
            self.bad[day] = change.unreadable = code
        removed.update(remove)
        return change


def random_rate(rng: random.Random) -> str:
    amount = Decimal(rng.randint(1, 2_000_000)) / Decimal(10_000)
    return format(amount, "f").replace(".", ",")


def partition_pool(today: date, size: int) -> list[str]:
    """Past dates whose rates are their own (Tuesday to Saturday), newest first; a change of a
    date's rates then touches that partition only (and, for a Saturday, its Sunday and Monday,
    which only ranged runs load)."""
    pool, day = [], today - timedelta(days=3)
    while len(pool) < size:
        if day.weekday() not in (6, 0):
            pool.append(day.isoformat())
        day -= timedelta(days=1)
    return pool


def fault_match(partition: str) -> str:
    """The stand-in's fault match for requests of the partition."""
    return f"date_req={date.fromisoformat(partition):%d/%m/%Y}"


class SourceChanges:
    """Changes and faults of the source, for :class:`.scenarios.ChaosSuite`: it reads and writes
    the suite's ``model``, ``kept`` and ``stale`` and counts into its totals."""
    def _change_source(self, rng: random.Random, day: str, notes: list[str],
                       force_unreadable: bool = False) -> None:
        change = self.model.random_change(rng, day, force_unreadable)
        carried = self._carried(day)
        # No run is in flight: what a partition stores now under a currency that turns
        # unreadable is what its loads keep from now on.
        if change.readable_again:
            for partition in carried:
                self.kept.pop((partition, change.readable_again), None)
        if change.unreadable:
            dsn = self.env.postgres.dsn(self.env.database)
            for partition in carried:
                self.kept[(partition, change.unreadable)] = stored_row(dsn, partition,
                                                                        change.unreadable)
        unreadable = change.unreadable or (self.model.bad[day] if change.again else None)
        if unreadable:
            self.totals.unreadable_changes += 1
            self.totals.unreadable_again += change.again
            if any(self.kept.get((partition, unreadable)) is not None for partition in carried):
                self.totals.unreadable_between_fetches += 1
        self.env.standin.change_cbr_rates(day, set_values=change.values, remove=change.remove)
        self.stale.update(carried)
        self.totals.source_changes += 1
        notes.append(f"change({len(change.values)}v,{len(change.remove)}r"
                     f"{',unreadable ' + unreadable if unreadable else ''})")

    def _carried(self, day: str) -> list[str]:
        """The partitions whose rates are ``day``'s: the day's own, and a Saturday's Sunday and
        Monday."""
        published = (date.fromisoformat(self.tomorrow) if self.published_tomorrow
                     else self.today)
        first = date.fromisoformat(day)
        days = (first + timedelta(days=n) for n in range(3))
        return [d.isoformat() for d in days if effective_date(d, published) == first]

    def _queue_faults(self, rng: random.Random, partition: str, cli: bool,
                      notes: list[str]) -> None:
        timeout = CLI_TIMEOUT_SECONDS if cli else WARM_TIMEOUT_SECONDS
        for _ in range(rng.choice((0, 1, 1, 2) if not cli else (0, 1))):
            kind = (rng.choice(PERMANENT_FAULTS) if not cli and rng.random() < 0.25
                    else rng.choice(TRANSIENT_FAULTS))
            options: dict = {"match": fault_match(partition)}
            if kind in ("503", "404"):
                fault, options["status"] = "status", int(kind)
                if kind == "503" and rng.random() < 0.5:
                    options["retry_after"] = 0
            elif kind == "429":
                fault, options["status"], options["retry_after"] = "status", 429, 1
            elif kind == "hang":
                fault, options["seconds"] = "hang", timeout + 0.5
            elif kind == "rename_element":
                fault = kind
                options.update(element=rng.choice(["Value", "CharCode"]), renamed_to="Rate")
            else:
                fault = kind
            self.env.standin.fault(fault, **options)
            self.totals.faults[kind] += 1
            notes.append(kind)
