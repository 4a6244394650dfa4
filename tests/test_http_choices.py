"""Requests of many choices (``/v1/completions`` prompt lists, ``n``) over the real HTTP server:
admitted together or not at all."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from mlx_trio.actors.runtime import RuntimeConfig
from mlx_trio.actors.scripted import Script, ScriptedEngine
from mlx_trio.api.http import HttpSettings
from mlx_trio.api.server import ServeOptions
from tests.server_thread import ServerThread
from tests.test_http import MODEL, stats, wait_for


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    options = ServeOptions(
        runtime=RuntimeConfig(max_batch=8, max_live=64, max_queued=64),
        http=HttpSettings(max_n=4),
    )
    with ServerThread(options, engine=ScriptedEngine(Script(step_s=0.002))) as running:
        yield running


@pytest.fixture
def client(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=30) as http:
        yield http


def completion_body(prompt: object, **extra: object) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 2} | extra


def test_a_bad_later_prompt_leaves_the_earlier_ones_unstarted(client):
    before = stats(client)
    body = completion_body(["fits", "x" * 5000], max_tokens=10)
    reply = client.post("/v1/completions", json=body)
    assert reply.status_code == 400
    assert reply.json()["error"]["code"] == "context_length_exceeded"
    after = stats(client)
    assert after["cancelled"] == before["cancelled"]
    assert after["rows_submitted"] == before["rows_submitted"]


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
