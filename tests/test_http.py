"""The HTTP front end: the real Hypercorn server on a loopback port, the official openai SDK
and raw httpx as clients, on the scripted engine (fast and fault-injectable)."""

from __future__ import annotations

import gc
import json
import socket
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
import trio

from mlx_trio.actors.config import RuntimeConfig
from mlx_trio.actors.testing.scripted import Script, ScriptedEngine, expected_tokens, token_text
from mlx_trio.api.http_state import HttpSettings
from mlx_trio.api.server import ServeOptions
from tests.server_thread import ServerThread, scripted_server

MODEL = "scripted"


def expected_text(prompt: str, n: int) -> str:
    return "".join(token_text(t) for t in expected_tokens(tuple(ord(c) for c in prompt), n))


def chat_body(content: str = "hi", **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}]} | extra


TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}


def named(function: str) -> dict:
    return {"type": "function", "function": {"name": function}}


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    with scripted_server(
        RuntimeConfig(max_batch=8, max_live=64, max_queued=512, idle_timeout_s=5.0),
        HttpSettings(max_body_bytes=64 * 1024, max_n=4),
    ) as running:
        yield running


def stats(client: httpx.Client) -> dict:
    return client.get("/v1/stats").json()


def wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.01)


# -- the official SDK ---------------------------------------------------------------------


def test_sdk_chat_non_streaming(server):
    sdk = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    reply = sdk.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hello"}], max_tokens=6
    )
    assert reply.choices[0].message.content == expected_text("hello", 6)
    assert reply.choices[0].finish_reason == "length"
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (5, 6)
    assert reply.usage.prompt_tokens_details.cached_tokens == 0


def test_sdk_chat_streaming_with_usage(server):
    sdk = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    stream = sdk.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "stream me"}],
        max_tokens=5,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected_text("stream me", 5)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 5 and chunks[-1].choices == []


async def test_async_sdk_streaming_and_not(server):
    async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused") as sdk:
        reply = await sdk.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "async"}], max_tokens=4
        )
        assert reply.choices[0].message.content == expected_text("async", 4)
        stream = await sdk.completions.create(
            model=MODEL, prompt="plain", max_tokens=4, stream=True
        )
        text = "".join([c.choices[0].text async for c in stream])
        assert text == expected_text("plain", 4)


def test_completions_with_several_prompts_and_n(server):
    sdk = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    reply = sdk.completions.create(model=MODEL, prompt=["ab", "cd"], n=2, max_tokens=3)
    assert [c.index for c in reply.choices] == [0, 1, 2, 3]
    texts = [c.text for c in reply.choices]
    assert texts == [expected_text("ab", 3)] * 2 + [expected_text("cd", 3)] * 2
    assert reply.usage.completion_tokens == 12


def test_sdk_stop_strings_and_chat_logprobs(server):
    sdk = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    full = expected_text("stop", 8)
    stop = full.split(" ")[3]
    reply = sdk.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "stop"}],
        max_tokens=8,
        stop=[stop],
        logprobs=True,
        top_logprobs=2,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.message.content == full[: full.index(stop)]
    tokens = expected_tokens(tuple(ord(c) for c in "stop"), 4)
    assert [e.token for e in choice.logprobs.content] == [token_text(t) for t in tokens]
    assert [len(e.top_logprobs) for e in choice.logprobs.content] == [2, 2, 2, 2]
    assert choice.logprobs.content[0].top_logprobs[0].token == token_text(tokens[0])


# -- bad input (design/RELIABILITY.md), each before any engine work ------------------------


