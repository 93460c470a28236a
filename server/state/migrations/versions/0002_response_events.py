"""The stream events of background responses created with `stream`, for GET /v1/responses/{id}?stream=true.

Revision ID: 0002
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "response_events",
        sa.Column("response_id", sa.String(64), primary_key=True),
        sa.Column("sequence_number", sa.Integer, primary_key=True),
        sa.Column("event", sa.JSON, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("response_events")
