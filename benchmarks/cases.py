"""One measured load, run in a process of its own so that its peak memory is its own.

``python -m benchmarks.cases CASE '{"url": ..., "frame": ..., ...}'`` reads the prepared frame,
opens its connection, then times the load from the DataFrame in memory to the commit and prints
one JSON line: seconds, rows, counts (ours), the RSS before the load and the process's peak RSS.
``generate`` writes the frames the other cases read.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


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
    """Plain ``COPY`` serialised by Arrow's CSV writer: into an empty table without indexes, or
    (``keyed``) into an empty table shaped like ours, in key order, bookkeeping values added."""
    import psycopg
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.csv as pa_csv

    from mostovik_pipelines.warehouse.schema import BOOKKEEPING_COLUMNS

    frame = _read_frame(args["frame"])
    keyed = args.get("keyed", False)
    table_name = "bench_reference_keyed" if keyed else "bench_reference"
    constants = dict.fromkeys(BOOKKEEPING_COLUMNS, "2026-11-05T12:00:00+00:00") if keyed else {}
    constants = {name: "run-bench" if name.endswith("_run") else value
                 for name, value in constants.items()}
    columns = [*frame.columns, *constants]
    connection = psycopg.connect(args["dsn"])

    def run() -> dict[str, Any]:
        options = pa_csv.WriteOptions(include_header=False)
        rows = pa.Table.from_pandas(frame, preserve_index=False)
        if keyed:
            rows = rows.take(pc.sort_indices(rows, [("external_id", "ascending")]))
        with connection.cursor().copy(
            f"COPY {table_name} ({', '.join(columns)}) FROM STDIN (FORMAT csv)"
        ) as copy:
            for start in range(0, len(frame), 50_000):
                chunk = rows.slice(start, 50_000)
                for name, value in constants.items():
                    chunk = chunk.append_column(name, pa.repeat(pa.scalar(value), len(chunk)))
                buffer = io.BytesIO()
                pa_csv.write_csv(chunk, buffer, options)
                copy.write(buffer.getbuffer())
        connection.commit()
        return {"rows": len(frame)}

    return run


def ours(args: dict[str, Any]) -> Callable[[], dict[str, Any]]:
    """``load_partition`` in the given mode."""
    from sqlalchemy import create_engine, text

    from benchmarks.data import PARTITION_KEY, TARGETS
    from mostovik_pipelines.etl.loading import load_partition

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


def main() -> None:
    name, args = sys.argv[1], json.loads(sys.argv[2])
    if name == "generate":
        print(json.dumps(generate(args)))
        return
    run = CASES[name](args)
    rss_before = psutil.Process().memory_info().rss
    started = time.perf_counter()
    result = run()
    seconds = time.perf_counter() - started
    print(json.dumps({**result, "seconds": seconds, "rss_before": rss_before,
                      "peak_rss": _peak_rss_bytes()}))


if __name__ == "__main__":
    main()