@pytest.mark.parametrize(
    ("body", "status", "param", "code"),
    [
        (chat_body(model="nope"), 404, "model", "model_not_found"),
        (chat_body(model="/etc/passwd"), 404, "model", "model_not_found"),
        (chat_body(messages=[]), 400, "messages", None),
        (chat_body(messages=[{"role": "wizard", "content": "x"}]), 400, "messages[0].role", None),
        (chat_body(max_tokens=0), 400, "max_tokens", None),
        (chat_body(max_completion_tokens=-1), 400, "max_completion_tokens", None),
        (chat_body(temperature=2.5), 400, "temperature", None),
        (chat_body(top_p=0), 400, "top_p", None),
        (chat_body(top_k=-1), 400, "top_k", None),
        (chat_body(presence_penalty=-5), 400, "presence_penalty", None),
        (chat_body(seed=-1), 400, "seed", None),
        (chat_body(logprobs=True, top_logprobs=21), 400, "top_logprobs", None),
        (chat_body(n=5), 400, "n", None),
        (chat_body(n=0), 400, "n", None),
        (chat_body(stop=["a", "b", "c", "d", "e"]), 400, "stop", None),
        (chat_body(stop=[""]), 400, "stop", None),
        (chat_body(temperature="hot"), 400, "temperature", None),
        (chat_body(content="x" * 5000, max_tokens=10), 400, "messages", "context_length_exceeded"),
        ({"model": MODEL, "prompt": "", "max_tokens": 2}, 400, "prompt", None),
        # OpenAI's fields that this server does not implement: refused, not dropped.
        (chat_body(functions=[{"name": "f"}]), 400, "functions", "unsupported"),
        (chat_body(audio={"voice": "x"}), 400, "audio", "unsupported"),
        # Tools that cannot be offered as asked.
        (chat_body(tools=[{"type": "function"}]), 400, "tools.[0].function", None),
        (chat_body(tool_choice="required"), 400, "tool_choice", None),
        (chat_body(tools=[TOOL], tool_choice=named("other")), 400, "tool_choice", None),
        (chat_body(tools=[TOOL | {"function": {"name": "a b"}}]), 400, "tools", None),
        (chat_body(tools=[TOOL, TOOL], tool_choice="required"), 400, "tools", None),
        (
            chat_body(
                tools=[TOOL], tool_choice="required", response_format={"type": "json_object"}
            ),
            400,
            "tool_choice",
            None,
        ),
        (chat_body(chat_template_kwargs={"tokenize": False}), 400, "chat_template_kwargs", None),
        (
            chat_body(response_format={"type": "json_schema"}),
            400,
            "response_format.json_schema",
            None,
        ),
        (chat_body(response_format={"type": "xml"}), 400, "response_format.type", None),
        ({"model": MODEL, "prompt": "x", "best_of": 3}, 400, "best_of", "unsupported"),
    ],
)
def test_bad_requests_get_openai_errors_with_param(client, body, status, param, code):
    path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
    before = stats(client)
    reply = client.post(path, json=body)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param
    assert error["code"] == code
    after = stats(client)
    assert after["rows_submitted"] == before["rows_submitted"]  # no engine work at all


def test_what_asks_for_nothing_unsupported_passes(server):
    # Values of unimplemented fields that ask for nothing, OpenAI's no-effect fields and
    # fields OpenAI does not define are served as usual.
    sdk = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    reply = sdk.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=2,
        response_format={"type": "text"},
        tool_choice="none",
        user="someone",
        extra_body={"not_an_openai_field": 1},
    )
    assert reply.choices[0].finish_reason == "length"


def test_a_path_as_model_is_named_back_and_never_opened(client):
    reply = client.post("/v1/chat/completions", json=chat_body(model="/etc/passwd"))
    assert reply.status_code == 404
    message = "The model '/etc/passwd' does not exist; this server serves 'scripted'"
    assert reply.json()["error"]["message"] == message


def test_a_long_unknown_model_name_is_said_back_cut_short(client):
    reply = client.post("/v1/chat/completions", json=chat_body(model="m" * 10_000))
    assert reply.status_code == 404
    message = f"The model '{'m' * 61}...' does not exist; this server serves 'scripted'"
    assert reply.json()["error"]["message"] == message


def test_an_over_long_prompt_is_refused_before_the_stream_starts(client):
    reply = client.post(
        "/v1/chat/completions", json=chat_body(content="y" * 5000, max_tokens=10, stream=True)
    )
    assert reply.status_code == 400
    assert reply.headers["content-type"].startswith("application/json")
    assert reply.json()["error"]["code"] == "context_length_exceeded"


@pytest.mark.parametrize(
    ("content", "headers", "message"),
    [
        (b"{not json", {}, "request body is not valid JSON"),
        (b"[1, 2]", {}, "request body must be a JSON object"),
        (b"\xff\xfe{}", {}, "request body is not valid UTF-8"),
    ],
)
def test_malformed_bodies_get_400(client, content, headers, message):
    reply = client.post("/v1/chat/completions", content=content, headers=headers)
    assert reply.status_code == 400
    assert reply.json()["error"]["message"].startswith(message)


def test_a_body_over_the_limit_gets_413(client):
    reply = client.post("/v1/chat/completions", json=chat_body(content="z" * 70_000))
    assert reply.status_code == 413
    assert reply.json()["error"]["message"] == "request body is over the 65536 byte limit"


def test_headers_too_large_get_431(server):
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 20_000 + b"\r\n\r\n")
        assert sock.recv(64).startswith(b"HTTP/1.1 431")


