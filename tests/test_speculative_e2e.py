"""Speculative decoding over HTTP on the real default model, with the official openai SDK: a
rewrite of a given text comes out as plain steps give it, with its drafts in ``usage``."""

from __future__ import annotations

import re
from typing import Any

import anthropic
import httpx
import openai
import pytest

from bench.speculative import TEXT
from tests.conftest import ON_ENGINE_THREAD
from tests.server_thread import ServerThread, model_id

pytestmark = [pytest.mark.e2e, ON_ENGINE_THREAD]

# bench.speculative's rewrite, of its first 80 words (its prompt's prefill is a third as long)
COPY = f"Rewrite this text, changing only 'winter' to 'summer':\n\n{' '.join(TEXT.split()[:80])}"
MESSAGES = [{"role": "user", "content": COPY}]
LOOKUP = {"speculative": {"method": "prompt_lookup", "num_draft_tokens": 4}}
MAX_TOKENS = 48


@pytest.fixture(scope="module")
def server(default_model_server: ServerThread) -> ServerThread:
    return default_model_server


@pytest.fixture(scope="module")
def sdk(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def rewrite(server: ServerThread, sdk: openai.OpenAI, **kwargs: Any) -> Any:
    """The greedy rewrite of ``COPY``, ``kwargs`` over ``MAX_TOKENS`` and speculation."""
    asked = {"max_tokens": MAX_TOKENS, "extra_body": LOOKUP, **kwargs}
    return sdk.chat.completions.create(
        model=model_id(server), messages=MESSAGES, temperature=0, **asked
    )


@pytest.fixture(scope="module")
def plain(server: ServerThread, sdk: openai.OpenAI) -> str:
    """The greedy rewrite with plain steps."""
    reply = rewrite(server, sdk, extra_body=None)
    assert reply.usage.completion_tokens_details is None  # nothing drafted
    return reply.choices[0].message.content or ""


def test_a_client_leaving_mid_draft_leaves_the_rewrite_as_plain_steps_give_it(server, sdk, plain):
    stream = rewrite(server, sdk, stream=True)
    for _, _ in zip(range(3), stream, strict=False):
        pass
    stream.close()
    reply = rewrite(server, sdk)
    assert reply.choices[0].message.content == plain
    assert "harbor town" in plain  # the rewrite copies from the text
    details = reply.usage.completion_tokens_details
    assert details is not None and details.accepted_prediction_tokens > 0
    drafted = details.model_extra["drafted_tokens"]
    assert drafted == details.accepted_prediction_tokens + details.rejected_prediction_tokens
    metrics = httpx.get(f"{server.url}/metrics").text
    accepted = re.search(r"^mlx_trio_accepted_draft_tokens_total (\S+)$", metrics, re.M)
    assert accepted is not None and float(accepted.group(1)) >= details.accepted_prediction_tokens


def test_a_stop_string_streams_the_text_before_it(server, sdk, plain):
    stop = plain[len(plain) // 2 :][:6]
    stream = rewrite(server, sdk, stop=[stop], stream=True)
    chunks = [c for c in stream if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == plain[: plain.index(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_a_deadline_mid_draft_ends_the_request_with_a_timeout(server, sdk):
    with pytest.raises(openai.APIStatusError) as caught:
        rewrite(server, sdk, max_tokens=400, extra_body={**LOOKUP, "timeout": 2.0})
    assert caught.value.status_code == 408
    assert httpx.get(f"{server.url}/health").status_code == 200


@pytest.mark.parametrize(
    ("speculative", "param"),
    [
        ({"method": "medusa"}, "speculative.method"),
        ({"method": "prompt_lookup", "num_draft_tokens": 0}, "speculative.num_draft_tokens"),
    ],
)
def test_a_bad_speculative_field_is_a_400_naming_it(server, sdk, speculative, param):
    with pytest.raises(openai.BadRequestError) as caught:
        rewrite(server, sdk, max_tokens=4, extra_body={"speculative": speculative})
    assert caught.value.body["param"] == param


def test_the_messages_api_takes_the_field_as_chat_does(server, plain):
    client = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)
    greedy = {"temperature": 0}  # the SDK (2.x) takes it only as an extra field
    bad = {**greedy, "speculative": {"method": "x"}}
    asked = {"model": model_id(server), "messages": MESSAGES}
    reply = client.messages.create(**asked, max_tokens=MAX_TOKENS, extra_body={**greedy, **LOOKUP})
    assert reply.content[0].text == plain
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(**asked, max_tokens=4, extra_body=bad)
    assert "speculative.method" in caught.value.message
