"""What ``make chaos`` prints at the end: per kind of job and per fault, the scenarios that had
it and what their judges found (differences, duplicated keys, unsettled partitions or failed
runs, runs stuck unfinished). A scenario counts once under each fault it met.

Each suite keeps its own totals; :func:`tallied` reads them before and after every scenario of
a suite, so the judge's findings land under the faults that scenario had.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

MEASURES = ("scenarios", "differences", "duplicates", "unsettled", "stuck")
FINDINGS = MEASURES[1:]
ALL = "(all)"


@dataclass
class Tally:
    lines: dict[tuple[str, str], Counter] = field(default_factory=dict)
    seeds: dict[str, int] = field(default_factory=dict)

    def record(self, kind: str, faults: set[str], **found: int) -> None:
        """One scenario of ``kind`` that met ``faults`` and what its judge ``found``."""
        for fault in (ALL, *(sorted(faults) or ["none"])):
            line = self.lines.setdefault((kind, fault), Counter())
            line["scenarios"] += 1
            for measure in FINDINGS:
                line[measure] += found.get(measure, 0)

    def settle(self, kind: str, fault: str, **found: int) -> None:
        """The suite's final ``found``: what no scenario's delta holds (a final sweep's, an end
        check's) is put under ``fault``."""
        line = self.lines.setdefault((kind, ALL), Counter())
        rest = {m: found.get(m, 0) - line[m] for m in FINDINGS}
        if any(rest.values()):
            extra = self.lines.setdefault((kind, fault), Counter())
            for measure, n in rest.items():
                line[measure] += n
                extra[measure] += n

    def failed(self) -> bool:
        return any(line[measure] for (_, fault), line in self.lines.items() if fault == ALL
                   for measure in FINDINGS)

    def table(self) -> str:
        width = max([len(f"{kind} {fault}") for kind, fault in self.lines] + [20])
        header = f"  {'kind / fault':<{width}}" + "".join(f"{m:>12}" for m in MEASURES)
        rows = ["", "chaos: per kind and per fault", header]
        for kind in dict.fromkeys(kind for kind, _ in self.lines):
            faults = sorted((f for k, f in self.lines if k == kind), key=lambda f: (f != ALL, f))
            for fault in faults:
                line = self.lines[(kind, fault)]
                label = kind if fault == ALL else f"  {fault}"
                rows.append(f"  {label:<{width}}"
                            + "".join(f"{line[m]:>12}" for m in MEASURES))
        totals = Counter()
        for (_, fault), line in self.lines.items():
            if fault == ALL:
                totals.update(line)
        rows.append(f"  {'all kinds':<{width}}" + "".join(f"{totals[m]:>12}" for m in MEASURES))
        return "\n".join(rows)


def tallied(suite, kind: str, tally: Tally, faults: Callable[[object], Counter],
            findings: Callable[[object], dict[str, int]]) -> None:
    """Wrap ``suite.scenario`` so that every scenario is recorded in ``tally``: the faults it
    met (what grew in ``faults(totals)``) and what its judge found (what grew in
    ``findings(totals)``)."""
    scenario = suite.scenario

    def recorded(*args, **kwargs):
        faults_before, found_before = faults(suite.totals), findings(suite.totals)
        try:
            return scenario(*args, **kwargs)
        finally:
            met = faults(suite.totals) - faults_before
            found = findings(suite.totals)
            tally.record(kind, set(met), **{m: found[m] - found_before.get(m, 0)
                                            for m in found})

    suite.scenario = recorded


def named(prefix: str, counter: Counter) -> Counter:
    """``counter``'s keys as faults: ``"<prefix> <key>"``."""
    return Counter({f"{prefix} {key}": n for key, n in counter.items()})


def counts_text(counter: Counter) -> str:
    """``counter`` as a summary line prints it: ``key n, ...``, sorted."""
    return ", ".join(f"{key} {n}" for key, n in sorted(counter.items())) or "none"