def test_unknown_route_and_method_use_the_error_shape(client):
    assert client.get("/v1/nothing").json()["error"]["type"] == "invalid_request_error"
    assert client.get("/v1/chat/completions").status_code == 405


# -- disconnects, cancellation, failures ---------------------------------------------------


def test_disconnect_mid_stream_cancels_consumer_closed_and_frees_the_row(server, client):
    before = stats(client)["cancelled"]["consumer_closed"]
    with httpx.Client(base_url=server.url, timeout=30) as other:
        body = chat_body("leaver", max_tokens=100_0, stream=True)
        with client.stream("POST", "/v1/chat/completions", json=body) as stream:
            lines = stream.iter_lines()
            assert next(line for line in lines if '"content":"t' in line)
        bystander = other.post(
            "/v1/chat/completions", json=chat_body("bystander", max_tokens=20)
        ).json()
    assert bystander["choices"][0]["message"]["content"] == expected_text("bystander", 20)
    wait_for(lambda: stats(client)["cancelled"]["consumer_closed"] == before + 1)
    wait_for(lambda: stats(client)["active_rows"] == 0)


def test_disconnect_mid_non_stream_cancels_consumer_closed(server, client):
    before = stats(client)["cancelled"]["consumer_closed"]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{server.url}/v1/chat/completions",
            json=chat_body("patient", max_tokens=1000),
            timeout=httpx.Timeout(30, read=0.2),
        )
    wait_for(lambda: stats(client)["cancelled"]["consumer_closed"] == before + 1)
    wait_for(lambda: stats(client)["active_rows"] == 0)


def test_cancel_by_id_ends_the_stream_with_an_error_then_done(client):
    body = chat_body("cancel me", max_tokens=1000, stream=True)
    with client.stream("POST", "/v1/chat/completions", json=body) as stream:
        request_id = stream.headers["x-request-id"]
        lines = stream.iter_lines()
        next(line for line in lines if '"content":"t' in line)
        reply = client.post(f"/v1/requests/{request_id}/cancel")
        assert reply.json() == {"id": request_id, "object": "request.cancelled"}
        data = [line for line in lines if line.startswith("data: ")]
    assert data[-1] == "data: [DONE]"
    assert json.loads(data[-2].removeprefix("data: "))["error"]["code"] == "request_cancelled"
    assert client.post("/v1/requests/chatcmpl-nope/cancel").status_code == 404


def test_a_failure_mid_stream_sends_an_error_event_then_done():
    engine = ScriptedEngine(Script(step_s=0.002, row_faults={"doomed": 3}))
    with ServerThread(engine=engine) as server:
        wait_for(lambda: httpx.get(f"{server.url}/health").status_code == 200)
        sdk = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        stream = sdk.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "doomed"}], stream=True
        )
        with pytest.raises(openai.APIError, match="injected sampler failure"):
            list(stream)
        reply = httpx.post(f"{server.url}/v1/chat/completions", json=chat_body("fine"))
        assert reply.status_code == 200


def test_the_server_takes_its_startup_heap_out_of_the_garbage_collectors_way():
    gc.unfreeze()
    engine = ScriptedEngine(Script(step_s=0.002))
    assert any(o is engine for o in gc.get_objects())
    try:
        with ServerThread(engine=engine) as server:
            wait_for(lambda: httpx.get(f"{server.url}/health").status_code == 200)
            # Frozen: a full collection no longer walks what the server holds for good.
            assert gc.get_freeze_count() > 0
            assert not any(o is engine for o in gc.get_objects())
            body = chat_body("after", max_tokens=8)
            reply = httpx.post(f"{server.url}/v1/chat/completions", json=body)
            assert reply.json()["choices"][0]["message"]["content"] == expected_text("after", 8)
    finally:
        gc.unfreeze()


def test_overload_gets_503_with_retry_after():
    options = ServeOptions(runtime=RuntimeConfig(max_batch=1, max_live=1, max_queued=0))
    with ServerThread(options, engine=ScriptedEngine(Script(step_s=0.01))) as server:
        wait_for(lambda: httpx.get(f"{server.url}/health").status_code == 200)
        with httpx.Client(base_url=server.url, timeout=30) as http:
            body = chat_body("hog", max_tokens=200, stream=True)
            with http.stream("POST", "/v1/chat/completions", json=body) as stream:
                lines = stream.iter_lines()  # keep it: a dropped iterator closes the stream
                next(lines)
                refused = http.post("/v1/chat/completions", json=chat_body("late"))
            metrics = http.get("/metrics").text
        assert refused.status_code == 503
        assert refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "overloaded"
        assert 'mlx_trio_refusals_total{reason="overloaded"} 1.0' in metrics


