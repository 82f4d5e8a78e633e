"""A source's migration, written as frozen history.

A migration is replayed on databases for years: it must create today's table whatever the code
says tomorrow. So the migration of a source's table is generated once from its declaration and
then imports nothing of the project:

* Alembic's autogenerate compares the declared table with an empty database, which gives the
  operations that create it (table, columns, natural-key constraint, indexes);
* they are rendered as plain ``op.create_table`` / ``op.create_index`` calls with SQLAlchemy's
  own types (an exact decimal becomes ``NUMERIC``, its text on SQLite);
* the PostgreSQL conventions (:func:`.schema.postgresql_conventions`) are written out as the
  literal statements they are today, in ``POSTGRESQL_CONVENTIONS``; the trigger function they
  call exists since migration 0003.
"""

from __future__ import annotations

import json
import re
import textwrap
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from alembic.autogenerate import produce_migrations
from alembic.operations import ops
from alembic.runtime.migration import MigrationContext
from sqlalchemy import (
    Column,
    MetaData,
    PrimaryKeyConstraint,
    String,
    Table,
    UniqueConstraint,
    create_engine,
)
from sqlalchemy.dialects import postgresql
from sqlalchemy.types import TypeDecorator, TypeEngine

from mostovik_pipelines.warehouse.schema import postgresql_conventions
from mostovik_pipelines.warehouse.types import ExactDecimal

VERSIONS_DIR = Path(__file__).parent / "migrations" / "versions"
WIDTH = 100
EXACT = 'sa.Numeric().with_variant(sa.String(), "sqlite")'
"""An exact decimal as frozen DDL: what :class:`.types.ExactDecimal` creates on each backend."""
REVISION_FILE = re.compile(r"^(\d{4})_(\w+)\.py$")


class MigrationRefused(Exception):
    """The migration cannot be written as asked; the message says why and what to do."""


def frozen_type(column_type: TypeEngine) -> str:
    """A column type as SQLAlchemy code that needs no project import."""
    if isinstance(column_type, ExactDecimal):
        return EXACT
    if isinstance(column_type, TypeDecorator) or not type(column_type).__module__.startswith(
            "sqlalchemy.sql"):
        raise MigrationRefused(
            f"column type {column_type!r} is not one of SQLAlchemy's generic types: a frozen "
            "migration cannot import it. Declare the column with a sqlalchemy type (String, "
            "Integer, Date, DateTime, Boolean, Text) or ExactDecimal")
    return f"sa.{column_type!r}"


def write_migration(table: Table, summary: str, *, versions_dir: Path = VERSIONS_DIR,
                    replace: bool = False) -> Path:
    """Write ``<NNNN>_<table>.py`` creating ``table``, on top of the newest migration; with
    ``replace``, rewrite the table's own migration instead, which must be the newest one (a
    migration followed by others is history: change the table in a new migration)."""
    files = _revision_files(versions_dir)
    own = [path for path in files if REVISION_FILE.match(path.name).group(2) == table.name]
    if replace:
        if not own:
            raise MigrationRefused(f"no migration {versions_dir}/NNNN_{table.name}.py to rewrite")
        if own[-1] != files[-1]:
            raise MigrationRefused(
                f"{own[-1].name} is followed by {files[-1].name}: it is history now. Change "
                f"{table.name} in a new migration instead")
        path = own[-1]
        down = _down_revision(path)
    elif own:
        raise MigrationRefused(
            f"{own[-1].name} already creates {table.name}: rewrite it with --migration-only "
            "while it is the newest migration, or change the table in a new migration")
    else:
        number = int(REVISION_FILE.match(files[-1].name).group(1)) + 1 if files else 1
        path = versions_dir / f"{number:04d}_{table.name}.py"
        down = REVISION_FILE.match(files[-1].name).group(1) if files else None
    revision = REVISION_FILE.match(path.name).group(1)
    path.write_text(migration_source(table, summary, revision, down))
    return path


