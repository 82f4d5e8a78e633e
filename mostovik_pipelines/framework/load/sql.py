"""SQL of the partition load, one statement per step, named for what it does.

All statements run inside the load transaction of :func:`.partition.load_partition` (whose
docstring says when each runs and why), most against a temporary stage table that holds what
the source sent for the partition. Identifiers come from table definitions in code and are
quoted by the dialect; values are always bound.
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy import Dialect, Table


def _q(dialect: Dialect, name: str) -> str:
    return dialect.identifier_preparer.quote(name)


def _key_match(dialect: Dialect, target: str, stage: str, natural_key: Sequence[str]) -> str:
    return " AND ".join(
        f"{target}.{_q(dialect, k)} = {stage}.{_q(dialect, k)}" for k in natural_key
    )


def _any_column_differs(dialect: Dialect, target: str, stage: str, columns: Sequence[str]) -> str:
    return " OR ".join(
        f"{target}.{_q(dialect, c)} IS DISTINCT FROM {stage}.{_q(dialect, c)}" for c in columns
    )


def update_changed_rows(
    dialect: Dialect, table: Table, stage: Table, natural_key: Sequence[str],
    data_columns: Sequence[str], version_column: str | None = None,
) -> str:
    """Rewrite only the rows whose data differ from the stage; identical rows are not touched
    (no new row versions, no bookkeeping change). With ``version_column``, a stage row only
    wins when its version is newer, so an old window re-run never overwrites a newer record."""
    t, s = _q(dialect, table.name), _q(dialect, stage.name)
    compared = [c for c in data_columns if c not in natural_key]
    assignments = ", ".join(f"{_q(dialect, c)} = {s}.{_q(dialect, c)}" for c in compared)
    condition = f"({_any_column_differs(dialect, t, s, compared)})" if compared else "FALSE"
    if version_column:
        v = _q(dialect, version_column)
        condition = f"{s}.{v} > {t}.{v} AND {condition}"
    return (
        f"UPDATE {t} SET {assignments}, changed_by_run = :run_id, changed_at = :now "
        f"FROM {s} WHERE {_key_match(dialect, t, s, natural_key)} AND {condition}"
    )


def insert_new_rows(
    dialect: Dialect, table: Table, stage: Table, natural_key: Sequence[str],
    data_columns: Sequence[str],
) -> str:
    """Insert the stage rows whose natural key the table does not hold yet."""
    t, s = _q(dialect, table.name), _q(dialect, stage.name)
    columns = ", ".join(_q(dialect, c) for c in data_columns)
    selected = ", ".join(f"{s}.{_q(dialect, c)}" for c in data_columns)
    return (
        f"INSERT INTO {t} ({columns}, loaded_by_run, loaded_at, changed_by_run, changed_at) "
        f"SELECT {selected}, :run_id, :now, :run_id, :now FROM {s} "
        f"WHERE NOT EXISTS (SELECT 1 FROM {t} WHERE {_key_match(dialect, t, s, natural_key)})"
    )


def census_of_stage(
    dialect: Dialect, table: Table, stage: Table, natural_key: Sequence[str], *,
    partition_column: str | None = None, version_column: str | None = None,
    tombstone_column: str | None = None,
) -> str:
    """One pass over the stage joined with the table: ``staged`` rows, how many of their keys
    the table ``stored``; with ``partition_column`` (not part of the key) how many stored rows
    the merge would ``moving_in`` from other partitions; with ``version_column`` how many stage
    rows the table already holds ``older`` (in a newer version); with ``tombstone_column`` too,
    how many ``new_tombstones`` mark a record deleted that the table holds alive (in an older
    version) or does not hold at all. Stage keys are unique (validation keeps one row a key)."""
    t, s = _q(dialect, table.name), _q(dialect, stage.name)
    present = f"{t}.{_q(dialect, natural_key[0])} IS NOT NULL"

    def counted(condition: str, name: str) -> str:
        return f"coalesce(sum(CASE WHEN {condition} THEN 1 ELSE 0 END), 0) AS {name}"

    counts = ["count(*) AS staged", counted(present, "stored")]
    if partition_column:
        p = _q(dialect, partition_column)
        counts.append(counted(f"{present} AND {t}.{p} IS DISTINCT FROM {s}.{p}", "moving_in"))
    if version_column:
        v = _q(dialect, version_column)
        counts.append(counted(f"{t}.{v} > {s}.{v}", "older"))
        if tombstone_column:
            d = _q(dialect, tombstone_column)
            counts.append(counted(
                f"{s}.{d} AND (NOT ({present}) OR ({s}.{v} > {t}.{v} AND NOT {t}.{d}))",
                "new_tombstones"))
    return (f"SELECT {', '.join(counts)} FROM {s} "
            f"LEFT JOIN {t} ON {_key_match(dialect, t, s, natural_key)}")


def any_key_stored(dialect: Dialect, table: Table, natural_key: Sequence[str]) -> str:
    """PostgreSQL only: whether the table holds any key of the array bound as ``%s`` (a natural
    key of one column)."""
    (key,) = natural_key
    return (f"SELECT EXISTS (SELECT 1 FROM {_q(dialect, table.name)} "
            f"WHERE {_q(dialect, key)} = ANY(%s))")


def select_keys_held_elsewhere(
    dialect: Dialect, table: Table, stage: Table, natural_key: Sequence[str],
    partition_column: str,
) -> str:
    """The stage's natural keys that the table holds under another partition value, with it."""
    t, s, p = _q(dialect, table.name), _q(dialect, stage.name), _q(dialect, partition_column)
    keys = ", ".join(f"{s}.{_q(dialect, k)}" for k in natural_key)
    return (f"SELECT {keys}, {t}.{p} FROM {s} JOIN {t} ON {_key_match(dialect, t, s, natural_key)} "
            f"WHERE {t}.{p} IS DISTINCT FROM {s}.{p}")


