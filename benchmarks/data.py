"""The benchmark's partition: generated, deterministic, the shape of a typical synced entity.

Seven columns: a natural key, the partition date, an integer (the version), an exact decimal,
a float and two short texts. The frame uses pandas' Arrow-backed dtypes (what pandas 3 gives for
text, and the compact way to hold dates and exact decimals); the loader accepts object columns
of ``date`` and ``Decimal`` values too.
"""

from __future__ import annotations

from datetime import date

import numpy as np
import pandas as pd
import pyarrow as pa
from sqlalchemy import Column, Date, Float, Integer, MetaData, String, Table

from mostovik_pipelines.core.load_target import LoadMode, LoadTarget
from mostovik_pipelines.warehouse.schema import partition_loads, warehouse_table
from mostovik_pipelines.warehouse.types import ExactDecimal

PARTITION = date(2026, 11, 5)
PARTITION_KEY = PARTITION.isoformat()
STATUSES = np.array(["open", "closed", "pending", "void", "on hold"])
DECIMAL = pa.decimal128(14, 2)

bench_metadata = MetaData()


def _columns() -> list[Column]:
    return [
        Column("external_id", String(16), nullable=False),
        Column("business_date", Date, nullable=False),
        Column("version", Integer, nullable=False),
        Column("amount", ExactDecimal(), nullable=True),
        Column("score", Float, nullable=True),
        Column("status", String(16), nullable=False),
        Column("label", String(40), nullable=True),
    ]


def _target_table(name: str) -> Table:
    return warehouse_table(name, *_columns(), natural_key=("external_id",),
                           in_metadata=bench_metadata)


REPLACE_TABLE = _target_table("bench_replace")
MERGE_TABLE = _target_table("bench_merge")
# The physical reference: the same columns, no constraint, no index, no bookkeeping (one table
# for the Arrow CSV COPY, one for the binary COPY).
REFERENCE_TABLE = Table("bench_reference", bench_metadata, *_columns())
BINARY_REFERENCE_TABLE = Table("bench_reference_binary", bench_metadata, *_columns())
# Our tables' conventions write to the ledger of partition loads.
PARTITION_LOADS = partition_loads.to_metadata(bench_metadata)
# What our table itself costs: a plain binary COPY into a table shaped like ours (natural-key
# index, four bookkeeping columns filled by their defaults), rows in key order. No loader
# writing our table can beat it.
KEYED_REFERENCE_TABLE = _target_table("bench_reference_keyed")
# What a to_sql or dlt user would load into: the same columns, nothing else of ours.
PLAIN_TABLE = Table("bench_to_sql", bench_metadata, *_columns())

COLUMNS = [c.name for c in _columns()]
TARGETS = {
    "replace": LoadTarget(REPLACE_TABLE, ("external_id",), "business_date",
                          LoadMode.REPLACE_PARTITION),
    "merge": LoadTarget(MERGE_TABLE, ("external_id",), "business_date",
                        LoadMode.MERGE_BY_VERSION, "version"),
}


def partition_frame(rows: int, seed: int = 7) -> pd.DataFrame:
    """``rows`` rows of the partition, the same for the same arguments."""
    rng = np.random.default_rng(seed)
    ids = rng.permutation(rows) + 1
    cents = rng.integers(-10_000_000, 10_000_000_000, rows)
    # The decimal's unscaled integer is the amount in cents: same buffers, scale 2.
    unscaled = pa.array(cents, pa.int64()).cast(pa.decimal128(19, 0))
    amount = pa.Array.from_buffers(DECIMAL, rows, unscaled.buffers())
    return pd.DataFrame({
        "external_id": pd.array(np.char.add("E", np.char.zfill(ids.astype(str), 9)),
                                dtype="str"),
        "business_date": pd.array(pa.array(np.full(rows, PARTITION), pa.date32()),
                                  dtype=pd.ArrowDtype(pa.date32())),
        "version": rng.integers(1, 50, rows, dtype=np.int64),
        "amount": pd.array(amount, dtype=pd.ArrowDtype(DECIMAL)),
        "score": rng.random(rows) * 1000,
        "status": pd.array(STATUSES[rng.integers(0, len(STATUSES), rows)], dtype="str"),
        "label": pd.array(np.char.add("customer ", (ids % 97_331).astype(str)), dtype="str"),
    })


def changed_frame(frame: pd.DataFrame, share: float = 0.01) -> pd.DataFrame:
    """The partition with ``share`` of rows changed (a newer version) and ``share`` removed."""
    count = int(len(frame) * share)
    changed = frame.iloc[:len(frame) - count].copy()
    rows = changed.index[::max(1, len(changed) // count)][:count]
    changed.loc[rows, "version"] = changed.loc[rows, "version"] + 1
    changed.loc[rows, "score"] = changed.loc[rows, "score"] + 0.5
    changed.loc[rows, "status"] = "amended"
    return changed.reset_index(drop=True)
