"""The contract every source honours, checked against the whole code location and the files
around it: what a source must have besides its module, and where each piece lives.

:func:`contract_problems` names every missing piece of one source as a sentence that says what
is missing, where it belongs and how to add it; an empty list means the source is complete.
:class:`Project` says where to look, so a test can take one piece away and see it named.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from dagster import AssetKey, Definitions, GraphDefinition
from sqlalchemy import String
from sqlalchemy.dialects import postgresql

from mostovik_pipelines.core.retries import RetryPolicy
from mostovik_pipelines.core.tags import JOB_TYPE_TAG, SOURCE_TAG
from mostovik_pipelines.framework.quality.checks import partition_checks
from mostovik_pipelines.framework.spec import ConcurrentRunPolicy, SourceSpec
from mostovik_pipelines.framework.verification.check import MATCHES_SOURCE
from mostovik_pipelines.resources.http import HttpSourceResource
from mostovik_pipelines.standin.endpoint import Endpoint, discover_endpoints
from mostovik_pipelines.warehouse.freeze import VERSIONS_DIR
from mostovik_pipelines.warehouse.schema import postgresql_conventions

REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "mostovik_pipelines_tests"
SOURCES = REPO / "mostovik_pipelines" / "sources"
NEW_MIGRATION = "`mostovik new-source {name} --migration-only` writes it from the declared table"


@dataclass(frozen=True)
class Project:
    """Where a source's pieces are looked for."""

    definitions: Definitions
    migrations: Path = VERSIONS_DIR
    endpoints: Mapping[str, Endpoint] | None = None
    corpus: Path = TESTS / "corpus"
    tests: Path = TESTS / "sources"

    @property
    def found_endpoints(self) -> Mapping[str, Endpoint]:
        return discover_endpoints() if self.endpoints is None else self.endpoints


def contract_problems(spec: SourceSpec, project: Project) -> list[str]:
    """Every piece of the source's contract that is missing, each named with where it goes."""
    name = spec.name
    module = f"mostovik_pipelines/sources/{name}/source.py"
    test_module = project.tests / name / f"test_{name}.py"
    return [f"{name}: {problem}" for problem in (
        *_job_problems(spec, project.definitions, module),
        *_retry_problems(spec, project.definitions, module),
        *_migration_problems(spec, project.migrations),
        *_standin_problems(spec, project.found_endpoints, module),
        *_corpus_problems(spec, project.corpus),
        *([] if spec.shape is not None else [
            f"no shape declared in {module}: SourceSpec(shape=SourceShape(...)) lists the "
            "fields the source sends (framework/quality/shape.py), so a change is noticed"]),
        *([] if test_module.exists() else [
            f"no test module {_shown(test_module)}: it loads a partition "
            "end to end on PostgreSQL and SQLite (`mostovik new-source` writes one)"]),
    )]


def modules_without_a_source(sources: Path = SOURCES) -> list[str]:
    """Source folders whose ``source.py`` declares no ``SOURCE``, folders without the
    ``__init__.py`` that re-exports it, and modules outside a folder: none of them is
    discovered, so nothing of theirs runs (names starting with ``_`` are helpers)."""
    problems = [
        f"{_shown(path)}: a source is a folder, sources/{path.stem}/ with source.py, parse.py "
        "and __init__.py"
        for path in sorted(sources.glob("*.py")) if not path.name.startswith("_")]
    for folder in sorted(path for path in sources.iterdir() if path.is_dir()
                         and not path.name.startswith(("_", "."))):
        declaration = folder / "source.py"
        if not declaration.exists() or "SOURCE" not in _assigned_names(
                ast.parse(declaration.read_text())):
            problems.append(f"{_shown(declaration)} declares no SOURCE = SourceSpec(...): the "
                            "source is not discovered")
        elif not (folder / "__init__.py").exists():
            problems.append(f"{_shown(folder)} has no __init__.py re-exporting SOURCE: the "
                            "source is not discovered")
    return problems


def migrations_importing_project_code(migrations: Path = VERSIONS_DIR) -> list[str]:
    """Migrations that import anything but Alembic and SQLAlchemy: history must not change with
    today's code."""
    problems = []
    environment = migrations.parent / "env.py"  # what replays them is history too
    for path in [*sorted(migrations.glob("*.py")), *([environment] if environment.exists()
                                                    else [])]:
        for node in ast.walk(ast.parse(path.read_text())):
            modules = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                       else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            problems += [
                f"{_shown(path)}:{node.lineno} imports {module}: a migration is frozen history, "
                "write what it needs as plain DDL and SQLAlchemy types"
                for module in modules
                if module.split(".")[0] not in ("alembic", "sqlalchemy", "__future__")]
    return problems


