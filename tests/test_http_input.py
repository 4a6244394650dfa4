"""Bad input over the real HTTP server: bodies that break the JSON parser or the tokenizer, the
``param`` of every 400 the edge gives, and the last-resort answer to a bug (a 500 in OpenAI's
shape, logged, never Starlette's text/plain)."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import httpx
import pytest

from mlx_trio.actors.config import RuntimeConfig
from mlx_trio.actors.testing.scripted import Script, ScriptedEngine
from mlx_trio.api import field_names
from mlx_trio.api.http_state import HttpSettings
from mlx_trio.api.schemas import ChatCompletionRequest
from mlx_trio.engine.params import PreparedRequest, SamplingParams
from mlx_trio.engine.vocabulary.prompt import Prompt
from tests.server_thread import ServerThread, scripted_server
from tests.test_http import MODEL, chat_body, stats, wait_for

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    with scripted_server(
        RuntimeConfig(max_batch=8, max_live=64, max_queued=64),
        HttpSettings(max_body_bytes=1024 * 1024, max_n=4),
    ) as running:
        yield running


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def raw_chat(content_json: str, extra: str = "") -> bytes:
    """A chat body with ``content_json`` as the message's content, written by hand."""
    messages = f'[{{"role": "user", "content": {content_json}}}]'
    return f'{{"model": "{MODEL}", "messages": {messages}{extra}}}'.encode()


def assert_openai_error(reply: httpx.Response, status: int, param: str | None) -> dict:
    assert reply.status_code == status, reply.text
    assert reply.headers["content-type"] == "application/json"
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    return error


# -- bodies that break the parser or the tokenizer ----------------------------------------


@pytest.mark.parametrize(
    ("path", "content", "param", "message"),
    [
        (
            CHAT,
            f'{{"model": "{MODEL}", "messages": {nested(100_000)}}}'.encode(),
            None,
            "request body is nested more than 64 levels deep",
        ),
        (
            COMPLETIONS,
            nested(100_000).encode(),
            None,
            "request body is nested more than 64 levels deep",
        ),
        (
            CHAT,
            raw_chat('"hi"', f', "extra": {nested(64)}'),
            None,
            "request body is nested more than 64 levels deep",
        ),
        (
            CHAT,
            raw_chat('"hi"', ', "seed": ' + "9" * 5000),
            None,
            "request body holds an integer of more than 4300 digits",
        ),
        (
            CHAT,
            raw_chat('"a \\ud800 b"'),
            "messages.[0].content",
            "request body holds a lone UTF-16 surrogate (a \\ud800-\\udfff escape not in a "
            "pair) in messages.[0].content; strings must be valid Unicode",
        ),
        (
            CHAT,
            raw_chat('[{"type": "text", "text": "\\udfff"}]'),
            "messages.[0].content.[0].text",
            None,
        ),
        (CHAT, raw_chat('"hi"', ', "stop": ["ok", "\\ud83d"]'), "stop.[1]", None),
        (CHAT, raw_chat('"hi"', ', "logit_bias": {"\\udc00": 1}'), "logit_bias", None),
        (CHAT, raw_chat('"hi"', ', "user": "\\ud800"'), "user", None),
        (CHAT, b'{"model": "\\ud800", "messages": []}', "model", None),
        (COMPLETIONS, f'{{"model": "{MODEL}", "prompt": "\\ud800"}}'.encode(), "prompt", None),
        (
            COMPLETIONS,
            f'{{"model": "{MODEL}", "prompt": ["ok", "x\\udbff"]}}'.encode(),
            "prompt.[1]",
            None,
        ),
    ],
    ids=[
        "100000-deep",
        "100000-deep-top-level",
        "65-deep-in-an-ignored-field",
        "5000-digit-integer",
        "surrogate-in-content",
        "surrogate-in-a-content-part",
        "surrogate-in-stop",
        "surrogate-in-a-key",
        "surrogate-in-an-ignored-field",
        "surrogate-as-model",
        "surrogate-in-prompt",
        "surrogate-in-a-prompt-list",
    ],
)
def test_bodies_that_break_the_parser_or_tokenizer_get_400(client, path, content, param, message):
    before = stats(client)
    reply = client.post(path, content=content, headers={"content-type": "application/json"})
    error = assert_openai_error(reply, 400, param)
    assert error["type"] == "invalid_request_error"
    if message is not None:
        assert error["message"] == message
    assert stats(client)["rows_submitted"] == before["rows_submitted"]


def test_64_levels_and_a_surrogate_pair_are_fine(client):
    content = raw_chat('"smile \\ud83d\\ude00"', f', "extra": {nested(63)}')
    reply = client.post(CHAT, content=content, headers={"content-type": "application/json"})
    assert reply.status_code == 200, reply.text


# -- every 400 names the parameter the client sent -----------------------------------------


def completion_body(**extra: object) -> dict:
    return {"model": MODEL, "prompt": "hi", "max_tokens": 2} | extra


