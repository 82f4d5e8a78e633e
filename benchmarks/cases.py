"""One measured load, run in a process of its own so that its peak memory is its own.

``python -m benchmarks.cases CASE '{"url": ..., "frame": ..., ...}'`` reads the prepared frame,
opens its connection, then times the load from the DataFrame in memory to the commit and prints
one JSON line: seconds, rows, counts (ours), the RSS before the load and the process's peak RSS.
``generate`` writes the frames the other cases read.
"""

from __future__ import annotations

import io
import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.measure import serve_cases


def _read_frame(path: str):
    with open(path, "rb") as handle:
        return pickle.load(handle)


def generate(args: dict[str, Any]) -> dict[str, Any]:
    from benchmarks.data import changed_frame, partition_frame

    frame = partition_frame(args["rows"])
    out = Path(args["dir"])
    for name, value in (("base", frame), ("changed", changed_frame(frame))):
        with open(out / f"{name}.pickle", "wb") as handle:
            pickle.dump(value, handle, protocol=5)
    return {"rows": len(frame)}


def reference(args: dict[str, Any]) -> Callable[[], dict[str, Any]]:
    """Plain ``COPY``: into an empty table without indexes, serialised by Arrow's CSV writer (the
    issue's reference) or (``binary``) in PostgreSQL's binary format encoded by pgpq, the
    fastest way available; or (``keyed``) binary into an empty table shaped like ours (natural
    key index, bookkeeping from its column defaults), in key order, the floor of any loader of
    our table."""
    import pgpq
    import psycopg
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.csv as pa_csv

    from mostovik_pipelines.warehouse.schema import RUN_ID_SETTING

    frame = _read_frame(args["frame"])
    keyed, binary = args.get("keyed", False), args.get("binary", False) or args.get("keyed")
    table_name = ("bench_reference_keyed" if keyed
                  else "bench_reference_binary" if binary else "bench_reference")
    connection = psycopg.connect(args["dsn"])

    def run() -> dict[str, Any]:
        rows = pa.Table.from_pandas(frame, preserve_index=False)
        order = None
        if keyed:
            connection.execute("SELECT set_config(%s, 'run-bench', true)", (RUN_ID_SETTING,))
            order = pc.sort_indices(rows.select(["external_id"]), [("external_id", "ascending")])
        if binary:
            rows = rows.set_column(rows.column_names.index("version"), "version",
                                   rows.column("version").cast(pa.int32()))
        form = "binary" if binary else "csv"
        with connection.cursor().copy(
            f"COPY {table_name} ({', '.join(rows.column_names)}) FROM STDIN (FORMAT {form})"
        ) as copy:
            encoder = pgpq.ArrowToPostgresBinaryEncoder(rows.schema) if binary else None
            if encoder:
                copy.write(encoder.write_header())
            for start in range(0, len(frame), 50_000):
                chunk = (rows.slice(start, 50_000) if order is None
                         else rows.take(order.slice(start, 50_000)))
                if encoder:
                    for batch in chunk.to_batches():
                        copy.write(encoder.write_batch(batch))
                    continue
                buffer = io.BytesIO()
                pa_csv.write_csv(chunk, buffer, pa_csv.WriteOptions(include_header=False))
                copy.write(buffer.getbuffer())
            if encoder:
                copy.write(encoder.finish())
        connection.commit()
        return {"rows": len(frame)}

    return run


def ours(args: dict[str, Any]) -> Callable[[], dict[str, Any]]:
    """``load_partition`` in the given mode."""
    from sqlalchemy import create_engine, text

    from benchmarks.data import PARTITION_KEY, TARGETS
    from mostovik_pipelines.framework.load.partition import load_partition

    frame = _read_frame(args["frame"])
    engine = create_engine(args["url"])
    with engine.connect() as connection:
        connection.execute(text("SELECT 1"))

    def run() -> dict[str, Any]:
        counts = load_partition(engine, TARGETS[args["mode"]], frame, PARTITION_KEY,
                                args["run_id"])
        return {"rows": len(frame), "counts": counts.as_dict()}

    return run


def to_sql(args: dict[str, Any]) -> Callable[[], dict[str, Any]]:
    """What a user would write first: ``DataFrame.to_sql(method="multi")``, in chunks that keep
    rows x columns under psycopg's 65,535 bind parameters."""
    from sqlalchemy import create_engine, text

    from benchmarks.data import PLAIN_TABLE

    frame = _read_frame(args["frame"]).head(args["rows"])
    types = {column.name: column.type for column in PLAIN_TABLE.columns}
    engine = create_engine(args["url"])
    with engine.connect() as connection:
        connection.execute(text("SELECT 1"))

    def run() -> dict[str, Any]:
        frame.to_sql("bench_to_sql", engine, if_exists="append", index=False, method="multi",
                     chunksize=65_535 // len(frame.columns), dtype=types)
        return {"rows": len(frame)}

    return run


def dlt_merge(args: dict[str, Any]) -> Callable[[], dict[str, Any]]:
    """dlt's merge into PostgreSQL: primary key set, CSV loader files, the frame as the data."""
    os.environ.setdefault("RUNTIME__DLTHUB_TELEMETRY", "false")
    import dlt

    frame = _read_frame(args["frame"])
    pipeline = dlt.pipeline(
        pipeline_name="bench_dlt", pipelines_dir=args["pipelines_dir"],
        destination=dlt.destinations.postgres(credentials=args["url"]),
        dataset_name="dlt_bench",
    )

    def run() -> dict[str, Any]:
        info = pipeline.run(frame, table_name="bench_dlt", write_disposition="merge",
                            primary_key="external_id", loader_file_format="csv")
        info.raise_on_failed_jobs()
        return {"rows": len(frame)}

    return run


CASES: dict[str, Callable[[dict[str, Any]], Callable[[], dict[str, Any]]]] = {
    "reference": reference, "ours": ours, "to_sql": to_sql, "dlt": dlt_merge,
}


if __name__ == "__main__":
    serve_cases(CASES, generate)
