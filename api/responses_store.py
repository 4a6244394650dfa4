"""Recent responses kept in memory (``ResponseStore``), so that a follow-up can name one as
its ``previous_response_id`` and a client can read one back (``GET /v1/responses/{id}``).

Bounded by count and by an estimate of their size: the oldest go first. A response is kept
for the API key that made it (its index among the server's keys; None without keys) and is
found only by the same key. Only the HTTP app's Trio thread touches it: no lock.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from ..engine.vocabulary.prompt import ChatMessage

MAX_STORED_RESPONSES = 1024
MAX_STORED_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class StoredResponse:
    """A response as its follow-ups continue from it: ``turns``, the chat it answered
    (without its instructions, which do not carry over) and its reply; ``body``, the response
    object as it was answered."""

    owner: int | None
    turns: tuple[ChatMessage, ...]
    body: dict[str, Any]
    num_bytes: int


def stored(
    owner: int | None, turns: tuple[ChatMessage, ...], body: dict[str, Any]
) -> StoredResponse:
    """A response to keep, with its size estimated: its body's JSON and its turns' text."""
    text = sum(len(t.content) + sum(len(c.arguments) for c in t.tool_calls) for t in turns)
    return StoredResponse(owner, turns, body, len(json.dumps(body)) + text)


class ResponseStore:
    """The most recent responses kept (``put``), by id, within ``max_count`` and
    ``max_bytes``."""

    def __init__(
        self, max_count: int = MAX_STORED_RESPONSES, max_bytes: int = MAX_STORED_BYTES
    ) -> None:
        self.max_count = max_count
        self.max_bytes = max_bytes
        self._responses: OrderedDict[str, StoredResponse] = OrderedDict()
        self.num_bytes = 0

    def __len__(self) -> int:
        return len(self._responses)

    def put(self, response_id: str, response: StoredResponse) -> None:
        """Keep ``response``, dropping the oldest while over a bound; one larger than
        ``max_bytes`` by itself is not kept."""
        if response.num_bytes > self.max_bytes:
            return
        self.delete(response_id, response.owner)
        self._responses[response_id] = response
        self.num_bytes += response.num_bytes
        while len(self._responses) > self.max_count or self.num_bytes > self.max_bytes:
            _, oldest = self._responses.popitem(last=False)
            self.num_bytes -= oldest.num_bytes

    def get(self, response_id: str, owner: int | None) -> StoredResponse | None:
        """The response kept as ``response_id`` for ``owner``; None if none is."""
        response = self._responses.get(response_id)
        return response if response is not None and response.owner == owner else None

    def delete(self, response_id: str, owner: int | None) -> bool:
        """Forget ``owner``'s response ``response_id``; whether there was one."""
        response = self.get(response_id, owner)
        if response is None:
            return False
        del self._responses[response_id]
        self.num_bytes -= response.num_bytes
        return True