def migration_source(table: Table, summary: str, revision: str,
                     down_revision: str | None) -> str:
    """The text of a migration that creates ``table`` with its conventions."""
    create, indexes = _creation_ops(table)
    key = next(c for c in table.constraints if isinstance(c, UniqueConstraint))
    key_text = {
        column.name: column.type.compile(dialect=postgresql.dialect())
        for column in key.columns if isinstance(column.type, String)
    }
    conventions = [statement for statement in postgresql_conventions(table.name, key_text)
                   if not statement.startswith(("CREATE OR REPLACE FUNCTION", "DROP TRIGGER"))]
    exact = any(isinstance(c.type, ExactDecimal) for c in table.columns)
    docstring = "\n".join([
        *textwrap.wrap(f"{table.name}: {summary}", WIDTH - 3),
        "",
        *textwrap.wrap(
            "Frozen history: plain DDL only, written by `mostovik new-source` from the declared "
            "table, the PostgreSQL conventions written out as they were on the day (natural key "
            'text in the "C" collation, bookkeeping defaults, the trigger that forgets the '
            "table's content digests when anything but the loader writes it; its function "
            "exists since 0003).", WIDTH),
        "",
        f"Revision ID: {revision}",
        f"Revises: {down_revision or ''}",
    ])
    upgrade = [
        *([f"    exact = {EXACT}"] if exact else []),
        "    op.create_table(",
        f"        {_literal(table.name)},",
        *(line for element in create.columns if not _empty(element)
          for line in _call(*_element(element), indent=8, suffix=",")),
        *(_keyword("comment=", table.comment, 8, ",") if table.comment else []),
        "    )",
        *(line for index in indexes for line in _call("op.create_index", [
            _literal(index.index_name), _literal(index.table_name),
            _literal_list(index.columns), *(["unique=True"] if index.unique else [])], 4)),
        '    if op.get_bind().dialect.name == "postgresql":',
        "        for statement in POSTGRESQL_CONVENTIONS:",
        "            op.execute(statement)",
    ]
    downgrade = [
        *(line for index in reversed(indexes) for line in _call("op.drop_index", [
            _literal(index.index_name), f"table_name={_literal(index.table_name)}"], 4)),
        f"    op.drop_table({_literal(table.name)})",
    ]
    return "\n".join([
        f'"""{docstring}\n"""',
        "",
        "import sqlalchemy as sa",
        "from alembic import op",
        "",
        f"revision = {_literal(revision)}",
        f"down_revision = {_literal(down_revision) if down_revision else None}",
        "branch_labels = None",
        "depends_on = None",
        "",
        "POSTGRESQL_CONVENTIONS = [",
        *(line for statement in conventions for line in _string(statement, 4, ",")),
        "]",
        "",
        "",
        "def upgrade() -> None:",
        *upgrade,
        "",
        "",
        "def downgrade() -> None:",
        *downgrade,
        "",
    ])


def _creation_ops(table: Table) -> tuple[ops.CreateTableOp, list[ops.CreateIndexOp]]:
    """What Alembic's autogenerate finds missing in an empty database: the table, its
    constraints, its indexes."""
    engine = create_engine("sqlite://")
    metadata = MetaData(naming_convention=table.metadata.naming_convention)
    table.to_metadata(metadata)

    def only_this_table(item, name, kind, reflected, compare_to) -> bool:
        return (name if kind == "table" else getattr(item, "table", item).name) == table.name

    try:
        with engine.connect() as connection:
            context = MigrationContext.configure(connection, opts={
                "include_object": only_this_table, "compare_type": False})
            migration = produce_migrations(context, metadata)
    finally:
        engine.dispose()
    found = list(migration.upgrade_ops.ops)
    create = next(op for op in found if isinstance(op, ops.CreateTableOp))
    indexes = [op for group in found if isinstance(group, ops.ModifyTableOps)
               for op in group.ops if isinstance(op, ops.CreateIndexOp)]
    return create, indexes


def _empty(element: object) -> bool:
    return isinstance(element, PrimaryKeyConstraint) and not element.columns


