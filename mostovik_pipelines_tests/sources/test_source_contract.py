"""The contract every source honours, checked on the whole code location: job, schedule or
sensor, asset checks, retry policies, concurrency policy, tracker tags, a migration creating its
table with the unique natural key and the conventions, a stand-in endpoint, a bad-input corpus,
a test module. Each piece, taken away on purpose, is named with where it belongs."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest
from dagster import AssetsDefinition, Definitions, asset, define_asset_job

from mostovik_pipelines.core.retries import NO_RETRY
from mostovik_pipelines.definitions import build_code_location, default_resources, defs
from mostovik_pipelines.framework.assets.factory import build_source_definitions
from mostovik_pipelines.sources import ALL_SOURCES
from mostovik_pipelines.standin.endpoint import discover_endpoints
from mostovik_pipelines.warehouse.freeze import VERSIONS_DIR
from mostovik_pipelines_tests.support.contract import (
    TESTS,
    Project,
    contract_problems,
    migrations_importing_project_code,
    modules_without_a_source,
)

SPECS = {spec.name: spec for spec in ALL_SOURCES}
EXAMPLE = "cbr_metal_prices"
"""The source the omissions are taken from: the newest, added by following the walk-through."""


@pytest.mark.parametrize("spec", ALL_SOURCES, ids=lambda spec: spec.name)
def test_every_source_honours_the_whole_contract(spec):
    assert contract_problems(spec, Project(defs)) == []


def test_every_source_module_is_discovered_and_no_migration_imports_project_code():
    assert modules_without_a_source() == []
    assert migrations_importing_project_code() == []


# --- each piece, taken away -------------------------------------------------------------------


@pytest.fixture
def example():
    return SPECS[EXAMPLE]


def problems_of(spec, **where) -> str:
    """The contract's problems for ``spec`` in a code location of that spec alone, with
    ``where`` replacing where a piece is looked for, as one text to search."""
    project = Project(where.pop("definitions", None) or build_code_location([spec]), **where)
    return "\n".join(contract_problems(spec, project))


def location(spec, assets, jobs=()) -> Definitions:
    """A code location of hand-picked definitions of ``spec``, with its resources."""
    return Definitions(assets=assets, jobs=list(jobs), resources=default_resources([spec]))


def without_migration_text(tmp_path: Path, table: str, cut) -> Path:
    """A copy of the migrations whose file creating ``table`` is changed by ``cut``."""
    copy = tmp_path / "versions"
    shutil.copytree(VERSIONS_DIR, copy, ignore=shutil.ignore_patterns("__pycache__"))
    [path] = [p for p in copy.glob("*.py") if f'op.create_table(\n        "{table}"' in
              p.read_text()]
    cut(path)
    return copy


def test_a_source_without_its_job_is_named(example):
    [asset] = [a for a in build_source_definitions(example).assets
               if isinstance(a, AssetsDefinition)]
    found = problems_of(example, definitions=location(example, [asset]))
    assert f"{EXAMPLE}: no job {EXAMPLE}_job in the code location" in found
    assert f"mostovik_pipelines/sources/{EXAMPLE}/source.py" in found


def test_a_source_without_a_schedule_or_sensor_is_named(example):
    found = problems_of(dataclasses.replace(example, schedule=None))
    assert f"nothing runs {EXAMPLE}_job on its own: declare schedule=SourceSchedule(" in found


def test_a_source_without_its_asset_checks_is_named(example):
    @asset(name=EXAMPLE, partitions_def=example.partitions_def)
    def unchecked() -> None:
        """The source's asset as if the factory declared no checks on it."""

    job = define_asset_job(f"{EXAMPLE}_job", selection=[EXAMPLE],
                           partitions_def=example.partitions_def)
    found = problems_of(example, definitions=location(example, [unchecked], [job]))
    assert f"asset {EXAMPLE} lacks the checks ['natural_key_unique'" in found
    assert "framework/quality/checks.py" in found


def test_a_source_without_retries_is_named(example):
    found = problems_of(dataclasses.replace(example, extract_retry=NO_RETRY))
    assert "extract_retry is RetryPolicy(max_attempts=1" in found
    assert "declare extract_retry=RetryPolicy(max_attempts=4" in found


def test_a_source_without_a_shape_is_named(example):
    found = problems_of(dataclasses.replace(example, shape=None, empty_payload_is_valid=False))
    assert f"no shape declared in mostovik_pipelines/sources/{EXAMPLE}/source.py" in found


def test_a_source_without_a_concurrency_policy_is_named(example):
    found = problems_of(dataclasses.replace(example, on_concurrent_run=None))
    assert "on_concurrent_run is None: declare ConcurrentRunPolicy.WAIT" in found


