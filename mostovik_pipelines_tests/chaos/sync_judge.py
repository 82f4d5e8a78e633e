"""The judge of the sync suite, once every window of the pool has been synced successfully by a run
started after the last source change: the table equals the stand-in's oracle for the union of
the pool's windows (every record whose latest version lies in a pool window, on every field,
``window_date`` the Moscow day of its ``updated_at``), no id is held twice, no quarantine, and
no ``sync_progress`` row is left. Every run of a window that had a checkpoint of k pages must
fetch no page <= k: in the stand-in's log, its requests for the whole window carry a token of a
page greater than k (or one refused as expired), and any other starts at or after the last
committed item (the window narrowed after an expired token).
"""

from __future__ import annotations

import base64
import json
from datetime import UTC, date
from decimal import Decimal
from urllib.parse import parse_qs

import psycopg

from mostovik_pipelines_tests.chaos.sync_source import (
    MOSCOW,
    SOURCE,
    TABLE,
    Checkpoint,
    instant,
)

TOKEN_MAC_BYTES = 16
"""The MAC that ends a stand-in page token."""
ROW_COLUMNS = ("id, object_code, title, status, planned_start, planned_finish, amount::text, "
               "updated_at, version, deleted, window_date")


class SyncJudge:
    """The judge, for :class:`.sync_scenarios.SyncSuite`: it reads the suite's workspace,
    stand-in and records, and counts into its totals."""
    def _check_resume(self, window: str, checkpoint: Checkpoint, started: float,
                      ended: float) -> str | None:
        """The run's requests for the window fetched nothing the checkpoint's k pages hold: a
        request with a token continues after an item at or past the last committed one (and,
        for the whole window's query, asks for a page after k); one without a token starts
        at or after the last committed item (the window narrowed after an expired token)."""
        self.totals.resumes_checked += 1
        start, end = self.bounds[window]
        last = checkpoint.last_key
        narrowed = False
        for request in self.standin.requests("erp"):
            query = parse_qs(request["query"])
            if not started <= request["at"] <= ended or (
                    instant(query["updated_to"][0]) != end):
                continue
            asked_from = instant(query["updated_from"][0])
            if query.get("page_token"):
                cursor = token_cursor(query["page_token"][0])
                if last is not None and cursor is not None and cursor < last:
                    return (f"a re-run after {checkpoint.pages} committed pages continued after "
                            f"{cursor}, before the last committed item {last}")
                if (asked_from == start and request["page"] is not None
                        and request["page"] <= checkpoint.pages):
                    return (f"a re-run after {checkpoint.pages} committed pages fetched page "
                            f"{request['page']} of the window again")
            elif checkpoint.last_updated_at is None or asked_from < checkpoint.last_updated_at:
                return (f"a re-run after {checkpoint.pages} committed pages asked for the window "
                        f"from {asked_from.isoformat()} again")
            else:
                narrowed = True
        self.totals.resumes_narrowed += narrowed
        return None

    def _judge(self) -> list[str]:
        problems: list[str] = []
        start, end = self.bounds[self.windows[0]][0], self.bounds[self.windows[-1]][1]
        oracle = {item["id"]: item for item in self.standin.erp_window_state(start, end)}
        with psycopg.connect(self.ws.dsn) as connection:
            rows = connection.execute(f"SELECT {ROW_COLUMNS} FROM {TABLE}").fetchall()
            checkpoints = connection.execute(
                "SELECT partition_key FROM sync_progress WHERE source = %s",
                (SOURCE,)).fetchall()
            quarantined = connection.execute(
                "SELECT count(*) FROM quarantined_rows WHERE source = %s",
                (SOURCE,)).fetchone()[0]
        table: dict[str, tuple] = {}
        duplicated = 0
        for row in rows:
            duplicated += row[0] in table
            table[row[0]] = row
        missing = sorted(set(oracle) - set(table))
        extra = sorted(set(table) - set(oracle))
        different = [i for i in sorted(set(oracle) & set(table))
                     if _expected_row(oracle[i]) != _actual_row(table[i])]
        if missing:
            problems.append(f"{len(missing)} records missing, e.g. {missing[:3]}")
        if extra:
            problems.append(f"{len(extra)} records not in the source's pool, e.g. {extra[:3]}")
        for record in different[:3]:
            problems.append(f"{record}: expected {_expected_row(oracle[record])}, "
                            f"got {_actual_row(table[record])}")
        if len(different) > 3:
            problems.append(f"... {len(different)} records differ")
        self.totals.differences += len(missing) + len(extra) + len(different)
        if duplicated:
            self.totals.duplicates += duplicated
            problems.append(f"{duplicated} ids held twice")
        if checkpoints:
            self.totals.stale_checkpoints += len(checkpoints)
            problems.append(f"checkpoints left for finished windows {sorted(checkpoints)}")
        if quarantined:
            self.totals.differences += quarantined
            problems.append(f"{quarantined} rows quarantined from a clean source")
        return problems

    def _checkpoints(self) -> dict[str, Checkpoint]:
        with psycopg.connect(self.ws.dsn, autocommit=True) as connection:
            rows = connection.execute(
                "SELECT partition_key, pages_committed, resume_after, run_id FROM sync_progress "
                "WHERE source = %s", (SOURCE,)).fetchall()
        found = {}
        for window, pages, resume_after, run_id in rows:
            after = json.loads(resume_after) if resume_after else {}
            last = instant(after["updated_at"]) if after.get("updated_at") else None
            found[window] = Checkpoint(pages, last, after.get("id"), run_id)
        return found


def token_cursor(token: str) -> tuple[int, str] | None:
    """The (updated_at in microseconds, id) after which a stand-in page token continues: its
    tokens are their keyset cursor as JSON followed by a MAC (:mod:`mostovik_pipelines.standin.
    erp`); None for a token that is not one."""
    try:
        signed = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
        cursor_us, cursor_id = json.loads(signed[:-TOKEN_MAC_BYTES])["c"]
    except (ValueError, KeyError, TypeError):
        return None
    return int(cursor_us), str(cursor_id)


def _expected_row(item: dict) -> tuple:
    updated_at = instant(item["updated_at"])
    return (item["object_code"], item["title"], item["status"],
            item["planned_start"] and date.fromisoformat(item["planned_start"]),
            item["planned_finish"] and date.fromisoformat(item["planned_finish"]),
            Decimal(item["amount"]), updated_at.astimezone(UTC), item["version"],
            item["deleted"], updated_at.astimezone(MOSCOW).date())


def _actual_row(row: tuple) -> tuple:
    (_, object_code, title, status, planned_start, planned_finish, amount, updated_at, version,
     deleted, window_date) = row
    return (object_code, title, status, planned_start, planned_finish, Decimal(amount),
            updated_at.astimezone(UTC), version, deleted, window_date)

