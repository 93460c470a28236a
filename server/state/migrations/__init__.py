"""Alembic's migrations of the state database (server/state/tables.py's schema), applied at start-up."""