# --- the pieces ----------------------------------------------------------------------------------


def _job_problems(spec: SourceSpec, definitions: Definitions, module: str) -> list[str]:
    repository = definitions.get_repository_def()
    job_name = f"{spec.name}_job"
    problems = []
    if not repository.has_job(job_name):
        problems.append(f"no job {job_name} in the code location: the factory builds it from "
                        f"the SOURCE of {module} (build_source_definitions)")
    else:
        job = repository.get_job(job_name)
        wanted = {SOURCE_TAG: spec.name, JOB_TYPE_TAG: spec.job_type.value,
                  "dagster/max_runtime": str(spec.max_runtime_seconds)}
        missing = {k: v for k, v in wanted.items() if job.tags.get(k) != v}
        if missing:
            problems.append(f"{job_name} lacks the tracker tags {missing}: the jobs list and the "
                            "run queue go by them; build the job with framework/assets/factory.py")
    verification = f"{spec.name}_verification_job"
    if not repository.has_job(verification) or f"{spec.name}_verification" not in {
            s.name for s in repository.schedule_defs if s.job_name == verification}:
        problems.append(f"no {verification} with its schedule {spec.name}_verification: the "
                        "factory builds them from the SOURCE of "
                        f"{module} (framework/verification/schedule.py)")
    targets = [s.name for s in repository.schedule_defs if s.job_name == job_name] + [
        s.name for s in repository.sensor_defs
        if s.has_jobs and job_name in {t.job_name for t in s.targets}]
    if not targets:
        problems.append(f"nothing runs {job_name} on its own: declare schedule=SourceSchedule("
                        f"cron=..., timezone=...) or a sensor= in the SourceSpec of {module}")
    asset_key = AssetKey(spec.name)
    have = ({check.name for check in repository.asset_graph.get(asset_key).check_keys}
            if repository.asset_graph.has(asset_key) else set())
    wanted_checks = [*(check.name for check in partition_checks(spec)), MATCHES_SOURCE]
    missing_checks = [check for check in wanted_checks if check not in have]
    if missing_checks:
        problems.append(f"asset {spec.name} lacks the checks {missing_checks}: every source's "
                        "asset carries the framework's checks (framework/quality/checks.py, "
                        "declared by framework/assets/factory.py) and its own SourceSpec.checks")
    if not isinstance(spec.on_concurrent_run, ConcurrentRunPolicy):
        problems.append(f"on_concurrent_run is {spec.on_concurrent_run!r}: declare "
                        "ConcurrentRunPolicy.WAIT (a duplicate runs after the older run) or "
                        f"STOP (it loads nothing) in {module}")
    return problems


def _retry_problems(spec: SourceSpec, definitions: Definitions, module: str) -> list[str]:
    problems = [
        f"{field} is {policy!r}: a timeout, a 503 or a lost connection would fail the run at "
        f"once; declare {field}=RetryPolicy(max_attempts=4, base_delay_seconds=2.0, "
        f"max_delay_seconds=60.0) in {module}"
        for field, policy in (("extract_retry", spec.extract_retry),
                              ("load_retry", spec.load_retry))
        if not isinstance(policy, RetryPolicy) or policy.max_attempts < 2
    ]
    repository = definitions.get_repository_def()
    if repository.has_job(f"{spec.name}_job"):
        job = repository.get_job(f"{spec.name}_job")
        problems += [
            f"op {op_name} has a Dagster RetryPolicy: it would retry failures unclassified; "
            "retries go through core/retries.py only"
            for op_name in _ops_with_dagster_retries(job.graph, job.op_retry_policy)]
    return problems


def _ops_with_dagster_retries(graph: GraphDefinition, job_policy: object) -> list[str]:
    found = []
    for node in graph.nodes:
        if isinstance(node.definition, GraphDefinition):
            found += _ops_with_dagster_retries(node.definition, job_policy)
        elif job_policy or node.retry_policy or getattr(node.definition, "retry_policy", None):
            found.append(node.name)
    return found


