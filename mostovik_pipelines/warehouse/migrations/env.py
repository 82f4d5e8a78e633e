"""Alembic environment: the URL comes from the caller (``mostovik db upgrade``), never a file.

Migrations are frozen history, and so is what runs them: nothing of the project is imported
here (today's sources and helpers must not decide how an old schema is replayed). New
migrations are written by ``mostovik new-source`` (:mod:`mostovik_pipelines.warehouse.freeze`),
not by autogenerate against this environment.
"""

from alembic import context
from sqlalchemy import create_engine, inspect, text

PARTITION_LOADS = "partition_loads"
FORGET_DIGESTS = text(
    f"UPDATE {PARTITION_LOADS} SET content_digest = NULL WHERE content_digest IS NOT NULL")
"""A migration may have changed stored values without the loader: no partition's digest
describes its rows for sure any more (mostovik_pipelines.framework.load.ledger), so every next load
compares the stored rows."""

database_url = context.config.attributes["database_url"]
engine = create_engine(database_url)
with engine.connect() as connection:
    context.configure(connection=connection, target_metadata=None,
                      render_as_batch=connection.dialect.name == "sqlite")
    with context.begin_transaction():
        before = context.get_context().get_current_revision()
        context.run_migrations()
        if (context.get_context().get_current_revision() != before
                and inspect(connection).has_table(PARTITION_LOADS)):
            connection.execute(FORGET_DIGESTS)
    connection.commit()
engine.dispose()
