"""The first schema: responses, conversations and their items, files, batches and their results.

Revision ID: 0001
"""

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None

_ID = sa.String(64)
_SEQ = sa.BigInteger().with_variant(sa.Integer, "sqlite")  # SQLite autoincrements an INTEGER primary key only


def upgrade() -> None:
    op.create_table(
        "responses",
        sa.Column("id", _ID, primary_key=True),
        sa.Column("owner", _ID, nullable=False),
        sa.Column("created_at", sa.Integer, nullable=False),
        sa.Column("expires_at", sa.Integer),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("previous_response_id", _ID),
        sa.Column("conversation_id", _ID),
        sa.Column("input_items", sa.JSON, nullable=False),
        sa.Column("response", sa.JSON, nullable=False),
        sa.Column("background", sa.Boolean, nullable=False),
        sa.Column("worker", _ID),
        sa.Column("lease_until", sa.Float),
        sa.Column("cancel_requested", sa.Boolean, nullable=False),
        sa.Column("bytes", sa.BigInteger, nullable=False),
    )
    op.create_index("responses_owner", "responses", ["owner", "created_at"])
    op.create_index("responses_expiry", "responses", ["expires_at"])
    op.create_index("responses_running", "responses", ["status", "lease_until"])

    op.create_table(
        "conversations",
        sa.Column("id", _ID, primary_key=True),
        sa.Column("owner", _ID, nullable=False),
        sa.Column("created_at", sa.Integer, nullable=False),
        sa.Column("metadata", sa.JSON, nullable=False),
    )
    op.create_index("conversations_owner", "conversations", ["owner"])
    op.create_table(
        "conversation_items",
        sa.Column("seq", _SEQ, primary_key=True, autoincrement=True),
        sa.Column("id", _ID, nullable=False, unique=True),
        sa.Column("conversation_id", _ID, sa.ForeignKey("conversations.id", ondelete="CASCADE"), nullable=False),
        sa.Column("owner", _ID, nullable=False),
        sa.Column("created_at", sa.Integer, nullable=False),
        sa.Column("item", sa.JSON, nullable=False),
        sa.Column("bytes", sa.BigInteger, nullable=False),
    )
    op.create_index("conversation_items_order", "conversation_items", ["conversation_id", "seq"])
    op.create_index("conversation_items_owner", "conversation_items", ["owner"])

    op.create_table(
        "files",
        sa.Column("id", _ID, primary_key=True),
        sa.Column("owner", _ID, nullable=False),
        sa.Column("created_at", sa.Integer, nullable=False),
        sa.Column("expires_at", sa.Integer),
        sa.Column("purpose", sa.String(32), nullable=False),
        sa.Column("filename", sa.String(512), nullable=False),
        sa.Column("bytes", sa.BigInteger, nullable=False),
        sa.Column("content", sa.LargeBinary, nullable=False),
    )
    op.create_index("files_owner", "files", ["owner", "created_at"])

    op.create_table(
        "batches",
        sa.Column("id", _ID, primary_key=True),
        sa.Column("owner", _ID, nullable=False),
        sa.Column("created_at", sa.Integer, nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("endpoint", _ID, nullable=False),
        sa.Column("input_file_id", _ID, nullable=False),
        sa.Column("batch", sa.JSON, nullable=False),
        sa.Column("worker", _ID),
        sa.Column("lease_until", sa.Float),
    )
    op.create_index("batches_owner", "batches", ["owner", "created_at"])
    op.create_index("batches_runnable", "batches", ["status", "lease_until"])
    op.create_table(
        "batch_results",
        sa.Column("batch_id", _ID, sa.ForeignKey("batches.id", ondelete="CASCADE"), primary_key=True),
        sa.Column("line", sa.Integer, primary_key=True),
        sa.Column("custom_id", sa.String(512), nullable=False),
        sa.Column("error", sa.Boolean, nullable=False),
        sa.Column("result", sa.JSON, nullable=False),
        sa.UniqueConstraint("batch_id", "custom_id", name="batch_results_once"),
    )


def downgrade() -> None:
    for table in ("batch_results", "batches", "files", "conversation_items", "conversations", "responses"):
        op.drop_table(table)
