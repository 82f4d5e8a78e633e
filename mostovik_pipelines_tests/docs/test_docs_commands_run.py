"""Every command the README and docs/*.md show, run as an operator types it: on a laptop here
(the local SQLite instance and warehouse of a project directory, ``DAGSTER_HOME`` = that
directory, the stand-in sources), on the production instance in
``test_docs_operator_commands_run.py``. Each exits as its document says and prints what it shows.

The laptop is a directory of its own holding the project's Makefile, pyproject.toml,
workspace.yaml, dagster.yaml and .venv (links to this checkout), so ``make demo`` and
``make dev`` keep their state (``.mostovik/``, the instance) in it, as they do in a checkout. In
order: ``make install``; ``make demo`` on the day the README's table was made (2026-12-02, by
libfaketime), which prints that table; ``make dev``, until its UI answers, and with it up the
guide's ``mostovik db upgrade`` and ``dagster asset materialize`` against its stand-in, then
the operator's "Running jobs" block (``mostovik``, ``dagster`` and ``dg``); then the scaffold's
two commands in a copy of the repository as it was before the metals were added, which write
the files the guide lists.

The README's prose names ``make lint`` and ``make clean``: run too (the targets not run:
:data:`CHEAP_TARGETS`). Not run, each with its reason (:data:`NOT_RUN`): ``make test`` (it is
what runs this test), the chaos and benchmark commands of docs/testing.md and
benchmarks/README.md; deploy/README.md's are run by ``test_runbook.py``. The ``text``
blocks are synopses, not commands.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import socket
import sqlite3
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from mostovik_pipelines_tests.docs import test_docs_operator_commands_run as operator_commands
from mostovik_pipelines_tests.support.doc_commands import (
    FENCE,
    REPO,
    ShownCommand,
    assert_shows,
    not_run,
    run_shown,
    shown_command,
)
from mostovik_pipelines_tests.support.fake_clock import libfaketime_path
from mostovik_pipelines_tests.support.graphql import LOCATION_NAME, DagsterGraphQL
from mostovik_pipelines_tests.support.processes import stop_session
from mostovik_pipelines_tests.support.waiting import PROCESS_START_MARGIN_SECONDS, wait_until

pytestmark = pytest.mark.slow

README, GUIDE, OPERATIONS = "README.md", "docs/adding-a-source.md", "docs/operations.md"
PROJECT_FILES = ("Makefile", "pyproject.toml", "workspace.yaml", "dagster.yaml", ".venv",
                 "mostovik_pipelines")
README_DAY = "2026-12-02 09:00:00"
"""When the README's demo table was made (UTC; 12:00 in Moscow, before the CBR publishes
tomorrow's rates): its days and the ERP's figures are that day's."""
DEV_UI = "http://127.0.0.1:3000"
DEV_PORTS = (3000, 8765)
"""Where make dev serves the UI and the stand-in."""
TESTING, DEPLOY, BENCH = "docs/testing.md", "deploy/README.md", "benchmarks/README.md"
NOT_RUN = {
    (README, "make test"): "the whole suite: it is what runs this test",
    (DEPLOY, ""): "every command of the runbook is run as written, in its order, by "
                  "test_runbook.py, which fails on a block it does not run",
    (TESTING, "python -m mostovik_pipelines_tests.chaos --seed"): "a make chaos run at its "
        "default counts (hours); every make chaos runs it with a new seed, make test has each "
        "suite's fixed-seed case (test_chaos*.py)",
    (TESTING, "python -m mostovik_pipelines_tests.chaos.ranged_crash"): "20 ranged runs of 120 "
        "partitions each, about half an hour; make test has the crash under a partition's "
        "checks (core/test_retries.py)",
    (BENCH, "make bench "): "tens of minutes of measurement on a quiet machine (speed targets "
        "live there, not in tests); test_benchmark_floor.py checks what the year's figures "
        "stand on",
    (BENCH, "make bench BENCH_ARGS=--quick"): "a smoke run of every benchmark section, minutes: "
        "run by hand before a figure is taken",
    (BENCH, ".venv/bin/python -m benchmarks.run"): "one benchmark section at its full size, "
        "minutes each: run by hand when its figure is taken",
}
"""Commands the documents show that no test runs, and why (or which test runs them)."""
CHEAP_TARGETS = ("make lint", "make clean")
"""Targets the README names in its prose, run too. Not run: ``make screenshots`` (a 30-day demo
and headless Chromium, minutes), ``make bench`` and ``make chaos`` (tens of minutes each),
``make check`` (ruff and the server-free tests, every one of which ``make test`` runs)."""
PICKED = (
    (GUIDE, "make install"), (README, "make demo"), (GUIDE, "make dev"),
    (GUIDE, ".venv/bin/mostovik db upgrade"), (GUIDE, "env $(.venv/bin/mostovik standin"),
    (OPERATIONS, "export DAGSTER_HOME"), (OPERATIONS, "mostovik db upgrade"),
    (OPERATIONS, "mostovik db forget-digests"), (OPERATIONS, "dagster job execute"),
    (OPERATIONS, "dagster asset materialize"), (OPERATIONS, "mostovik materialize"),
    (OPERATIONS, "dg check defs"), (OPERATIONS, "dg list defs"), (OPERATIONS, "dg launch"),
    (GUIDE, ".venv/bin/mostovik new-source cbr_metal_prices --type"),
    (GUIDE, ".venv/bin/mostovik new-source cbr_metal_prices --migration-only"),
)
"""The commands this module runs, by document and how the line starts."""


