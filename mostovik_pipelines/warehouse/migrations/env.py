"""Alembic environment: the URL comes from the caller (``mostovik db upgrade``), never a file."""

from alembic import context
from sqlalchemy import create_engine, inspect

import mostovik_pipelines.etl.quarantine  # registers the quarantine table
import mostovik_pipelines.sources  # noqa: F401 - registers every source's table
from mostovik_pipelines.etl.load_ledger import forget_digests
from mostovik_pipelines.warehouse.freeze import frozen_type
from mostovik_pipelines.warehouse.schema import metadata, partition_loads
from mostovik_pipelines.warehouse.types import ExactDecimal


def render_item(kind, item, autogen_context):
    """Autogenerate writes an exact decimal as plain SQLAlchemy: migrations import nothing of
    the project."""
    if kind == "type" and isinstance(item, ExactDecimal):
        return frozen_type(item)
    return False


database_url = context.config.attributes["database_url"]
engine = create_engine(database_url)
with engine.connect() as connection:
    context.configure(connection=connection, target_metadata=metadata,
                      render_as_batch=connection.dialect.name == "sqlite",
                      render_item=render_item)
    with context.begin_transaction():
        before = context.get_context().get_current_revision()
        context.run_migrations()
        if context.get_context().get_current_revision() != before and inspect(
            connection
        ).has_table(partition_loads.name):
            # A migration may have changed stored values without the loader: no partition's
            # digest describes its rows for sure any more (mostovik_pipelines.etl.load_ledger).
            forget_digests(connection)
    connection.commit()
engine.dispose()
