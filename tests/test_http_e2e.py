"""The HTTP server on the real default model, with the official openai SDK."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import openai
import pytest
import trio

from tests.server_thread import ServerThread, model_id

pytestmark = pytest.mark.e2e

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(default_model_server: ServerThread) -> ServerThread:
    return default_model_server


def test_sync_sdk_greedy_chat_answers_paris(server):
    sdk = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    reply = sdk.chat.completions.create(
        model=model_id(server), messages=QUESTION, temperature=0, max_tokens=32
    )
    assert "Paris" in reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.prompt_tokens > 10


async def test_async_sdk_streaming_matches_non_streaming(server):
    async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused") as sdk:
        model = model_id(server)
        whole = await sdk.chat.completions.create(
            model=model, messages=QUESTION, temperature=0, max_tokens=32
        )
        stream = await sdk.chat.completions.create(
            model=model, messages=QUESTION, temperature=0, max_tokens=32, stream=True
        )
        pieces = [c.choices[0].delta.content or "" async for c in stream if c.choices]
        assert "".join(pieces) == whole.choices[0].message.content
        assert "Paris" in "".join(pieces)


def test_a_repeated_prompt_reports_cached_tokens(server):
    sdk = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    messages = [
        {"role": "system", "content": "You are a terse assistant. " * 20},
        {"role": "user", "content": "Name a planet."},
    ]
    first = sdk.chat.completions.create(
        model=model_id(server), messages=messages, temperature=0, max_tokens=8
    )
    second = sdk.chat.completions.create(
        model=model_id(server), messages=messages, temperature=0, max_tokens=8
    )
    assert second.choices[0].message.content == first.choices[0].message.content
    assert second.usage.prompt_tokens_details.cached_tokens == second.usage.prompt_tokens - 1
    stats = httpx.get(f"{server.url}/v1/stats").json()["prompt_cache"]
    assert stats["hits"] >= 1
    assert "mlx_trio_prompt_cache_hits" in httpx.get(f"{server.url}/metrics").text


async def test_top_k_past_the_vocabulary_is_refused_and_sampling_goes_on(server):
    """The red team's request (top_k = the vocabulary size, sampled) once broke sampling for
    every later request; now it is a 400, and sampled requests beside greedy ones still work."""
    async with openai.AsyncOpenAI(
        base_url=f"{server.url}/v1", api_key="unused", max_retries=0
    ) as sdk:
        model = model_id(server)
        with pytest.raises(openai.BadRequestError) as info:
            await sdk.chat.completions.create(
                model=model,
                messages=QUESTION,
                temperature=1.0,
                max_tokens=8,
                extra_body={"top_k": 49152},
            )
        assert info.value.body["param"] == "top_k"
        assert "vocabulary size (49152)" in info.value.body["message"]

        async def ask(temperature: float, top_k: int) -> openai.types.chat.ChatCompletion:
            return await sdk.chat.completions.create(
                model=model,
                messages=QUESTION,
                temperature=temperature,
                max_tokens=16,
                extra_body={"top_k": top_k},
            )

        greedy = await ask(0.0, 0)
        replies: dict[str, openai.types.chat.ChatCompletion] = {}

        async def keep(label: str, temperature: float, top_k: int) -> None:
            replies[label] = await ask(temperature, top_k)

        async with trio.open_nursery() as nursery:  # in one batch: two sampled, one greedy
            for label, temperature, top_k in (("wide", 1.0, 49151), ("narrow", 0.7, 40)):
                nursery.start_soon(keep, label, temperature, top_k)
            nursery.start_soon(keep, "greedy", 0.0, 0)
        assert all(r.choices[0].finish_reason in ("stop", "length") for r in replies.values())
        assert replies["greedy"].choices[0].message.content == greedy.choices[0].message.content
        alone = await ask(1.0, 49151)
        assert alone.choices[0].finish_reason in ("stop", "length")


def test_the_readmes_first_curl_answers_paris_every_time(server):
    """The README's first curl, as written (it asks for greedy decoding: at the default
    model's own temperature, 0.1 from its generation_config.json, it answered "L'Etoile de la
    Cite ..." 3 times in 9)."""
    [model] = httpx.get(f"{server.url}/v1/models").json()["data"]
    from_model = {
        name: entry["value"]
        for name, entry in model["sampling_defaults"].items()
        if entry["source"] == "model"
    }
    assert from_model == {"temperature": 0.1, "repetition_penalty": 1.1}
    # The CPU loader dequantizes the default model (4-bit, some layers 8-bit) to float32.
    assert model["weights"] == "float32, dequantized from 4/8-bit at load"
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    body = json.loads(re.search(r"curl -s \S+/v1/chat/completions.*?-d '(.*?)'", readme, re.S)[1])
    body["model"] = model["id"]
    answers = {
        httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=120).json()["choices"][
            0
        ]["message"]["content"]
        for _ in range(3)
    }
    assert answers == {"The capital of France is Paris."}
