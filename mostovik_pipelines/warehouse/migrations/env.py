"""Alembic environment: the URL comes from the caller (``mostovik db upgrade``), never a file."""

from alembic import context
from sqlalchemy import create_engine

import mostovik_pipelines.etl.quarantine  # registers the quarantine table
import mostovik_pipelines.sources  # noqa: F401 - registers every source's table
from mostovik_pipelines.warehouse.schema import metadata

database_url = context.config.attributes["database_url"]
engine = create_engine(database_url)
with engine.connect() as connection:
    context.configure(connection=connection, target_metadata=metadata,
                      render_as_batch=connection.dialect.name == "sqlite")
    with context.begin_transaction():
        context.run_migrations()
    connection.commit()
engine.dispose()