def _migration_problems(spec: SourceSpec, migrations: Path) -> list[str]:
    table = spec.table.name
    new_migration = NEW_MIGRATION.format(name=spec.name)
    parsed = {path: ast.parse(path.read_text()) for path in sorted(migrations.glob("*.py"))}
    creating = [(path, call) for path, tree in parsed.items() for call in _calls(tree)
                if _called(call) == "op.create_table" and _first_text(call) == table]
    if not creating:
        return [f"no migration in {_shown(migrations)} creates table {table}: {new_migration}"]
    problems = []
    path, create = creating[-1]
    keys = [[_text(a) for a in call.args] for call in _calls(create)
            if _called(call) in ("sa.UniqueConstraint", "UniqueConstraint")]
    if list(spec.natural_key) not in keys:
        problems.append(f"{_shown(path)} creates {table} without the unique natural key "
                        f"{list(spec.natural_key)}: add sa.UniqueConstraint(..., "
                        f'name="uq_{table}_natural_key"), or {new_migration}')
    key_text = {name: spec.table.c[name].type.compile(dialect=postgresql.dialect())
                for name in spec.natural_key if isinstance(spec.table.c[name].type, String)}
    wanted = [s for s in postgresql_conventions(table, key_text)
              if not s.startswith(("CREATE OR REPLACE FUNCTION", "DROP TRIGGER"))]
    written = {_normal(text) for tree in parsed.values() for text in _texts(tree)}
    missing = [s for s in wanted if _normal(s) not in written]
    if missing:
        problems.append(
            f"no migration applies the PostgreSQL conventions to {table} (missing "
            f"{missing[0]!r}{' and more' if len(missing) > 1 else ''}): without them its first "
            f"load fails on NOT NULL; write them in POSTGRESQL_CONVENTIONS of {_shown(path)}, "
            f"or {new_migration}")
    return problems


def _standin_problems(spec: SourceSpec, endpoints: Mapping[str, Endpoint],
                      module: str) -> list[str]:
    if not isinstance(spec.resource, HttpSourceResource):
        return []  # a file source's stand-in is an inbox folder (tests: under the work dir)
    problems = []
    if spec.name not in endpoints:
        problems.append(
            f"no stand-in endpoint: add mostovik_pipelines/sources/{spec.name}/standin.py "
            f'that declares ENDPOINT = Endpoint(source="{spec.name}", route=..., path=..., '
            "state=...) (sources/cbr_daily_rates/standin.py is one); tests, `mostovik demo` and "
            "`make dev` find it there")
    if not spec.url_setting:
        problems.append(f"no url_setting in {module}: name the MOSTOVIK_* variable its "
                        "resource reads the URL from, so `mostovik demo` and `make dev` can "
                        "point it at the stand-in")
    return problems


def _corpus_problems(spec: SourceSpec, corpus: Path) -> list[str]:
    folder = corpus / spec.name
    settings = folder / "_source.json"
    if not settings.exists():
        return [f"no bad-input corpus: add {_shown(settings)} (route, partition, neighbour) "
                "and cases <case>.<ext> + <case>.expect.json (see corpus/README.md)"]
    problems = []
    if not any(folder.glob("*.expect.json")):
        problems.append(f"the corpus {_shown(folder)} has no case: add <case>.<ext> and "
                        "<case>.expect.json")
    declared = json.loads(settings.read_text())
    needed = ("route", "neighbour") if declared.get("route") == "inbox" else (
        "route", "neighbour", "partition")
    missing = [k for k in needed if k not in declared]
    if missing:
        problems.append(f"{_shown(settings)} lacks {missing}")
    return problems


# --- reading migrations and modules without running them ---------------------------------------


def _calls(tree: ast.AST) -> list[ast.Call]:
    return [node for node in ast.walk(tree) if isinstance(node, ast.Call)]


def _called(call: ast.Call) -> str:
    return ast.unparse(call.func)


def _text(node: ast.AST) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def _first_text(call: ast.Call) -> str | None:
    return _text(call.args[0]) if call.args else None


def _texts(tree: ast.AST) -> list[str]:
    return [node.value for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str)]


def _normal(sql: str) -> str:
    return " ".join(sql.split())


def _assigned_names(tree: ast.Module) -> set[str]:
    return {target.id for node in tree.body if isinstance(node, ast.Assign | ast.AnnAssign)
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target])
            if isinstance(target, ast.Name)}


def _shown(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)

