"""A re-load compares what is stored with what was sent, row for row: every kind of difference
counted where it belongs, keys and floats that are stored otherwise than sent, and a database
that does not store UTF-8."""

from __future__ import annotations

import uuid
from datetime import date

import pandas as pd
import psycopg
import pytest
from sqlalchemy import CHAR, REAL, Column, Date, Float, Integer, MetaData, String

from mostovik_pipelines.core.load_target import LoadMode, LoadTarget
from mostovik_pipelines.framework.load.ledger import forget_digests
from mostovik_pipelines.framework.load.partition import load_partition
from mostovik_pipelines.resources.warehouse import warehouse_engine
from mostovik_pipelines.warehouse import migrate
from mostovik_pipelines.warehouse.schema import warehouse_table
from mostovik_pipelines_tests.support.warehouse import create_tables, table_rows

DAY = date(2026, 11, 5)


regional_metadata = MetaData()
regional = warehouse_table(
    "test_regional",
    Column("region", String(16), nullable=False),
    Column("n", Integer, nullable=False),
    Column("day", Date, nullable=False),
    Column("version", Integer, nullable=False),
    Column("note", String(32), nullable=True),
    natural_key=("day", "region", "n"),
    in_metadata=regional_metadata,
)


def regional_frame(keys: list[tuple[str, int]], version: int = 1, note: str = "x"
                   ) -> pd.DataFrame:
    return pd.DataFrame({
        "region": pd.array([r for r, _ in keys], dtype="str"),
        "n": [n for _, n in keys],
        "day": [DAY] * len(keys),
        "version": [version] * len(keys),
        "note": pd.array([f"{note}{n}" for _, n in keys], dtype="str"),
    })


@pytest.mark.parametrize("mode", [LoadMode.REPLACE_PARTITION, LoadMode.MERGE_BY_VERSION])
def test_a_reload_with_every_kind_of_difference_compares_row_for_row(pg_warehouse_url, mode):
    """Rows removed, changed and added among keys of a text and a number ("é" after "z" in
    byte order, numbers as numbers), sent in no order: every row is counted where it belongs."""
    create_tables(pg_warehouse_url, regional_metadata)
    target = LoadTarget(regional, ("day", "region", "n"), "day", mode,
                        "version" if mode is LoadMode.MERGE_BY_VERSION else None)
    warehouse = warehouse_engine(pg_warehouse_url)
    regions = ["a", "Z", "z", "é", "ä", "a b"]
    first_keys = [(r, n) for r in regions for n in range(0, 60, 2)]
    assert load_partition(warehouse, target, regional_frame(first_keys), DAY.isoformat(),
                          "run-1").inserted == len(first_keys)

    removed = set(first_keys[::17])
    added = [(r, n) for r in [*regions, "0", "ÿ"] for n in (1, 59, 100)]
    changed = set(first_keys[5::13]) - removed
    kept = [k for k in first_keys if k not in removed]
    frame = pd.concat([regional_frame([k for k in kept if k not in changed]),
                       regional_frame(sorted(changed), version=2, note="changed"),
                       regional_frame(added)]).sample(frac=1, random_state=3)
    counts = load_partition(warehouse, target, frame, DAY.isoformat(), "run-2")

    deleted = len(removed) if mode is LoadMode.REPLACE_PARTITION else 0
    assert counts.as_dict() == {"inserted": len(added), "updated": len(changed),
                                "unchanged": len(kept) - len(changed), "deleted": deleted}
    stored = {(r["region"], r["n"]): r["note"] for r in table_rows(pg_warehouse_url, regional)}
    expected = {k: f"x{k[1]}" for k in [*kept, *added]} | {k: f"changed{k[1]}" for k in changed}
    if mode is LoadMode.MERGE_BY_VERSION:
        expected |= {k: f"x{k[1]}" for k in removed}
    assert stored == expected


