"""Bodies that cost the server seconds and their sender nothing (issue 34): 60,000 tiny
messages, or text far over the context, are refused before pydantic and the chat template
see them."""

from __future__ import annotations

import pytest

from mlx_trio.actors.config import RuntimeConfig
from mlx_trio.api.http_endpoints import MAX_MESSAGES
from mlx_trio.api.http_state import HttpSettings
from mlx_trio.engine.errors import ContextLengthExceededError
from mlx_trio.engine.params import SamplingParams
from mlx_trio.engine.vocabulary.prompt import ChatMessage
from tests.server_thread import model_id, scripted_server
from tests.tiny import make_preparer


@pytest.fixture(scope="module")
def server():
    with scripted_server(RuntimeConfig(max_batch=4), HttpSettings()) as running:
        yield running


def test_too_many_messages_are_a_400_naming_messages(server, client):
    messages = [{"role": "user", "content": "a"}] * (MAX_MESSAGES + 1)
    reply = client.post(
        "/v1/chat/completions", json={"model": model_id(server), "messages": messages}
    )
    assert reply.status_code == 400
    assert reply.json()["error"]["param"] == "messages"
    assert f"at most {MAX_MESSAGES} messages" in reply.json()["error"]["message"]


def test_text_far_over_the_context_is_refused_before_rendering(monkeypatch):
    preparer = make_preparer()
    rendered: list[object] = []
    monkeypatch.setattr(preparer.tokenizer, "apply_chat_template", rendered.append)
    many = [ChatMessage("user", "x" * 100)] * (preparer.context_length * 32 // 100 + 1)
    with pytest.raises(ContextLengthExceededError, match=r"far more than that many tokens"):
        preparer.prepare(many, SamplingParams(max_tokens=4))
    assert rendered == []  # the template never ran