def test_a_job_without_the_tracker_tags_is_named(example):
    [asset] = [a for a in build_source_definitions(example).assets
               if isinstance(a, AssetsDefinition)]
    untagged = define_asset_job(f"{EXAMPLE}_job", selection=[EXAMPLE],
                                partitions_def=example.partitions_def)
    found = problems_of(example, definitions=location(example, [asset], [untagged]))
    assert f"{EXAMPLE}_job lacks the tracker tags" in found
    assert "'mostovik/source': 'cbr_metal_prices'" in found


def test_a_source_without_its_migration_is_named(example, tmp_path):
    migrations = without_migration_text(tmp_path, example.table.name, Path.unlink)
    found = problems_of(example, migrations=migrations)
    assert f"no migration in {migrations} creates table {EXAMPLE}" in found
    assert f"`mostovik new-source {EXAMPLE} --migration-only` writes it" in found


def test_a_migration_without_the_unique_natural_key_is_named(example, tmp_path):
    def cut(path: Path) -> None:
        text = path.read_text()
        start = text.index("        sa.UniqueConstraint(")
        path.write_text(text[:start] + text[text.index("\n", start) + 1:])

    found = problems_of(example, migrations=without_migration_text(
        tmp_path, example.table.name, cut))
    assert f"creates {EXAMPLE} without the unique natural key ['price_date', 'metal_code']" in (
        found)


def test_a_migration_without_the_conventions_is_named(example, tmp_path):
    def cut(path: Path) -> None:
        text = path.read_text()
        start = text.index("POSTGRESQL_CONVENTIONS = [\n")
        path.write_text(text[:start] + "POSTGRESQL_CONVENTIONS = []\n"
                        + text[text.index("]\n", start) + 2:])

    found = problems_of(example, migrations=without_migration_text(
        tmp_path, example.table.name, cut))
    assert f"no migration applies the PostgreSQL conventions to {EXAMPLE}" in found
    assert "first load fails on NOT NULL" in found


def test_a_source_without_a_standin_endpoint_is_named(example):
    endpoints = {k: v for k, v in discover_endpoints().items() if k != EXAMPLE}
    found = problems_of(example, endpoints=endpoints)
    assert (f"{EXAMPLE}: no stand-in endpoint: add mostovik_pipelines/sources/{EXAMPLE}/"
            "standin.py") in found


def test_a_source_without_its_url_setting_is_named(example):
    found = problems_of(dataclasses.replace(example, url_setting=None))
    assert f"no url_setting in mostovik_pipelines/sources/{EXAMPLE}/source.py" in found


def test_a_source_without_a_corpus_is_named(example, tmp_path):
    found = problems_of(example, corpus=tmp_path)
    assert f"no bad-input corpus: add {tmp_path}/{EXAMPLE}/_source.json" in found


def test_a_corpus_without_cases_is_named(example, tmp_path):
    shutil.copy(TESTS / "corpus" / EXAMPLE / "_source.json", tmp_path / "_source.json")
    (tmp_path / EXAMPLE).mkdir()
    shutil.move(tmp_path / "_source.json", tmp_path / EXAMPLE / "_source.json")
    found = problems_of(example, corpus=tmp_path)
    assert f"the corpus {tmp_path}/{EXAMPLE} has no case" in found


def test_a_source_without_a_test_module_is_named(example, tmp_path):
    found = problems_of(example, tests=tmp_path)
    assert f"no test module {tmp_path}/{EXAMPLE}/test_{EXAMPLE}.py" in found


def test_a_source_module_without_a_declaration_is_named(tmp_path):
    for folder in ("half_done", "_helpers", "complete"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "half_done" / "source.py").write_text(
        '"""A source not declared yet."""\n\nTABLE = None\n')
    (tmp_path / "_helpers" / "source.py").write_text("X = 1\n")
    (tmp_path / "complete" / "source.py").write_text("SOURCE = None\n")
    assert modules_without_a_source(tmp_path) == [
        f"{tmp_path}/half_done/source.py declares no SOURCE = SourceSpec(...): the source is "
        "not discovered"]


def test_a_source_outside_a_folder_or_without_its_init_is_named(tmp_path):
    (tmp_path / "flat.py").write_text("SOURCE = None\n")
    (tmp_path / "no_init").mkdir()
    (tmp_path / "no_init" / "source.py").write_text("SOURCE = None\n")
    assert modules_without_a_source(tmp_path) == [
        f"{tmp_path}/flat.py: a source is a folder, sources/flat/ with source.py, parse.py and "
        "__init__.py",
        f"{tmp_path}/no_init has no __init__.py re-exporting SOURCE: the source is not "
        "discovered"]


def test_a_migration_importing_project_code_is_named(tmp_path):
    (tmp_path / "0099_x.py").write_text(
        "import sqlalchemy as sa\nfrom mostovik_pipelines.warehouse.types import ExactDecimal\n")
    [problem] = migrations_importing_project_code(tmp_path)
    assert problem.startswith(f"{tmp_path}/0099_x.py:2 imports mostovik_pipelines.warehouse")
    assert "frozen history" in problem