def test_api_key_is_required_except_for_health():
    options = ServeOptions(http=HttpSettings(api_keys=("s3cret",)))
    with ServerThread(options, engine=ScriptedEngine()) as server:
        wait_for(lambda: httpx.get(f"{server.url}/health").status_code == 200)
        missing = httpx.get(f"{server.url}/v1/models")
        wrong = httpx.get(f"{server.url}/v1/models", headers={"Authorization": "Bearer nope"})
        right = httpx.get(f"{server.url}/v1/models", headers={"Authorization": "Bearer s3cret"})
        for reply in (missing, wrong):
            assert reply.status_code == 401
            assert reply.json()["error"]["code"] == "invalid_api_key"
        assert right.json()["data"][0]["id"] == MODEL
        sdk = openai.OpenAI(base_url=f"{server.url}/v1", api_key="s3cret")
        # A few tokens: the key is what is checked (the default max_tokens is 512 scripted steps).
        reply = sdk.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "k"}], max_tokens=4
        )
        assert reply.choices[0].message.content


def test_a_stuck_step_turns_health_503():
    options = ServeOptions(runtime=RuntimeConfig(step_timeout_s=0.5))
    engine = ScriptedEngine(Script(step_s=0.002, hang_batch_steps=frozenset({2})))
    with ServerThread(options, engine=engine) as server:
        wait_for(lambda: httpx.get(f"{server.url}/health").status_code == 200)
        reply = httpx.post(f"{server.url}/v1/chat/completions", json=chat_body("wedge"), timeout=30)
        assert reply.status_code == 503
        assert reply.json()["error"]["code"] == "engine_timeout"
        health = httpx.get(f"{server.url}/health")
        assert health.status_code == 503 and health.json()["status"] == "unhealthy"


# -- observability and scale ---------------------------------------------------------------


def test_models_stats_and_metrics(client):
    client.post("/v1/chat/completions", json=chat_body("metrics", max_tokens=3))
    assert [m["id"] for m in client.get("/v1/models").json()["data"]] == [MODEL]
    snapshot = stats(client)
    assert snapshot["is_healthy"] and snapshot["completed"] >= 1
    text = client.get("/metrics").text
    for name in (
        "mlx_trio_requests_total",
        "mlx_trio_time_to_first_token_seconds_bucket",
        "mlx_trio_inter_token_seconds_bucket",
        "mlx_trio_generated_tokens_total",
        "mlx_trio_sessions_running",
        "mlx_trio_batch_rows_active",
    ):
        assert name in text


async def test_256_concurrent_streaming_clients_are_all_served(server):
    limits = httpx.Limits(max_connections=300, max_keepalive_connections=300)
    done: list[str] = []

    async def stream_one(http: httpx.AsyncClient, i: int) -> None:
        prompt = f"client {i}"
        body = chat_body(prompt, max_tokens=8, stream=True)
        text = ""
        async with http.stream("POST", "/v1/chat/completions", json=body) as reply:
            assert reply.status_code == 200
            async for line in reply.aiter_lines():
                if line.startswith("data: {"):
                    for choice in json.loads(line[6:])["choices"]:
                        text += choice["delta"].get("content") or ""
                elif line == "data: [DONE]":
                    done.append(text)
        assert text == expected_text(prompt, 8)

    http = httpx.AsyncClient(base_url=server.url, limits=limits, timeout=60)
    async with http, trio.open_nursery() as nursery:
        for i in range(256):
            nursery.start_soon(stream_one, http, i)
    assert len(done) == 256


def test_a_stream_longer_than_the_body_deadline_is_not_cut():
    options = ServeOptions(http=HttpSettings(body_timeout_s=0.3))
    with ServerThread(options, engine=ScriptedEngine(Script(step_s=0.03))) as server:
        wait_for(lambda: httpx.get(f"{server.url}/health").status_code == 200)
        body = chat_body("long", max_tokens=40, stream=True)
        with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body) as reply:
            data = [line for line in reply.iter_lines() if line.startswith("data: ")]
        assert data[-1] == "data: [DONE]"
        assert sum('"content":"t' in line for line in data) == 40


def test_a_body_that_never_finishes_gets_408():
    options = ServeOptions(http=HttpSettings(body_timeout_s=0.3))
    with ServerThread(options, engine=ScriptedEngine()) as slow_server:
        host, port = slow_server.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            head = (
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n"
                b"Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"
            )
            sock.sendall(head)
            assert sock.recv(64).startswith(b"HTTP/1.1 408")
