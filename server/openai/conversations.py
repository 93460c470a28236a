"""/v1/conversations: OpenAI's Conversations API over the state database (server/state/conversations.py).

A conversation is its metadata and its items; a response created with `conversation` renders the items before its
input and adds its input and output items after it (server/openai/responses.py). Items are checked as a response's
input items are, so that every stored item renders; each gets an id of its own (msg_..., fc_..., as OpenAI's). The
limits are OpenAI's: 20 items a call, 16 metadata pairs, keys of 64 characters and values of 512 at most.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Query, Request
from pydantic import BaseModel, ConfigDict, Field

from server.openai.errors import ERROR_RESPONSES, APIError, invalid_request
from server.openai.responses_input import check_storable, stored_items
from server.openai.responses_schemas import InputItem
from server.state import conversations
from server.state.keys import request_owner
from server.state.stored import StoredState, list_page

MAX_ITEMS = 20
"""Items one call adds at most (creating a conversation, or adding to it)."""
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512

_INCLUDE = Query(description="Accepted; items are always listed whole.")


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class CreateConversationRequest(_Body):
    items: list[InputItem] | None = Field(None, description="Its first items (20 at most).")
    metadata: dict[str, str] | None = Field(None, description="16 pairs at most: keys of 64 characters, values of 512.")
    safety_identifier: str | None = None


class UpdateConversationRequest(_Body):
    metadata: dict[str, str] | None = Field(description="Replaces the conversation's metadata.")


class AddItemsRequest(_Body):
    items: list[InputItem] = Field(description="Added after the conversation's last item (20 at most).")


def conversation_not_found(conversation_id: str, param: str | None = None) -> APIError:
    """A conversation that does not exist, or is another key's (the same answer)."""
    return APIError(404, f"Conversation with id '{conversation_id}' not found.", param=param, code="not_found")


def _item_not_found(item_id: str) -> APIError:
    return APIError(404, f"Item with id '{item_id}' not found.", param="item_id", code="not_found")


def _checked_metadata(metadata: dict[str, str] | None) -> dict[str, str]:
    metadata = metadata or {}
    if len(metadata) > MAX_METADATA_PAIRS:
        raise invalid_request(f"'metadata' holds {MAX_METADATA_PAIRS} pairs at most, not {len(metadata)}.", "metadata")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY:
            raise invalid_request(f"A metadata key is {MAX_METADATA_KEY} characters at most.", f"metadata.{key}")
        if len(value) > MAX_METADATA_VALUE:
            raise invalid_request(f"A metadata value is {MAX_METADATA_VALUE} characters at most.", f"metadata.{key}")
    return metadata


def _checked_items(items: list[InputItem], takes_images: bool) -> list[dict[str, Any]]:
    """The items as stored, or a 400 naming the first the server could not render."""
    if len(items) > MAX_ITEMS:
        raise invalid_request(f"At most {MAX_ITEMS} items are added at a time, not {len(items)}.", "items")
    check_storable(items, "items", takes_images)
    return stored_items(items)


def add_conversation_routes(app: FastAPI, stored: StoredState, takes_images: Callable[[], bool]) -> None:
    """`takes_images`: whether the model served now takes images (an image model's items may hold them)."""

    @app.post("/v1/conversations", responses=ERROR_RESPONSES)
    async def create_conversation(body: CreateConversationRequest, request: Request) -> dict[str, Any]:
        metadata = _checked_metadata(body.metadata)
        items = _checked_items(body.items or [], takes_images())
        async with stored.db().transaction() as connection:
            return await conversations.create(connection, stored, request_owner(request), metadata, items)

    @app.get("/v1/conversations/{conversation_id}", responses=ERROR_RESPONSES)
    async def retrieve_conversation(conversation_id: str, request: Request) -> dict[str, Any]:
        async with stored.db().transaction() as connection:
            conversation = await conversations.get(connection, request_owner(request), conversation_id)
        if conversation is None:
            raise conversation_not_found(conversation_id)
        return conversation

    @app.post("/v1/conversations/{conversation_id}", responses=ERROR_RESPONSES)
    async def update_conversation(
        conversation_id: str, body: UpdateConversationRequest, request: Request
    ) -> dict[str, Any]:
        """Replace the conversation's metadata."""
        metadata = _checked_metadata(body.metadata)
        owner = request_owner(request)
        async with stored.db().transaction() as connection:
            conversation = await conversations.set_metadata(connection, owner, conversation_id, metadata)
        if conversation is None:
            raise conversation_not_found(conversation_id)
        return conversation

    @app.delete("/v1/conversations/{conversation_id}", responses=ERROR_RESPONSES)
    async def delete_conversation(conversation_id: str, request: Request) -> dict[str, Any]:
        """Delete the conversation and its items (the responses that were in it stay)."""
        async with stored.db().transaction() as connection:
            if not await conversations.remove(connection, request_owner(request), conversation_id):
                raise conversation_not_found(conversation_id)
        return {"id": conversation_id, "object": "conversation.deleted", "deleted": True}

    @app.post("/v1/conversations/{conversation_id}/items", responses=ERROR_RESPONSES)
    async def add_items(
        conversation_id: str,
        body: AddItemsRequest,
        request: Request,
        include: Annotated[list[str] | None, _INCLUDE] = None,
    ) -> dict[str, Any]:
        """Add items after the conversation's last; the list of those added."""
        owner = request_owner(request)
        items = _checked_items(body.items, takes_images())
        async with stored.db().transaction() as connection:
            if await conversations.get(connection, owner, conversation_id) is None:
                raise conversation_not_found(conversation_id)
            await conversations.append(connection, stored, owner, conversation_id, items)
        return list_page(items, False)

    @app.get("/v1/conversations/{conversation_id}/items", responses=ERROR_RESPONSES)
    async def list_items(
        conversation_id: str,
        request: Request,
        after: str | None = None,
        limit: int = Query(20, ge=1, le=100),
        order: Literal["asc", "desc"] = "desc",
        include: Annotated[list[str] | None, _INCLUDE] = None,
    ) -> dict[str, Any]:
        """The conversation's items, newest first (`order=asc`: oldest first), paged."""
        owner = request_owner(request)
        async with stored.db().transaction() as connection:
            if await conversations.get(connection, owner, conversation_id) is None:
                raise conversation_not_found(conversation_id)
            data, more = await conversations.listed(connection, owner, conversation_id, after, limit, order == "asc")
        return list_page(data, more)

    @app.get("/v1/conversations/{conversation_id}/items/{item_id}", responses=ERROR_RESPONSES)
    async def retrieve_item(
        conversation_id: str, item_id: str, request: Request, include: Annotated[list[str] | None, _INCLUDE] = None
    ) -> dict[str, Any]:
        owner = request_owner(request)
        async with stored.db().transaction() as connection:
            if await conversations.get(connection, owner, conversation_id) is None:
                raise conversation_not_found(conversation_id)
            item = await conversations.item(connection, owner, conversation_id, item_id)
        if item is None:
            raise _item_not_found(item_id)
        return item

    @app.delete("/v1/conversations/{conversation_id}/items/{item_id}", responses=ERROR_RESPONSES)
    async def delete_item(conversation_id: str, item_id: str, request: Request) -> dict[str, Any]:
        """Delete an item; the conversation it was in."""
        owner = request_owner(request)
        async with stored.db().transaction() as connection:
            conversation = await conversations.get(connection, owner, conversation_id)
            if conversation is None:
                raise conversation_not_found(conversation_id)
            if not await conversations.remove_item(connection, owner, conversation_id, item_id):
                raise _item_not_found(item_id)
        return conversation
