"""Which XLSX reader the material delivery reports use: speed, memory and hostile workbooks.

``.venv/bin/python -m benchmarks.xlsx_readers [--rows 100000] [--repeat 3]`` writes a realistic
report (``mostovik_pipelines_tests.support.delivery_reports.benchmark_xlsx``: title rows, date
and numeric cells, strings inline as openpyxl writes them), then reads every cell value with each
reader, each reading in a fresh process (imports and the file's bytes loaded before the clock),
repetitions interleaved. It prints the median wall time, the reading process's peak RSS
(``ru_maxrss``) and its RSS just before the read. Then each raw reader meets hostile workbooks:
an entity bomb, a part inflating far past its declared size, a part that truly inflates ~1000 to
1, and a formula whose cached value is not what it computes.

The files are written by a process of its own: a child's ``ru_maxrss`` starts from its parent's,
so the parent stays small. Needs the ``bench`` extra (openpyxl writes the files, psutil).
"""

from __future__ import annotations

import argparse
import importlib
import io
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
MB = 1024 * 1024
PROBE_TIMEOUT_SECONDS = 120


def _openpyxl(content: bytes, *, data_only: bool = True) -> list[list[Any]]:
    from openpyxl import load_workbook

    book = load_workbook(io.BytesIO(content), read_only=True, data_only=data_only)
    try:
        return [list(row) for row in book.worksheets[0].iter_rows(values_only=True)]
    finally:
        book.close()


def _calamine(content: bytes) -> list[list[Any]]:
    import python_calamine

    with python_calamine.CalamineWorkbook.from_filelike(io.BytesIO(content)) as book:
        return book.get_sheet_by_index(0).to_python(skip_empty_area=False)


def _pandas(engine: str) -> Callable[[bytes], list[list[Any]]]:
    def read(content: bytes) -> list[list[Any]]:
        import pandas as pd

        frame = pd.read_excel(io.BytesIO(content), engine=engine, header=None, dtype=object)
        return frame.values.tolist()

    return read


def _ours(content: bytes) -> str:
    from mostovik_pipelines.sources.material_deliveries.report import parse_delivery_report

    parsed = parse_delivery_report(content, "bench.xlsx", "bench", max_bytes=len(content) + 1)
    first = f", first quantity {parsed.frame['quantity'].iloc[0]}" if len(parsed.frame) else ""
    return f"{len(parsed.frame)} rows, {len(parsed.rejected)} rejected{first}"


def _summary(rows: list[list[Any]]) -> str:
    """Rows and cells read, and cell G2 (the formula probe's cell)."""
    g2 = rows[1][6] if len(rows) > 1 and len(rows[1]) > 6 else None
    return f"{len(rows)} rows, {sum(len(row) for row in rows)} cells, G2 {g2!r}"


# name -> (modules imported before the clock, reader)
READERS: dict[str, tuple[tuple[str, ...], Callable[[bytes], Any]]] = {
    "openpyxl read_only values_only": (("openpyxl",), _openpyxl),
    "python-calamine to_python": (("python_calamine",), _calamine),
    "pandas.read_excel openpyxl": (("pandas", "openpyxl"), _pandas("openpyxl")),
    "pandas.read_excel calamine": (("pandas", "python_calamine"), _pandas("calamine")),
    "parse_delivery_report (calamine + parse)": (
        ("mostovik_pipelines.sources.material_deliveries.report",), _ours),
}
PROBE_READERS: dict[str, tuple[tuple[str, ...], Callable[[bytes], Any]]] = {
    "openpyxl data_only=True": (("openpyxl",), _openpyxl),
    "openpyxl default": (("openpyxl",), lambda content: _openpyxl(content, data_only=False)),
    "python-calamine": (("python_calamine",), _calamine),
    "parse_delivery_report": (("mostovik_pipelines.sources.material_deliveries.report",), _ours),
}


def _measure(reader: str, path: str) -> None:
    """Run one reader on one file and print one JSON line."""
    import psutil

    modules, read = (READERS | PROBE_READERS)[reader]
    for module in modules:
        importlib.import_module(module)
    content = Path(path).read_bytes()
    rss_before = psutil.Process().memory_info().rss
    started = time.perf_counter()
    try:
        result = read(content)
        outcome = result if isinstance(result, str) else _summary(result)
    except Exception as exc:  # a probe's verdict, reported rather than raised
        outcome = f"refused: {type(exc).__name__}: {str(exc).splitlines()[0][:110]}"
    seconds = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"seconds": seconds, "rss_before": rss_before, "peak_rss": peak,
                      "outcome": outcome}))


