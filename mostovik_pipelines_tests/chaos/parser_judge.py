"""The judge of the parser suite: every partition a scenario touched against its expected
state, and after a kill, that no dead run holds the partition.

The expected state of a partition: the rows of one clean run, on a freshly emptied database, of
the source's current state, plus the kept rows: a currency that is unreadable now keeps the row
that was stored under its key when it turned unreadable (or stays absent). The harness reads
that row from the warehouse when it changes the source, while no run is in flight; nothing can
change it afterwards, since a rejected row keeps its stored row and no payload fetched before the
change can be loaded after a later one. The quarantine must equal the clean run's.

After a scenario with a kill, the first fresh run of the partition after the last kill (a
settling re-run, else one started to check) must end and may wait for a killed run only within
its launch grace.
"""

from __future__ import annotations

from datetime import date, timedelta

import httpx
import psycopg
from dagster import DagsterRunStatus

from mostovik_pipelines_tests.chaos.environment import (
    SOURCE,
)
from mostovik_pipelines_tests.chaos.harness import (
    status_text,
)

TABLE = "cbr_daily_rates"
CHECK_TIMEOUT_SECONDS = 120.0
"""What the liveness check's run is given before it counts as blocked (and is killed): far more
than a free partition's run needs even on a loaded machine. Whether a dead run held the
partition is read from the run's own log (:meth:`ChaosEnvironment.late_waits_for`)."""
ROW_COLUMNS = ("partition_date, rate_date, cbr_id, num_code, char_code, nominal, name, "
               "value::text, unit_rate::text")
CHAR_CODE = 4
"""Position of char_code in :data:`ROW_COLUMNS`."""
ONE_DAY = timedelta(days=1)




class ParserJudge:
    """The judge, for :class:`.scenarios.ChaosSuite`: it reads the suite's environment, kept rows
    and liveness probe, and counts into its totals."""
    def _check_not_blocked(self, scope: tuple[str, ...], notes: list[str]) -> list[str]:
        """After a kill, no dead run may hold the partitions: the first fresh run of them since
        the last kill (a settling re-run, else one started here) may wait for a killed run only
        within its launch grace (a run that died before its first step counts as alive for
        10 s after its last change; one that died later, not at all), as its own log records,
        and must end. Returns the problems, a check run's outcome compared too."""
        self.totals.liveness_checks += 1
        problems = []
        if self._probe is None:
            self.totals.liveness_runs += 1
            handle = self._start_warm(scope)
            handle.wait(timeout=CHECK_TIMEOUT_SECONDS)
            self._observe(handle)
            status = self._finish(handle)
            if status == DagsterRunStatus.SUCCESS:
                problems += [f"after the liveness check, {problem}"
                             for problem in self.compare(scope)]
            elif not handle.killed:
                problems.append(f"the liveness check's run ended {status_text(status)}")
        assert self._probe is not None
        late = self.env.late_waits_for(self._probe, self._killed_runs)
        waited = self.env.waited_for_older_run(self._probe)
        notes.append(f"free{' after waiting' if waited else ''}")
        if self._probe.killed or late:
            self.totals.blocked += 1
            problems.append(f"{scope[0]} blocked: the first run after the kill "
                            f"{'waited for ' + '; '.join(late) if late else 'never ended'}")
        return problems

    # --- the judge ----------------------------------------------------------------------------

    def compare(self, partitions) -> list[str]:
        """Each partition against its expected state; the differences, counted."""
        partitions = list(partitions)
        references = self._references_of(partitions)
        dsn = self.env.postgres.dsn(self.env.database)
        problems = []
        for partition in partitions:
            expected = self._expected(partition, references[partition])
            actual = partition_state(dsn, partition)
            if actual[0] != expected[0]:
                problems.append(f"{partition}: rows differ: expected "
                                f"{_diff(expected[0], actual[0])}")
            if actual[1] != expected[1]:
                problems.append(f"{partition}: quarantine differs: expected "
                                f"{_diff(expected[1], actual[1])}")
        self.totals.differences += len(problems)
        return problems

    def _expected(self, partition: str, reference: tuple[list, list]) -> tuple[list, list]:
        """The reference's rows plus the rows kept under currencies unreadable now, and the
        reference's quarantine."""
        rows, quarantined = reference
        kept = [row for (kept_in, _), row in self.kept.items()
                if kept_in == partition and row is not None]
        return sorted([*rows, *kept], key=lambda row: row[CHAR_CODE]), quarantined

    def _report(self, number: int, notes: list[str], problems: list[str]) -> None:
        duplicates = duplicated_keys(self.env.postgres.dsn(self.env.database))
        if duplicates:
            self.totals.duplicates += duplicates
            problems.append(f"{duplicates} duplicated keys")
        if problems:
            self._fail(f"scenario {number} ({' '.join(notes)}): {'; '.join(problems)}",
                       error=False)
        if self._cli_kill_in_scenario:
            self.totals.scenarios_with_cli_kill += 1
            self._cli_kill_in_scenario = False
        self.log(f"  #{number:<4} {' '.join(notes)}{'  DIFFERENT' if problems else ''}")

    def _references_of(self, partitions: list[str]) -> dict[str, tuple[list, list]]:
        """Each partition as one clean run on an empty database makes it, for the source's
        current state (cached by the exact bytes the source now serves). Consecutive dates
        missing from the cache are loaded by one ranged run: its partitions load independently,
        exactly as single runs load them."""
        keys = {}
        for partition in partitions:
            asked = date.fromisoformat(partition)
            document = httpx.get(self.env.standin_server.cbr_url,
                                 params={"date_req": f"{asked:%d/%m/%Y}"}).content
            keys[partition] = (partition, document, self.today)
        missing = sorted(p for p, key in keys.items() if key not in self._references)
        self.totals.reference_cache_hits += len(partitions) - len(missing)
        dsn = self.env.postgres.dsn(self.env.reference_database)
        for scope in consecutive(missing):
            with psycopg.connect(dsn, autocommit=True) as connection:
                connection.execute(f"TRUNCATE {TABLE}, quarantined_rows")
            handle = self.env.start_reference_run(scope)
            handle.wait(timeout=120)
            if handle.process.exitcode != 0:
                self._fail(f"reference run of {scope[0]}..{scope[-1]} failed "
                           f"(exit {handle.process.exitcode})")
            for partition in scope:
                self._references[keys[partition]] = partition_state(dsn, partition)
        return {partition: self._references[key] for partition, key in keys.items()}


