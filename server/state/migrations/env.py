"""Alembic's entry: migrate over the connection server/state/database.py passes in (no alembic.ini, no URL)."""

from alembic import context

from server.state.tables import metadata

context.configure(
    connection=context.config.attributes["connection"],
    target_metadata=metadata,
    render_as_batch=True,  # SQLite alters a table by copying it: alembic's batch mode does that
)
with context.begin_transaction():
    context.run_migrations()
