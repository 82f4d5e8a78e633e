"""The ``outages`` suite of ``make chaos``: the test cases whose outage lasts the promised bound
(60 s) or past a budget (over 90 s), marked ``long_outage``, run by pytest as they are written.

``make test`` leaves them out (``-m "not long_outage"``) to stay a quick gate and keeps shorter
literal outages (the run storage away 20 s as an instance starts, the platform chaos's 3-12 s
outages and its object store's 60 s); every ``make chaos`` runs these, as its default suites
include this one (pinned by ``test_chaos_harness.py``)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

MARKER = "long_outage"
TESTS = Path(__file__).resolve().parents[1]


@dataclass
class OutageCasesTotals:
    failures: list[str] = field(default_factory=list)


def run_outage_cases(log: Callable[[str], None] = print, workers: int = 2) -> OutageCasesTotals:
    """Runs the ``long_outage`` tests (pytest over ``workers`` processes, whole modules each);
    a failed or missing case is a failure of the suite."""
    command = [sys.executable, "-m", "pytest", "-m", MARKER, "-p", "no:cacheprovider",
               "-n", str(workers), "--dist", "loadfile", "-q", str(TESTS)]
    log(f"chaos: {' '.join(command[1:])}")
    finished = subprocess.run(command, cwd=TESTS.parent, text=True, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT)
    for line in finished.stdout.splitlines()[-30:]:
        log(f"  {line}")
    totals = OutageCasesTotals()
    if finished.returncode != 0:
        totals.failures.append(f"pytest -m {MARKER} exited {finished.returncode}")
    return totals