def shown_block(document: str, starts_with: str) -> list[str]:
    """The lines of the fenced block of ``document`` that starts with ``starts_with`` (shown
    output)."""
    blocks = [match.group(2).splitlines() for match in
              FENCE.finditer((REPO / document).read_text(encoding="utf-8"))
              if match.group(2).startswith(starts_with)]
    assert len(blocks) == 1, f"{document} shows {len(blocks)} blocks starting {starts_with!r}"
    return blocks[0]


def test_every_command_the_documents_show_is_run():
    picked = [*PICKED, *operator_commands.PICKED, *NOT_RUN]
    assert not_run(picked) == [], "commands the documents show that no test runs"
    assert {start for _, start in picked} >= {"make demo", "make dev", "dg launch"}


@dataclasses.dataclass
class Laptop:
    """The project directory of a developer's laptop and the shell they type in."""

    directory: Path
    environment: dict[str, str]

    def run(self, document: str, starts_with: str, **expected) -> str:
        """Type the document's command here; its output."""
        return run_shown(shown_command(document, starts_with), cwd=self.directory,
                         environment=self.environment, **expected).stdout

    def warehouse_rows(self, query: str) -> list[tuple]:
        with sqlite3.connect(self.directory / ".mostovik" / "warehouse.sqlite") as connection:
            return connection.execute(query).fetchall()


@pytest.fixture(scope="module")
def laptop(tmp_path_factory: pytest.TempPathFactory) -> Laptop:
    directory = tmp_path_factory.mktemp("laptop")
    for name in PROJECT_FILES:
        (directory / name).symlink_to(REPO / name)
    venv = directory / ".venv"
    environment = {name: value for name, value in os.environ.items()
                   if not name.startswith(("MOSTOVIK_", "DAGSTER_"))}
    environment.update(PATH=f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}",
                       VIRTUAL_ENV=str(venv))  # the venv activated, as dg asks
    return Laptop(directory, environment)


@pytest.mark.timeout(600)
def test_make_install_then_make_demo_prints_the_readmes_table(laptop):
    # In the checkout: the .venv is the checkout's; the laptop's make then finds it up to date.
    run_shown(shown_command(GUIDE, "make install"), cwd=REPO, environment=laptop.environment)
    assert subprocess.run(["make", "-q", "install"], cwd=laptop.directory,
                          env=laptop.environment).returncode == 0

    output = run_shown(shown_command(README, "make demo"), cwd=laptop.directory,
                       environment={**laptop.environment, "LD_PRELOAD": libfaketime_path(),
                                    "FAKETIME": f"@{README_DAY}"}).stdout

    assert_shows(output, shown_block(README, "cbr_daily_rates (parser job)"))
    # The README's next paragraph: the bad row waits in quarantined_rows, its number and reason.
    assert laptop.warehouse_rows("SELECT row_number, reason FROM quarantined_rows") == [
        (5, "Количество 'двенадцать' is not a number")]