PROBES = {
    "entity bomb (billion laughs in the sheet)": "entity_bomb.xlsx",
    "sheet inflating to 300 MB, declared 2 kB": "lying_sizes.xlsx",
    "sheet truly inflating to 10 MB (~1000:1)": "ratio_bomb.xlsx",
    "formula =2+2 in G2 with cached value 5": "cached_formula.xlsx",
}


def _write_files(directory: str, rows: int) -> None:
    """The benchmark report and the probes, written into ``directory``."""
    from mostovik_pipelines_tests.support import delivery_reports as reports

    started = time.perf_counter()
    out = Path(directory)
    (out / "report.xlsx").write_bytes(reports.benchmark_xlsx(rows))
    print(f"written by openpyxl in {time.perf_counter() - started:.0f} s")
    (out / PROBES["entity bomb (billion laughs in the sheet)"]).write_bytes(
        reports.xlsx_with_entity_bomb())
    (out / PROBES["sheet inflating to 300 MB, declared 2 kB"]).write_bytes(
        reports.lying_zip_xlsx(300))
    (out / PROBES["sheet truly inflating to 10 MB (~1000:1)"]).write_bytes(
        reports.padded_xlsx(10))
    (out / PROBES["formula =2+2 in G2 with cached value 5"]).write_bytes(
        reports.xlsx_with_cached_formula())


def _child(*args: str, timeout: float | None = None) -> str:
    completed = subprocess.run([sys.executable, "-m", "benchmarks.xlsx_readers", *args],
                               cwd=ROOT, capture_output=True, text=True, check=False,
                               timeout=timeout)
    if completed.returncode != 0:
        raise RuntimeError(f"{args} failed:\n{completed.stderr[-3000:]}")
    return completed.stdout.strip().splitlines()[-1]


def _run(reader: str, path: Path, timeout: float | None = None) -> dict[str, Any]:
    try:
        return json.loads(_child("--measure", reader, str(path), timeout=timeout))
    except subprocess.TimeoutExpired:
        return {"seconds": timeout, "rss_before": 0, "peak_rss": 0,
                "outcome": f"still reading after {timeout:.0f} s, killed"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--measure", nargs=2, metavar=("READER", "PATH"), help=argparse.SUPPRESS)
    parser.add_argument("--write-files", metavar="DIR", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        _measure(*args.measure)
        return
    if args.write_files:
        _write_files(args.write_files, args.rows)
        return

    with tempfile.TemporaryDirectory() as scratch:
        directory = Path(scratch)
        written = _child("--write-files", scratch, "--rows", str(args.rows))
        report = directory / "report.xlsx"
        print(f"{args.rows:,}-row report, {report.stat().st_size / MB:.1f} MB, {written}\n")
        results: dict[str, list[dict[str, Any]]] = {reader: [] for reader in READERS}
        for _ in range(args.repeat):
            for reader in READERS:
                results[reader].append(_run(reader, report))
        print(f"{'reader':<42} {'median s':>9} {'min s':>7} {'peak RSS MB':>12} "
              f"{'before MB':>10}  read")
        for reader, runs in results.items():
            seconds = [run["seconds"] for run in runs]
            print(f"{reader:<42} {statistics.median(seconds):>9.2f} {min(seconds):>7.2f} "
                  f"{max(run['peak_rss'] for run in runs) / MB:>12.0f} "
                  f"{max(run['rss_before'] for run in runs) / MB:>10.0f}  {runs[0]['outcome']}")
        print("\nhostile workbooks (seconds, peak RSS above the RSS before the read)")
        for label, name in PROBES.items():
            print(f"  {label}")
            for reader in PROBE_READERS:
                run = _run(reader, directory / name, PROBE_TIMEOUT_SECONDS)
                grown = max(run["peak_rss"] - run["rss_before"], 0) / MB
                print(f"    {reader:<24} {run['seconds']:>6.2f} s {grown:>5.0f} MB  "
                      f"{run['outcome']}")


if __name__ == "__main__":
    main()
