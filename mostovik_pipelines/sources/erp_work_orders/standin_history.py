"""Which version of each work order is visible, and where: seeded days generated on demand and
cached, merged day by day with the changes tests made, in the (``updated_at``, ``id``) order that
pages are cut from by binary search.

Only a record's latest version is visible: a record updated again moves to the day of its new
``updated_at`` and vanishes from the old one.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import date
from heapq import merge

import numpy as np

from mostovik_pipelines.sources.erp_work_orders.standin_records import (
    FIRST_DAY,
    LAST_DAY,
    SeededDay,
    WorkOrder,
    day_of,
    generate,
    parse_base_id,
)
from mostovik_pipelines.sources.erp_work_orders.standin_replies import ErpError

# Generated days kept in memory, counted in records (about 45 bytes each).
CACHE_RECORDS = 1_000_000


@dataclass
class _DayView:
    """A day's visible records in (updated_at, id) order: the seeded ones not changed since,
    merged with the changed records whose latest ``updated_at`` falls on the day."""

    base: SeededDay
    us: np.ndarray
    src: np.ndarray  # >= 0: a seeded record's number; < 0: -1 - its place in ``moved_in``
    moved_in: list[WorkOrder]

    def id_at(self, position: int) -> str:
        source = int(self.src[position])
        return self.base.id_of(source) if source >= 0 else self.moved_in[-1 - source].id

    def fragments(self, begin: int, end: int) -> list[str]:
        sources = self.src[begin:end]
        is_seeded = sources >= 0
        if is_seeded.all():  # most pages
            return self.base.fragments(sources)
        seeded = iter(self.base.fragments(sources[is_seeded]))
        return [next(seeded) if source >= 0 else self.moved_in[-1 - source].fragment()
                for source in sources.tolist()]

    def first_from(self, us: int) -> int:
        """The first position at or after the instant ``us``."""
        return int(np.searchsorted(self.us, us, "left"))

    def first_after(self, us: int, id_: str) -> int:
        """The first position whose (updated_at, id) comes after ``(us, id_)``: a keyset seek."""
        lo = int(np.searchsorted(self.us, us, "left"))
        hi = int(np.searchsorted(self.us, us, "right"))
        return bisect.bisect_right(range(len(self.us)), id_, lo, hi, key=self.id_at)


class CachedDay:
    """A cached day: its seeded records, and their merged view until a change touches the day."""

    def __init__(self, base: SeededDay) -> None:
        self.base = base
        self.view: _DayView | None = None


class WorkOrderHistory:
    """The work orders' visible versions, day by day, for :class:`.standin.ErpStandin`: its
    ``reset`` sets the state these read and change (``_seed``, ``_volumes``, ``_changed``,
    ``_hidden``, ``_moved_in``, ``_cache``, ``_cached_records``), and its lock is held around
    every call."""

    def _days(self, start_us: int, to_us: int) -> Iterator[date]:
        """The Moscow days of ``[start_us, to_us)`` that can hold records, in order."""
        if start_us >= to_us:
            return
        first, last = day_of(start_us), day_of(to_us - 1)
        outside = sorted(day for day in {*self._volumes, *self._moved_in}
                         if first <= day <= last and not FIRST_DAY <= day <= LAST_DAY)
        seeded = range(max(first, FIRST_DAY).toordinal(), min(last, LAST_DAY).toordinal() + 1)
        yield from merge(outside, map(date.fromordinal, seeded))

    def _volume(self, day: date) -> int:
        if day in self._volumes:
            return self._volumes[day]
        if not FIRST_DAY <= day <= LAST_DAY:
            return 0
        rng = np.random.default_rng([self._seed, day.toordinal(), 0])
        low, high = {5: (0, 10), 6: (0, 3)}.get(day.weekday(), (20, 60))
        return int(rng.integers(low, high, endpoint=True))

    def _day(self, day: date) -> CachedDay:
        entry = self._cache.get(day)
        if entry is not None:
            self._cache.move_to_end(day)
            return entry
        entry = self._cache[day] = CachedDay(generate(self._seed, day, self._volume(day)))
        self._cached_records += len(entry.base.us)
        while self._cached_records > CACHE_RECORDS and len(self._cache) > 1:
            _, old = self._cache.popitem(last=False)
            self._cached_records -= len(old.base.us)
        return entry

    def _evict(self, day: date) -> None:
        entry = self._cache.pop(day, None)
        if entry is not None:
            self._cached_records -= len(entry.base.us)

    def _view(self, day: date) -> _DayView:
        entry = self._day(day)
        if entry.view is None:
            entry.view = self._merge(entry.base)
        return entry.view

    def _merge(self, base: SeededDay) -> _DayView:
        # A stable sort keeps equal instants in record-number order, which is id order.
        order = np.argsort(base.us, kind="stable")
        hidden = self._hidden.get(base.day)
        if hidden:
            order = order[~np.isin(order, np.fromiter(hidden, np.int64, len(hidden)))]
        view = _DayView(base, base.us[order], order.astype(np.int64), [])
        moved_in = sorted(self._moved_in.get(base.day, {}).values(), key=lambda r: (r.us, r.id))
        if not moved_in:
            return view
        at = [view.first_after(record.us, record.id) for record in moved_in]
        return _DayView(base, np.insert(view.us, at, [record.us for record in moved_in]),
                        np.insert(view.src, at, -1 - np.arange(len(moved_in))), moved_in)

    def _current(self, id_: str) -> WorkOrder:
        if id_ in self._changed:
            return self._changed[id_]
        parsed = parse_base_id(id_)
        if parsed is None or parsed[1] >= self._volume(parsed[0]):
            raise ErpError(404, "not_found", f"no work order {id_}")
        return self._day(parsed[0]).base.record(parsed[1])

    def _store(self, record: WorkOrder) -> None:
        """Make ``record`` the latest version: out of its old day's view, into its new day's."""
        old = self._changed.get(record.id)
        if old is not None:
            old_day = day_of(old.us)
            del self._moved_in[old_day][record.id]
            if not self._moved_in[old_day]:
                del self._moved_in[old_day]
            self._invalidate(old_day)
        else:
            seeded = parse_base_id(record.id)
            assert seeded is not None, "only seeded records exist to be changed"
            self._hidden.setdefault(seeded[0], set()).add(seeded[1])
            self._invalidate(seeded[0])
        new_day = day_of(record.us)
        self._moved_in.setdefault(new_day, {})[record.id] = record
        self._changed[record.id] = record
        self._invalidate(new_day)

    def _invalidate(self, day: date) -> None:
        entry = self._cache.get(day)
        if entry is not None:
            entry.view = None