@pytest.fixture(scope="module")
def make_dev(laptop: Laptop) -> Iterator[DagsterGraphQL]:
    """``make dev`` running in the laptop until the module ends; the client of its UI."""
    for port in DEV_PORTS:
        assert not _answers(port), f"make dev needs port {port}: something else holds it"
    log = laptop.directory / "make-dev.log"
    with log.open("ab") as written:
        process = subprocess.Popen(["bash", "-c", shown_command(GUIDE, "make dev").line],
                                   cwd=laptop.directory, env=laptop.environment,
                                   stdout=written, stderr=subprocess.STDOUT,
                                   start_new_session=True)
    ui = DagsterGraphQL(f"{DEV_UI}/graphql", diagnostics=lambda: log.read_text()[-4000:])
    try:
        def loaded() -> bool:
            assert process.poll() is None, f"make dev exited:\n{log.read_text()[-4000:]}"
            with contextlib.suppress(httpx.TransportError):  # not answering yet
                return ui.location_statuses().get(LOCATION_NAME) == "LOADED"
            return False

        wait_until(loaded, 3 * PROCESS_START_MARGIN_SECONDS, "make dev's UI serving the code "
                   "location", lambda: log.read_text()[-4000:], poll=1)
        assert ui.location_load_error() is None
        yield ui
    finally:
        ui.close()
        stop_session(process, grace=60)
        wait_until(lambda: not any(_answers(port) for port in DEV_PORTS),
                   PROCESS_START_MARGIN_SECONDS, "make dev's UI and stand-in stopped")


def _answers(port: int) -> bool:
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) == 0


@pytest.mark.timeout(600)
def test_make_dev_then_the_guides_materialize_of_a_metals_day(laptop, make_dev):
    assert "warehouse at revision" in laptop.run(GUIDE, ".venv/bin/mostovik db upgrade")

    laptop.run(GUIDE, "env $(.venv/bin/mostovik standin")

    assert laptop.warehouse_rows("SELECT count(*) FROM cbr_metal_prices "
                                 "WHERE price_date = '2026-11-04'") == [(4,)]


@pytest.mark.timeout(900)
def test_with_make_dev_up_the_operators_running_jobs_block(laptop, make_dev):
    # The operator's shell: the sources pointed at make dev's stand-in, as make dev does.
    standin = subprocess.run([".venv/bin/mostovik", "standin", "--print-env"],
                             cwd=laptop.directory, env=laptop.environment, capture_output=True,
                             text=True, check=True).stdout
    laptop.environment.update(line.split("=", 1) for line in standin.split())
    exported = run_shown(dataclasses.replace(
        shown_command(OPERATIONS, "export DAGSTER_HOME"),
        line=f"{shown_command(OPERATIONS, 'export DAGSTER_HOME').line}\nprintenv DAGSTER_HOME"),
        cwd=laptop.directory, environment=laptop.environment).stdout
    laptop.environment["DAGSTER_HOME"] = exported.strip()
    assert Path(laptop.environment["DAGSTER_HOME"]) == laptop.directory

    assert "warehouse at revision" in laptop.run(OPERATIONS, "mostovik db upgrade")
    assert "forgot the content digests of" in laptop.run(OPERATIONS, "mostovik db forget-digests")
    for classic in ("dagster job execute", "dagster asset materialize"):
        assert "RUN_SUCCESS" in laptop.run(OPERATIONS, classic)
    summary = laptop.run(OPERATIONS, "mostovik materialize")
    assert len([line for line in summary.splitlines() if line.startswith("20")]) == 7, summary
    assert "All definitions loaded successfully." in laptop.run(OPERATIONS, "dg check defs")
    listed = laptop.run(OPERATIONS, "dg list defs")
    assert all(name in listed for name in ("cbr_daily_rates_job", "cbr_daily_rates_schedule",
                                           "material_deliveries_inbox_sensor", "warehouse"))
    assert "RUN_SUCCESS" in laptop.run(OPERATIONS, "dg launch")

    # The runs are the UI's: make dev's webserver lists them, tagged with the period.
    shown_in_ui = make_dev.runs({"tags": [{"key": "dagster/partition", "value": "2026-11-02"}]})
    assert len([run for run in shown_in_ui if run.status == "SUCCESS"]) >= 3, shown_in_ui
    assert laptop.warehouse_rows("SELECT count(*) FROM cbr_daily_rates "
                                 "WHERE partition_date = '2026-11-02'") == [(12,)]