def consecutive(days: list[str]) -> list[tuple[str, ...]]:
    """Sorted dates grouped into runs of consecutive dates."""
    groups: list[list[str]] = []
    for day in days:
        if groups and date.fromisoformat(day) - date.fromisoformat(groups[-1][-1]) == ONE_DAY:
            groups[-1].append(day)
        else:
            groups.append([day])
    return [tuple(group) for group in groups]



def partition_state(dsn: str, partition: str) -> tuple[list, list]:
    with psycopg.connect(dsn) as connection:
        rows = connection.execute(
            f"SELECT {ROW_COLUMNS} FROM {TABLE} WHERE partition_date = %s ORDER BY char_code",
            (date.fromisoformat(partition),)).fetchall()
        quarantined = connection.execute(
            "SELECT row_number, raw_row, reason FROM quarantined_rows "
            "WHERE source = %s AND partition_key = %s ORDER BY row_number, id",
            (SOURCE, partition)).fetchall()
    return rows, quarantined


def stored_row(dsn: str, partition: str, code: str) -> tuple | None:
    with psycopg.connect(dsn) as connection:
        return connection.execute(
            f"SELECT {ROW_COLUMNS} FROM {TABLE} WHERE partition_date = %s AND char_code = %s",
            (date.fromisoformat(partition), code)).fetchone()


def duplicated_keys(dsn: str) -> int:
    """Natural keys held more than once: in the table (its constraint forbids them) and in the
    quarantine (a partition's rejected row is kept once, whatever the number of runs)."""
    with psycopg.connect(dsn) as connection:
        table = connection.execute(
            f"SELECT count(*) FROM (SELECT 1 FROM {TABLE} GROUP BY partition_date, char_code "
            "HAVING count(*) > 1) d").fetchone()[0]
        quarantine = connection.execute(
            "SELECT count(*) FROM (SELECT 1 FROM quarantined_rows "
            "GROUP BY source, partition_key, row_number HAVING count(*) > 1) d").fetchone()[0]
    return table + quarantine


def _diff(expected: list, actual: list) -> str:
    missing = [r for r in expected if r not in actual]
    extra = [r for r in actual if r not in expected]
    return f"{len(expected)} rows, got {len(actual)}; missing {missing[:3]}, extra {extra[:3]}"
