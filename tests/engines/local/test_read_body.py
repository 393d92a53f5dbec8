"""``read_body``: the one reader of an ASGI request's body, shared by the reference server, the
training service and the token-capture proxy."""

from __future__ import annotations

from typing import Any, cast

import pytest

from engines.local.http import BodyTooLarge, read_body


def _receive(*messages: dict[str, Any]) -> tuple[Any, list[dict[str, Any]]]:
    """An ASGI ``receive`` that hands out ``messages`` in turn, and the list of those left."""
    queue = list(messages)

    async def receive() -> dict[str, Any]:
        return queue.pop(0)

    return cast(Any, receive), queue


async def test_the_body_is_its_chunks_joined_in_order():
    receive, left = _receive(
        {"type": "http.request", "body": b"ab", "more_body": True},
        {"type": "http.request", "more_body": True},  # a message without a body
        {"type": "http.request", "body": b"cd", "more_body": False},
        {"type": "http.request", "body": b"never read"},
    )
    assert await read_body(receive) == b"abcd"
    assert len(left) == 1


async def test_a_disconnect_before_the_end_is_none():
    receive, _ = _receive(
        {"type": "http.request", "body": b"ab", "more_body": True}, {"type": "http.disconnect"}
    )
    assert await read_body(receive) is None


async def test_past_the_limit_it_stops_reading_and_says_the_limit():
    receive, left = _receive(
        {"type": "http.request", "body": b"12345", "more_body": True},
        {"type": "http.request", "body": b"6", "more_body": True},
        {"type": "http.request", "body": b"7", "more_body": False},
    )
    with pytest.raises(BodyTooLarge, match="request body over 5 bytes"):
        await read_body(receive, limit=5)
    assert len(left) == 1  # the rest is not read
    exact, _ = _receive({"type": "http.request", "body": b"12345"})
    assert await read_body(exact, limit=5) == b"12345"  # at the limit: accepted
