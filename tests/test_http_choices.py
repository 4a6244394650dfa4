"""Requests of many choices (``/v1/completions`` prompt lists, ``n``) over the real HTTP server:
prompts x ``n`` capped by ``max_n``, admitted together or not at all, and usage as OpenAI
counts it."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import openai
import pytest

from mlx_trio.actors.config import RuntimeConfig
from mlx_trio.actors.testing.scripted import Script, ScriptedEngine
from mlx_trio.api.http_state import HttpSettings
from mlx_trio.api.server import ServeOptions
from tests.server_thread import ServerThread, scripted_server
from tests.test_http import MODEL, chat_body, expected_text, stats, wait_for


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    with scripted_server(
        RuntimeConfig(max_batch=8, max_live=64, max_queued=64), HttpSettings(max_n=4)
    ) as running:
        yield running


def completion_body(prompt: object, **extra: object) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 2} | extra


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        (
            completion_body(["p"] * 5),
            "prompt",
            "prompt may hold at most 4 prompts on this server, got 5",
        ),
        (
            completion_body(["p"] * 319),
            "prompt",
            "prompt may hold at most 4 prompts on this server, got 319",
        ),
        (
            completion_body(["ab", "cd"], n=3),
            "n",
            "a request may ask for at most 4 choices (prompts x n) on this server, "
            "got 2 prompts x n=3",
        ),
        (
            completion_body([[1, 2]] * 5),
            "prompt",
            "prompt may hold at most 4 prompts on this server, got 5",
        ),
        (completion_body(["ab"] * 4, n=0), "n", "n must be at least 1, got 0"),
        (chat_body(n=5), "n", "n must be between 1 and 4, got 5"),
    ],
    ids=["5-prompts", "319-prompts", "2-prompts-x-n3", "5-token-lists", "n0", "chat-n5"],
)
def test_prompts_times_n_over_max_n_get_400_before_any_admission(client, body, param, message):
    path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
    before = stats(client)
    reply = client.post(path, json=body)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"] == {
        "message": message,
        "type": "invalid_request_error",
        "param": param,
        "code": None,
    }
    after = stats(client)
    assert (after["refused"], after["rows_submitted"]) == (
        before["refused"],
        before["rows_submitted"],
    )


def test_one_list_of_token_ids_is_one_prompt_and_refused_as_unsupported(client):
    reply = client.post("/v1/completions", json=completion_body([1, 2, 3, 4, 5, 6]))
    assert reply.status_code == 400
    assert reply.json()["error"]["message"] == "prompt as token ids is not supported; send text"
    assert reply.json()["error"]["param"] == "prompt"


def test_a_bad_later_prompt_leaves_the_earlier_ones_unstarted(client):
    before = stats(client)
    body = completion_body(["fits", "x" * 5000], max_tokens=10)
    reply = client.post("/v1/completions", json=body)
    assert reply.status_code == 400
    assert reply.json()["error"]["code"] == "context_length_exceeded"
    assert reply.json()["error"]["param"] == "prompt"
    after = stats(client)
    assert after["cancelled"] == before["cancelled"]
    assert after["rows_submitted"] == before["rows_submitted"]


def test_usage_counts_every_prompt_once_and_every_choice(server):
    sdk = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    reply = sdk.completions.create(model=MODEL, prompt=["ab", "cde"], n=2, max_tokens=3)
    assert [c.text for c in reply.choices] == [expected_text("ab", 3)] * 2 + [
        expected_text("cde", 3)
    ] * 2
    # The scripted engine's prompt tokens are its characters: 2 + 3, each prompt once.
    usage = reply.usage
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (5, 12, 17)

    stream = sdk.completions.create(
        model=MODEL,
        prompt=["ab", "cde"],
        n=2,
        max_tokens=3,
        stream=True,
        stream_options={"include_usage": True},
    )
    last = list(stream)[-1]
    assert last.choices == []
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (5, 12)


def test_chat_usage_with_n_counts_the_prompt_once(server):
    sdk = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    reply = sdk.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "four"}], n=3, max_tokens=2
    )
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (4, 6)


@pytest.mark.parametrize("stream", [False, True])
def test_choices_are_admitted_together_or_not_at_all(stream):
    """2 permits and 2 queue places: a request of 5 choices takes both permits and both places,
    the 5th is refused; one 503, and no session was started, no permit or place is kept."""
    options = ServeOptions(
        runtime=RuntimeConfig(max_batch=8, max_live=2, max_queued=2),
        http=HttpSettings(max_n=8),
    )
    with ServerThread(options, engine=ScriptedEngine(Script(step_s=0.002))) as server:
        wait_for(lambda: httpx.get(f"{server.url}/health").status_code == 200)
        with httpx.Client(base_url=server.url, timeout=30) as http:
            body = completion_body(["ab", "cd", "ef", "gh", "ij"], stream=stream)
            refused = http.post("/v1/completions", json=body)
            assert refused.status_code == 503
            assert refused.headers["content-type"] == "application/json"
            assert refused.json()["error"]["code"] == "overloaded"
            after = stats(http)
            assert after["refused"] == 1
            assert after["rows_submitted"] == {"batch": 0, "serial": 0}
            assert sum(after["cancelled"].values()) == 0 and after["completed"] == 0
            assert (after["live_sessions"], after["queued_sessions"]) == (0, 0)

            # Every permit and queue place came back: four choices fit again.
            body = completion_body(["ab", "cd", "ef", "gh"], stream=stream)
            served = http.post("/v1/completions", json=body)
            assert served.status_code == 200
            if stream:
                data = [line[6:] for line in served.text.splitlines() if line.startswith("data: ")]
                indexes = {c["index"] for d in data[:-1] for c in json.loads(d)["choices"]}
                assert indexes == {0, 1, 2, 3} and data[-1] == "[DONE]"
            else:
                assert len(served.json()["choices"]) == 4
            wait_for(lambda: stats(http)["completed"] == 4)


def test_the_largest_seed_serves_several_choices(client):
    body = completion_body("seeded", n=3, seed=2**63 - 1, temperature=0.5)
    reply = client.post("/v1/completions", json=body)
    assert reply.status_code == 200, reply.text
    assert [c["index"] for c in reply.json()["choices"]] == [0, 1, 2]