awkward_metadata = MetaData()
awkward = warehouse_table(
    "test_awkward",
    Column("code", String(8), nullable=False),
    Column("padded", CHAR(3), nullable=False),
    Column("day", Date, nullable=False),
    Column("ratio", Float, nullable=True),
    Column("small", REAL, nullable=True),
    natural_key=("code", "padded"),
    in_metadata=awkward_metadata,
)
AWKWARD = LoadTarget(awkward, ("code", "padded"), "day", LoadMode.REPLACE_PARTITION)


def awkward_frame(ratio: float = 0.1) -> pd.DataFrame:
    """Values stored differently from how they were sent unless handled: a blank-padded
    CHAR(3), Cyrillic; a float32 ratio and a single-precision column."""
    codes = ["\ufeffA", "ё", "я", "a"]
    return pd.DataFrame({
        "code": pd.array(codes, dtype="str"),
        "padded": pd.array(["ab", "abc", "x", "ab"], dtype="str"),
        "day": [DAY] * 4,
        "ratio": pd.array([ratio, 0.5, None, 2.0], dtype="Float32"),
        "small": [0.25, 1.5, None, 3.0],
    })


def load_comparing_rows(url: str, target: LoadTarget, frame: pd.DataFrame, run_id: str):
    """A re-load that compares the stored rows (the digest of the last load forgotten)."""
    engine = warehouse_engine(url)
    with engine.begin() as connection:
        forget_digests(connection)
    return load_partition(engine, target, frame, DAY.isoformat(), run_id)


def test_awkward_keys_and_floats_compare_as_they_were_sent(pg_warehouse_url):
    create_tables(pg_warehouse_url, awkward_metadata)
    first = load_partition(warehouse_engine(pg_warehouse_url), AWKWARD, awkward_frame(),
                           DAY.isoformat(), "run-1")
    assert first.inserted == 4
    assert load_comparing_rows(pg_warehouse_url, AWKWARD, awkward_frame(), "run-2").as_dict() == {
        "inserted": 0, "updated": 0, "unchanged": 4, "deleted": 0}
    changed = load_comparing_rows(pg_warehouse_url, AWKWARD, awkward_frame(ratio=0.2),
                                  "run-3")
    assert changed.as_dict() == {"inserted": 0, "updated": 1, "unchanged": 3, "deleted": 0}
    stored = {(r["code"], r["padded"].rstrip()): (r["ratio"], r["small"])
              for r in table_rows(pg_warehouse_url, awkward)}
    assert stored == {("\ufeffA", "ab"): (0.2, 0.25), ("ё", "abc"): (0.5, 1.5),
                      ("я", "x"): (None, None), ("a", "ab"): (2.0, 3.0)}


def test_a_database_that_does_not_store_utf8_loads_and_compares_correctly(postgres):
    """Windows-1251, as an old Russian back-office database may be: text arrives as UTF-8 and
    is stored converted; its byte order ("ё" before "я") is not UTF-8's ("я" before "ё"), and
    the SQL compares what is stored with what was sent."""
    name = f"wh1251_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(postgres.dsn(), autocommit=True) as admin:
        admin.execute(f"CREATE DATABASE {name} TEMPLATE template0 ENCODING 'WIN1251' "
                      "LC_COLLATE 'C' LC_CTYPE 'C'")
    url = postgres.url(name)
    try:
        migrate.upgrade(url)
        create_tables(url, regional_metadata)
        target = LoadTarget(regional, ("day", "region", "n"), "day", LoadMode.REPLACE_PARTITION)
        keys = [("a", 1), ("ё", 1), ("я", 1), ("я", 2)]
        engine = warehouse_engine(url)
        load_partition(engine, target, regional_frame(keys), DAY.isoformat(), "run-1")
        counts = load_comparing_rows(url, target, regional_frame(keys, note="y"), "run-2")
        assert counts.as_dict() == {"inserted": 0, "updated": 4, "unchanged": 0, "deleted": 0}
        assert {(r["region"], r["n"], r["note"]) for r in table_rows(url, regional)} == {
            (r, n, f"y{n}") for r, n in keys}
    finally:
        warehouse_engine(url).dispose()
        with psycopg.connect(postgres.dsn(), autocommit=True) as admin:
            admin.execute(f"DROP DATABASE {name} WITH (FORCE)")
