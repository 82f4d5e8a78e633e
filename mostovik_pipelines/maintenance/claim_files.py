"""The claim files of a local (SQLite) instance's runs that a killed process left behind.

A run's claim there is a shared ``flock`` on ``<instance root>/run_claims/<run id>.lock``; its
last holder removes the file as it lets go, but a process killed with ``kill -9`` (or a lost
machine) never lets go, so its file stays, one per killed run, forever. The kernel released the
lock with the process, so a file nobody holds a lock on belongs to no live process: the prune
removes it once it is older than the grace, taking the lock exclusively first and removing the
file while it holds it, the way a last holder does (``platform/claims.py``). A live run's
file is locked by its holders and is never touched; one written within the grace (a run that is
just taking it) is left alone whatever its lock says.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from datetime import datetime
from pathlib import Path

from dagster import DagsterInstance

from mostovik_pipelines.maintenance.policy import CLAIM_FILES, Removal, RetentionPolicy
from mostovik_pipelines.platform.claims import claim_files_dir


def dead_claim_files(instance: DagsterInstance, policy: RetentionPolicy,
                     now: datetime) -> list[Removal]:
    """Claim files older than the grace that no live process holds."""
    folder = claim_files_dir(instance)
    try:
        paths = sorted(path for path in folder.iterdir() if path.suffix == ".lock")
    except (FileNotFoundError, NotADirectoryError):
        return []
    cutoff = (now - policy.grace).timestamp()
    removals = []
    for path in paths:
        try:
            stat = path.stat()
        except FileNotFoundError:
            continue
        if stat.st_mtime < cutoff and not _held(path):
            removals.append(Removal(CLAIM_FILES, str(path), stat.st_size,
                                    lambda path=path: _remove_unheld(path)))
    return removals


def _held(path: Path) -> bool:
    """Whether a live process holds the claim (the check :func:`run_claim_held` makes)."""
    with _locked_exclusively(path) as locked:
        return not locked


def _remove_unheld(path: Path) -> None:
    """Remove the file under an exclusive lock, unless a process took the claim meanwhile."""
    with _locked_exclusively(path) as locked:
        if locked:
            path.unlink(missing_ok=True)


@contextlib.contextmanager
def _locked_exclusively(path: Path):
    """Yields whether the file could be locked exclusively without waiting (a file gone
    meanwhile counts as locked: there is nothing to keep)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        yield True
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)