def _element(element: object) -> tuple[str, list[str | _Text]]:
    """A column or constraint of ``op.create_table``: the call and its arguments."""
    if isinstance(element, UniqueConstraint | PrimaryKeyConstraint):
        return f"sa.{type(element).__name__}", [
            *(_literal(c.name) for c in element.columns), f"name={_literal(element.name)}"]
    if not isinstance(element, Column):
        raise MigrationRefused(f"{element!r}: only columns, the natural key and a primary key "
                               "are written; add other constraints to the migration by hand")
    unwritten = [what for what, present in (
        ("server_default", element.server_default is not None),
        ("default", element.default is not None),
        ("a foreign key", bool(element.foreign_keys)),
        ("autoincrement", element.autoincrement is True)) if present]
    if unwritten:
        raise MigrationRefused(
            f"column {element.name}: {', '.join(unwritten)} would not be written into the "
            "migration; declare the column without it, or add it to the migration by hand")
    column_type = "exact" if isinstance(element.type, ExactDecimal) else (
        frozen_type(element.type))
    return "sa.Column", [_literal(element.name), column_type, f"nullable={element.nullable}",
                         *([_Text(element.comment, "comment=")] if element.comment else [])]


@dataclass(frozen=True)
class _Text:
    """A string argument, written as a literal split over lines when it is too long."""

    text: str
    keyword: str = ""


def _call(head: str, arguments: Sequence[str | _Text], indent: int,
          suffix: str = "") -> list[str]:
    """``head(arguments)`` broken after its commas to fit the width, continuation lines
    aligned after the opening parenthesis."""
    start = " " * indent + head + "("
    margin = " " * len(start)
    lines, line, fresh = [], start, True
    for position, argument in enumerate(arguments):
        end = ")" + suffix if position == len(arguments) - 1 else ","
        code = argument if isinstance(argument, str) else (
            argument.keyword + _literal(argument.text))
        separator = "" if fresh else " "
        if len(line) + len(separator) + len(code) + len(end) <= WIDTH:
            line, fresh = line + separator + code + end, False
            continue
        if not fresh:
            lines.append(line)
            line = margin
        if len(line) + len(code) + len(end) <= WIDTH or isinstance(argument, str):
            line, fresh = line + code + end, False
            continue
        first, *rest = _keyword(argument.keyword, argument.text, len(line), end)
        lines += [line + first.lstrip(), *rest]
        line, fresh = margin, True
    if not arguments:
        return [start + ")" + suffix]
    return lines if fresh else [*lines, line]


def _keyword(keyword: str, text: str, indent: int, suffix: str) -> list[str]:
    """``keyword`` followed by ``text`` as a literal split over lines (see :func:`_string`)."""
    first, *rest = _string(text, indent + len(keyword), suffix)
    return [" " * indent + keyword + first.lstrip(), *rest]


def _string(text: str, indent: int, suffix: str) -> list[str]:
    """``text`` as string literals on consecutive lines (implicitly concatenated), each line
    within the width, broken after spaces."""
    room = WIDTH - indent - len(suffix) - 2
    words = re.findall(r"\S+\s*", text) or [text]
    chunks, chunk = [], ""
    for word in words:
        if chunk and len(json.dumps(chunk + word, ensure_ascii=False)) - 2 > room:
            chunks.append(chunk)
            chunk = ""
        chunk += word
    chunks.append(chunk)
    return [" " * indent + _literal(c) + (suffix if i == len(chunks) - 1 else "")
            for i, c in enumerate(chunks)]


def _literal(text: str) -> str:
    """A Python string literal, in double quotes unless the text holds only double quotes."""
    if '"' in text and "'" not in text and "\\" not in text and "\n" not in text:
        return f"'{text}'"
    return json.dumps(text, ensure_ascii=False)


def _literal_list(names: Iterable[object]) -> str:
    return "[" + ", ".join(_literal(getattr(n, "name", n)) for n in names) + "]"


def _revision_files(versions_dir: Path) -> list[Path]:
    return sorted(p for p in versions_dir.glob("*.py") if REVISION_FILE.match(p.name))


def _down_revision(path: Path) -> str | None:
    match = re.search(r"^down_revision = (?:\"(\w+)\"|None)$", path.read_text(), re.MULTILINE)
    if match is None:
        raise MigrationRefused(f"{path.name}: no down_revision line to keep")
    return match.group(1)

