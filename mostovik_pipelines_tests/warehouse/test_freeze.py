"""Freezing a declared table into a migration: what cannot be written as plain DDL is refused
with the column and the fix, never left out silently."""

from __future__ import annotations

import pytest
from sqlalchemy import Column, Integer, String, text

from mostovik_pipelines.sources import ALL_SOURCES
from mostovik_pipelines.warehouse.freeze import MigrationRefused, migration_source
from mostovik_pipelines.warehouse.schema import warehouse_table


@pytest.mark.parametrize("source", ALL_SOURCES, ids=lambda source: source.name)
def test_every_source_table_freezes(source):
    frozen = migration_source(source.table, "probe", "0099", "0098")
    assert f'"{source.table.name}"' in frozen and "mostovik_pipelines" not in frozen.split(
        '"""')[2]


@pytest.mark.parametrize(("column", "named"), [
    (Column("code", String(8), nullable=False, server_default=text("'x'")), "server_default"),
    (Column("code", String(8), nullable=False, default="x"), "default"),
])
def test_what_a_migration_would_not_carry_is_refused_naming_the_column(column, named):
    table = warehouse_table(f"probe_{named.replace(' ', '_')}", column,
                            Column("n", Integer, nullable=True), natural_key=("code",))
    with pytest.raises(MigrationRefused, match=f"column code: {named} would not be written"):
        migration_source(table, "probe", "0099", "0098")
