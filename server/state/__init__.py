"""State that outlives a request: stored responses and conversations, files and batches, in one database.

An embedded SQLite file by default (`--state-dir`), a PostgreSQL server by `--database-url` for replicas that
share it. `database.py` opens it and applies the schema's migrations at start-up; `tables.py` is the schema; every
object belongs to the API key that made it (`keys.py`). Nothing here is kept only in process memory: what a
restart or another replica must see is a row.
"""
