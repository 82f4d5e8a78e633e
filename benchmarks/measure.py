"""What the benchmark sections share: running a case in its own process, medians, figures."""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MB = 1024 * 1024


def run_case(name: str, args: dict[str, Any], module: str = "benchmarks.cases",
             env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run case ``name`` of ``module`` (a module whose ``__main__`` is :func:`serve_cases`) in a
    fresh process, with ``env`` added to this one's; its JSON line as a dict."""
    completed = subprocess.run(
        [sys.executable, "-m", module, name, json.dumps(args)],
        cwd=ROOT, capture_output=True, text=True, check=False,
        env=None if env is None else {**os.environ, **env},
    )
    if completed.returncode != 0:
        raise RuntimeError(f"{module} case {name} failed:\n{completed.stderr[-4000:]}")
    return json.loads(completed.stdout.strip().splitlines()[-1])


def serve_cases(cases: Mapping[str, Callable[[dict[str, Any]], Callable[[], dict[str, Any]]]],
                generate: Callable[[dict[str, Any]], dict[str, Any]] | None = None) -> None:
    """The ``__main__`` of a module of cases: ``<name> <json args>`` builds the case, then times
    its run and prints what it returns with its seconds and memory (resident before the run,
    peak of the process) as one JSON line; ``generate`` makes the case's data instead."""
    import psutil

    name, args = sys.argv[1], json.loads(sys.argv[2])
    if name == "generate" and generate is not None:
        print(json.dumps(generate(args)))
        return
    run = cases[name](args)
    rss_before = psutil.Process().memory_info().rss
    started = time.perf_counter()
    result = run()
    seconds = time.perf_counter() - started
    print(json.dumps({**result, "seconds": seconds, "rss_before": rss_before,
                      "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))


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
