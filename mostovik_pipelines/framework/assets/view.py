"""How a source's asset reads in the Dagster UI: what its table holds and what each load did.

* the asset: its description and owners, kinds (the warehouse's storage and the source's
  protocol), group per job kind, and the table's column schema (``dagster/column_schema``: type,
  comment, nullability, the natural key);
* each partition's materialisation: the load's figures (rows, inserted, updated, unchanged,
  deleted, rejected...), its duration, the payload's size and content hash, and a preview of a
  few rows. Numbers are plain int/float metadata, which the UI plots across partitions.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

from dagster import (
    MetadataValue,
    TableColumn,
    TableColumnConstraints,
    TableConstraints,
    TableSchema,
)
from sqlalchemy import Table
from sqlalchemy.dialects import postgresql

from mostovik_pipelines.framework.spec import SourceSpec

if TYPE_CHECKING:
    import pandas as pd

WAREHOUSE_KIND = "postgres"
"""The production warehouse's storage (the local demo's SQLite has the same tables)."""
PREVIEW_ROWS = 5
CELL_CHARACTERS = 60


def asset_kinds(spec: SourceSpec) -> set[str]:
    return {WAREHOUSE_KIND, spec.protocol}


def asset_metadata(spec: SourceSpec) -> dict[str, Any]:
    """The asset's own metadata: its table, natural key, load mode and column schema."""
    return {
        "dagster/table_name": spec.table.name,
        "dagster/column_schema": column_schema(spec.table, spec.natural_key),
        "mostovik/natural_key": ", ".join(spec.natural_key),
        "mostovik/load_mode": spec.load_mode.value,
    }


def column_schema(table: Table, natural_key: Sequence[str]) -> TableSchema:
    """The table's columns as PostgreSQL types them, with their comments; the natural key as a
    constraint (and ``unique`` on a one-column key)."""
    dialect = postgresql.dialect()
    return TableSchema(
        columns=[
            TableColumn(
                name=column.name,
                type=str(column.type.compile(dialect=dialect)).lower(),
                description=column.comment,
                constraints=TableColumnConstraints(
                    nullable=bool(column.nullable),
                    unique=tuple(natural_key) == (column.name,),
                ),
            )
            for column in table.columns
        ],
        constraints=TableConstraints(other=[f"natural key: unique ({', '.join(natural_key)})"]),
    )


def preview(frame: pd.DataFrame) -> MetadataValue:
    """The first rows of a loaded frame, as a small Markdown table."""
    head = frame.head(PREVIEW_ROWS)
    return MetadataValue.md(markdown_table(list(head.columns),
                                           head.itertuples(index=False, name=None)))


def markdown_table(columns: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    lines += ["| " + " | ".join(_cell(value) for value in row) + " |" for row in rows]
    return "\n".join(lines)


def _cell(value: Any) -> str:
    import pandas as pd  # a step's frames: loaded already (declaring the asset needs none)

    text = "" if value is None or (not isinstance(value, str) and pd.isna(value)) else str(value)
    text = text.replace("|", "\\|").replace("\r", " ").replace("\n", " ")
    return text if len(text) <= CELL_CHARACTERS else text[:CELL_CHARACTERS - 1] + "…"