MIGRATIONS = "mostovik_pipelines/warehouse/migrations/versions"
METALS_ADDED_BY = ("mostovik_pipelines/sources/cbr_metal_prices",
                   "mostovik_pipelines_tests/sources/cbr_metal_prices",
                   "mostovik_pipelines_tests/corpus/cbr_metal_prices",
                   *sorted(f"{MIGRATIONS}/{path.name}"
                           for path in (REPO / MIGRATIONS).glob("*.py") if path.name >= "0007"))
"""What the repository gained with and after the metals (its migration, 0007, and every later
one): the guide scaffolds them anew."""


def test_the_scaffold_writes_what_the_guide_lists(tmp_path):
    before_the_metals = tmp_path / "checkout"
    for name in ("mostovik_pipelines", "mostovik_pipelines_tests"):
        shutil.copytree(REPO / name, before_the_metals / name,
                        ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "setup.cfg"):
        shutil.copy2(REPO / name, before_the_metals / name)
    (before_the_metals / ".venv").symlink_to(REPO / ".venv")
    for added in METALS_ADDED_BY:
        path = before_the_metals / added
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    # Its .venv imports the package from this checkout, as a checkout's own does.
    environment = {**os.environ, "PYTHONPATH": str(before_the_metals)}

    written = run_shown(shown_command(GUIDE, ".venv/bin/mostovik new-source cbr_metal_prices "
                                             "--type"),
                        cwd=before_the_metals, environment=environment).stdout
    assert written.splitlines() == shown_block(GUIDE, "wrote ")
    rewritten = run_shown(shown_command(GUIDE, ".venv/bin/mostovik new-source cbr_metal_prices "
                                               "--migration-only"),
                          cwd=before_the_metals, environment=environment).stdout
    assert rewritten.startswith(
        "wrote mostovik_pipelines/warehouse/migrations/versions/0007_cbr_metal_prices.py")


def test_the_readmes_cheap_make_targets(laptop, tmp_path):
    """``make lint`` and ``make clean``, named in the README's prose ("Other commands")."""
    named = [target for target in CHEAP_TARGETS if f"`{target}`" in (REPO / README).read_text()]
    assert named == list(CHEAP_TARGETS), "the README no longer names them: update this test"
    run_shown(ShownCommand(README, "make lint"), cwd=REPO, environment=laptop.environment)
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    for name in PROJECT_FILES:
        (checkout / name).symlink_to(REPO / name)
    subprocess.run([".venv/bin/mostovik", "db", "upgrade"], cwd=checkout,
                   env=laptop.environment, check=True, capture_output=True)
    assert (checkout / ".mostovik" / "warehouse.sqlite").exists()

    run_shown(ShownCommand(README, "make clean"), cwd=checkout, environment=laptop.environment)

    assert not (checkout / ".mostovik").exists()


def test_a_command_the_documents_get_wrong_fails_its_run(laptop):
    shown = shown_command(OPERATIONS, "mostovik materialize")
    renamed = dataclasses.replace(shown, line=shown.line.replace("--last", "--latest"))
    with pytest.raises(AssertionError, match="exited 2"):
        run_shown(renamed, cwd=laptop.directory, environment=laptop.environment)
