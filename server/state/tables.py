"""The schema: one table per stored object, each row owned by an API key (`owner`: keys.py's id of the key).

Payloads the OpenAI API defines (a response, an item, a batch's request counts) are JSON columns, so a field
OpenAI adds is stored without a migration; what is searched or filtered on (owner, status, times) is a column.
The migrations under migrations/versions/ create exactly these tables; a change here is a new migration there.
"""

from __future__ import annotations

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Column,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    UniqueConstraint,
)

metadata = MetaData()

responses = Table(
    "responses",
    metadata,
    Column("id", String(64), primary_key=True),
    Column("owner", String(64), nullable=False),
    Column("created_at", Integer, nullable=False),
    # None: kept until deleted (`--store-retention-days 0`).
    Column("expires_at", Integer),
    Column("status", String(16), nullable=False),
    Column("previous_response_id", String(64)),
    Column("conversation_id", String(64)),
    # This turn's input, as items (the earlier turns are the previous response's).
    Column("input_items", JSON, nullable=False),
    # The response object as the API returns it.
    Column("response", JSON, nullable=False),
    Column("background", Boolean, nullable=False, default=False),
    # The replica running a background response; with `lease_until`, how a replica that died is noticed.
    Column("worker", String(64)),
    Column("lease_until", Float),
    Column("cancel_requested", Boolean, nullable=False, default=False),
    Column("bytes", BigInteger, nullable=False),
    Index("responses_owner", "owner", "created_at"),
    Index("responses_expiry", "expires_at"),
    Index("responses_running", "status", "lease_until"),
)

conversations = Table(
    "conversations",
    metadata,
    Column("id", String(64), primary_key=True),
    Column("owner", String(64), nullable=False),
    Column("created_at", Integer, nullable=False),
    Column("metadata", JSON, nullable=False),
    Index("conversations_owner", "owner"),
)

response_events = Table(
    "response_events",
    metadata,
    # The stream events of a background response created with `stream` (what GET ?stream=true replays), deleted
    # with their response.
    Column("response_id", String(64), primary_key=True),
    Column("sequence_number", Integer, primary_key=True),
    Column("event", JSON, nullable=False),
)

conversation_items = Table(
    "conversation_items",
    metadata,
    # The items' order in their conversation (ascending as they were added).
    Column("seq", BigInteger().with_variant(Integer, "sqlite"), primary_key=True, autoincrement=True),
    Column("id", String(64), nullable=False, unique=True),
    Column("conversation_id", String(64), ForeignKey("conversations.id", ondelete="CASCADE"), nullable=False),
    Column("owner", String(64), nullable=False),
    Column("created_at", Integer, nullable=False),
    Column("item", JSON, nullable=False),
    Column("bytes", BigInteger, nullable=False),
    Index("conversation_items_order", "conversation_id", "seq"),
    Index("conversation_items_owner", "owner"),
)

files = Table(
    "files",
    metadata,
    Column("id", String(64), primary_key=True),
    Column("owner", String(64), nullable=False),
    Column("created_at", Integer, nullable=False),
    Column("expires_at", Integer),
    Column("purpose", String(32), nullable=False),
    Column("filename", String(512), nullable=False),
    Column("bytes", BigInteger, nullable=False),
    Column("content", LargeBinary, nullable=False),
    Index("files_owner", "owner", "created_at"),
)

batches = Table(
    "batches",
    metadata,
    Column("id", String(64), primary_key=True),
    Column("owner", String(64), nullable=False),
    Column("created_at", Integer, nullable=False),
    Column("status", String(16), nullable=False),
    Column("endpoint", String(64), nullable=False),
    Column("input_file_id", String(64), nullable=False),
    # The batch object as the API returns it (its times, counts, output and error files).
    Column("batch", JSON, nullable=False),
    # The replica running it; with `lease_until`, how a batch whose replica died is taken over and resumed.
    Column("worker", String(64)),
    Column("lease_until", Float),
    Index("batches_owner", "owner", "created_at"),
    Index("batches_runnable", "status", "lease_until"),
)

batch_results = Table(
    "batch_results",
    metadata,
    Column("batch_id", String(64), ForeignKey("batches.id", ondelete="CASCADE"), primary_key=True),
    # The request's line in the input file: the output file keeps the input's order.
    Column("line", Integer, primary_key=True),
    Column("custom_id", String(512), nullable=False),
    Column("error", Boolean, nullable=False),
    # The output (or error) file's line for it, as JSON.
    Column("result", JSON, nullable=False),
    UniqueConstraint("batch_id", "custom_id", name="batch_results_once"),
)
"""One row per finished request of a batch: recorded once, keyed by its `custom_id`, whatever restarts."""