def delete_staged_keys_held_elsewhere(
    dialect: Dialect, table: Table, stage: Table, natural_key: Sequence[str],
    partition_column: str,
) -> str:
    """Take out of the stage the rows whose keys the table holds under another partition value."""
    t, s, p = _q(dialect, table.name), _q(dialect, stage.name), _q(dialect, partition_column)
    return (f"DELETE FROM {s} WHERE EXISTS (SELECT 1 FROM {t} WHERE "
            f"{_key_match(dialect, t, s, natural_key)} AND {t}.{p} IS DISTINCT FROM {s}.{p})")


def delete_vanished_rows(
    dialect: Dialect, table: Table, stage: Table, natural_key: Sequence[str],
    partition_column: str, kept: Table | None = None,
) -> str:
    """Delete the partition's rows that the source no longer sends (replace-partition only),
    except those whose keys ``kept`` lists: the source sent them, unreadable (quarantined)."""
    t, s = _q(dialect, table.name), _q(dialect, stage.name)
    statement = (
        f"DELETE FROM {t} WHERE {t}.{_q(dialect, partition_column)} = :partition_value "
        f"AND NOT EXISTS (SELECT 1 FROM {s} WHERE {_key_match(dialect, t, s, natural_key)})"
    )
    if kept is not None:
        k = _q(dialect, kept.name)
        statement += (f" AND NOT EXISTS (SELECT 1 FROM {k} "
                      f"WHERE {_key_match(dialect, t, k, natural_key)})")
    return statement


def partition_holds_rows(dialect: Dialect, table: Table, partition_column: str) -> str:
    """Whether the partition bound as ``:partition_value`` holds any row."""
    return (f"SELECT EXISTS (SELECT 1 FROM {_q(dialect, table.name)} "
            f"WHERE {_q(dialect, partition_column)} = :partition_value)")


def copy_into(dialect: Dialect, table_name: str, columns: Sequence[str]) -> str:
    """PostgreSQL only: rows as CSV (an unquoted empty field is NULL, ``""`` the empty
    string)."""
    column_list = ", ".join(_q(dialect, c) for c in columns)
    return f"COPY {_q(dialect, table_name)} ({column_list}) FROM STDIN (FORMAT csv)"


def create_stage(dialect: Dialect, table: Table, stage: Table, columns: Sequence[str]) -> str:
    """PostgreSQL only: the stage as a temporary table with ``columns`` of ``table``, their
    exact types and collations copied, so stage and table compare without a collation
    conflict."""
    selected = ", ".join(_q(dialect, c) for c in columns)
    return (f"CREATE TEMPORARY TABLE {_q(dialect, stage.name)} AS SELECT {selected} "
            f"FROM {_q(dialect, table.name)} WITH NO DATA")


def analyze(dialect: Dialect, table_name: str) -> str:
    """PostgreSQL only: statistics of a filled stage, so the joins against it are planned for
    its real size (a temporary table has none, and autovacuum never visits it)."""
    return f"ANALYZE {_q(dialect, table_name)}"


def drop_table(dialect: Dialect, table_name: str, *, if_exists: bool = False) -> str:
    """Drop a stage (which is temporary: this session's own)."""
    return f"DROP TABLE {'IF EXISTS ' if if_exists else ''}{_q(dialect, table_name)}"