BAD_PARAMS = [
    (chat_body(timeout=-1), "timeout"),
    (chat_body(timeout=0), "timeout"),
    (completion_body(timeout=-0.5), "timeout"),
    (chat_body(max_tokens=0), "max_tokens"),
    (chat_body(max_completion_tokens=0), "max_completion_tokens"),
    (chat_body(max_completion_tokens=-1, max_tokens=5), "max_completion_tokens"),
    (chat_body(max_completion_tokens="x"), "max_completion_tokens"),
    (chat_body(max_completion_tokens=100_000), "messages"),  # context_length_exceeded
    (completion_body(max_tokens=100_000), "prompt"),  # context_length_exceeded
    (chat_body(stop=5), "stop"),
    (chat_body(stop=["a", 5]), "stop.[1]"),
    (chat_body(stop=["a", "b", "c", "d", "e"]), "stop"),
    (chat_body(stop=""), "stop"),
    (chat_body(logit_bias={"x": 1}), "logit_bias"),
    (chat_body(logit_bias={"5": "a"}), "logit_bias"),
    (chat_body(logit_bias={"5": 500}), "logit_bias"),
    (chat_body(logit_bias=[1]), "logit_bias"),
    (chat_body(logprobs=True, top_logprobs=21), "top_logprobs"),
    (chat_body(top_logprobs=2), "top_logprobs"),
    (chat_body(logprobs=True, top_logprobs="a"), "top_logprobs"),
    (chat_body(n="a"), "n"),
    (chat_body(n=1.5), "n"),
    (chat_body(seed=-1), "seed"),
    (chat_body(seed=1.5), "seed"),
    (chat_body(seed=2**64), "seed"),
    (chat_body(stream_options={"include_usage": "yes"}), "stream_options.include_usage"),
    (chat_body(stream_options=5), "stream_options"),
    (chat_body(temperature="hot"), "temperature"),
    (chat_body(model=5), "model"),
    ({"model": MODEL}, "messages"),
    (chat_body(messages="hi"), "messages"),
    (chat_body(messages=[{"role": "user", "content": 5}]), "messages.[0].content"),
    (chat_body(messages=[{"role": "user"}, {"content": "x"}]), "messages.[1].role"),
    (
        chat_body(messages=[{"role": "user", "content": [{"type": "image_url"}]}]),
        "messages.[0].content.[0].image_url",
    ),
    (completion_body(logprobs=50), "logprobs"),
    (completion_body(logprobs=-1), "logprobs"),
    (completion_body(prompt=5), "prompt"),
    (completion_body(prompt=["a", 5]), "prompt.[1]"),
    (completion_body(max_tokens=0), "max_tokens"),
    (completion_body(echo=True), "echo"),
]


@pytest.mark.parametrize(("body", "param"), BAD_PARAMS, ids=[p for _, p in BAD_PARAMS])
def test_each_bad_value_gets_400_naming_its_param(client, body, param):
    path = COMPLETIONS if "prompt" in body else CHAT
    reply = client.post(path, json=body)
    error = assert_openai_error(reply, 400, param)
    assert error["type"] == "invalid_request_error"
    context = error["code"] == "context_length_exceeded"
    assert error["message"].startswith(param.split(".")[0]) or context


# -- the last resort ------------------------------------------------------------------------


class TokenizerBug(ScriptedEngine):
    """A scripted engine whose tokenizer raises on one prompt, as a real one may on input the
    edge let through."""

    async def prepare(self, prompt: Prompt, params: SamplingParams) -> PreparedRequest:
        if prompt == "boom":
            raise TypeError("TextEncodeInput must be Union[TextInputSequence, ...]")
        return await super().prepare(prompt, params)


def test_an_unexpected_exception_is_a_logged_500_in_openai_shape(caplog):
    with ServerThread(engine=TokenizerBug(Script(step_s=0.002))) as server:
        wait_for(lambda: httpx.get(f"{server.url}/health").status_code == 200)
        with caplog.at_level(logging.ERROR, logger="mlx_trio.http"):
            reply = httpx.post(f"{server.url}{COMPLETIONS}", json=completion_body(prompt="boom"))
            # Logged once the app has answered (Starlette re-raises after its 500).
            wait_for(lambda: any(r.name == "mlx_trio.http" for r in caplog.records))
        error = assert_openai_error(reply, 500, None)
        assert error["type"] == "server_error" and error["code"] == "internal_error"
        assert "TextEncodeInput" not in error["message"]
        [record] = [r for r in caplog.records if r.name == "mlx_trio.http"]
        assert record.exc_info is not None and record.exc_info[0] is TypeError
        assert json.dumps(completion_body(prompt="boom")) not in record.getMessage()

        served = httpx.post(f"{server.url}{COMPLETIONS}", json=completion_body(prompt="fine"))
        assert served.status_code == 200


def test_unknown_fields_are_logged_once_each_and_never_without_bound(monkeypatch, caplog):
    # A field OpenAI does not define is served and logged the first time its name comes; a
    # client sending endless new names (or one huge name) cannot grow the log or the set.
    monkeypatch.setattr(field_names, "_logged_unknown", set())
    monkeypatch.setattr(field_names, "MAX_LOGGED_FIELDS", 3)
    caplog.set_level(logging.INFO, logger="mlx_trio.api.field_names")
    names = ["x_trace", "x_trace", "user", "n" * 500, "a", "b"]
    for name in names:
        ChatCompletionRequest.model_validate(chat_body(**{name: 1})).check_fields()
    logged = [r.getMessage() for r in caplog.records]
    assert logged == [
        "ignoring the request field 'x_trace': OpenAI does not define it",
        f"ignoring the request field '{'n' * 64}...': OpenAI does not define it",
        "ignoring the request field 'a': OpenAI does not define it",
    ]
