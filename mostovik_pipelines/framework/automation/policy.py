"""A source's catch-up policy: how far back its schedule (or sensor) looks after partitions
without an operator, when a sync's window is final, and how it backs off after failures
(:mod:`.catch_up`); and when each of its periods is due (:mod:`.deadlines`). Declared in each
source's ``source.py``."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta

from mostovik_pipelines.core.settings import setting


@dataclass(frozen=True)
class CatchUpPolicy:
    """What the source's schedule (or sensor) asks for again without an operator, so that the
    runs nobody launches by hand add up to every period's data (:mod:`..automation`)."""

    lookback: timedelta = timedelta(days=7)
    """How far back partitions are looked after: within it, a partition that is missing, was
    not available yet, failed on a transient error or (syncs) was not synced after its window
    closed is asked for again. Older ones wait for an operator's backfill."""
    settle: timedelta = timedelta(0)
    """Syncs: how long after its window closes the source may still change it (a lagging
    replica). A window is final once a sync that started after close + settle succeeded."""
    backoff: timedelta = timedelta(minutes=30)
    """After a transient failure a partition is asked for again no sooner than this, doubled
    with every further failure in a row, up to ``max_backoff``: a source down for a week costs
    a handful of runs, not one per tick."""
    max_backoff: timedelta = timedelta(days=1)
    settings_prefix: str | None = None
    """Where an operator sets the lookback and settle time (``MOSTOVIK_CBR``), when they can."""

    @classmethod
    def from_settings(cls, prefix: str, *, lookback_days: int = 7,
                      settle_minutes: int = 0) -> CatchUpPolicy:
        """The policy with the lookback and settle time an operator can set in the environment,
        ``<prefix>_LOOKBACK_DAYS`` and ``<prefix>_SETTLE_MINUTES`` (the defaults as given)."""
        return cls(
            lookback=timedelta(days=int(setting(f"{prefix}_LOOKBACK_DAYS", str(lookback_days)))),
            settle=timedelta(minutes=int(setting(f"{prefix}_SETTLE_MINUTES",
                                                 str(settle_minutes)))),
            settings_prefix=prefix)


@dataclass(frozen=True)
class PeriodDeadline:
    """When a time-partitioned source's period is due: final in the warehouse by then, else its
    ``period_deadlines`` check is red, naming it, and it is alerted as late, once
    (:mod:`.deadlines`). Declared in each time-partitioned source's ``source.py``."""

    due: Callable[[datetime, datetime], datetime]
    """The instant a period is due, from its window's start and end (timezone-aware)."""
    description: str
    """When, in an operator's words (the check's description): "tomorrow's rates by 16:30
    Moscow time on days the CBR publishes"."""
