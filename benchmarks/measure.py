"""What the benchmark sections share: running a case in its own process, medians, figures."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MB = 1024 * 1024


def run_case(name: str, args: dict[str, Any]) -> dict[str, Any]:
    """Run ``benchmarks.cases`` in a fresh process; its JSON line as a dict."""
    completed = subprocess.run(
        [sys.executable, "-m", "benchmarks.cases", name, json.dumps(args)],
        cwd=ROOT, capture_output=True, text=True, check=False,
    )
    if completed.returncode != 0:
        raise RuntimeError(f"case {name} failed:\n{completed.stderr[-4000:]}")
    return json.loads(completed.stdout.strip().splitlines()[-1])


def run_command(command: list[str], env: dict[str, str]) -> float:
    """Wall time of a command, which must succeed."""
    started = time.perf_counter()
    completed = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                               check=False)
    seconds = time.perf_counter() - started
    if completed.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{completed.stdout[-3000:]}\n"
                           f"{completed.stderr[-3000:]}")
    return seconds


@dataclass
class Figure:
    """Repeated measurements of one case."""

    label: str
    seconds: list[float] = field(default_factory=list)
    rows: int = 0
    rss_before: list[int] = field(default_factory=list)
    peak_rss: list[int] = field(default_factory=list)
    counts: dict[str, int] | None = None
    written: dict[str, int] | None = None
    note: str = ""

    def add(self, result: dict[str, Any]) -> None:
        self.seconds.append(result["seconds"])
        self.rows = result["rows"]
        self.rss_before.append(result["rss_before"])
        self.peak_rss.append(result["peak_rss"])
        self.counts = result.get("counts", self.counts)

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    @property
    def rows_per_second(self) -> float:
        return self.rows / self.median

    @property
    def peak_mb(self) -> float:
        return max(self.peak_rss) / MB

    @property
    def own_mb(self) -> float:
        """Peak RSS above the process as it was just before the load (imports and frame)."""
        return max(p - b for p, b in zip(self.peak_rss, self.rss_before, strict=True)) / MB
