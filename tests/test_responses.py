"""The Responses API (``/v1/responses``) over the real server on the scripted engine, with the
official openai SDK as the client: shapes, the streamed event sequence (each event validated
against the SDK's own type, and accumulated by its ``responses.stream``), stored responses and
``previous_response_id``, refusals, and a disconnect that frees its row. The scripted engine's
tokens are the prompt's characters (a chat's messages joined by newlines), so what a prompt
was can be read back from what was generated."""

from __future__ import annotations

import json
import typing
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from openai.types.responses import ResponseStreamEvent
from pydantic import BaseModel

from mlx_trio.actors.config import RuntimeConfig
from mlx_trio.actors.testing.scripted import Script, ScriptedEngine, expected_tokens, token_text
from mlx_trio.api.http_state import HttpSettings
from mlx_trio.api.responses_schemas import ResponsesRequest
from mlx_trio.api.responses_store import ResponseStore, stored
from mlx_trio.api.schemas import ChatCompletionRequest
from mlx_trio.api.server import ServeOptions
from mlx_trio.engine.vocabulary.prompt import ChatMessage
from mlx_trio.engine.vocabulary.reply import ReplySyntax
from tests.server_thread import ServerThread, wait_for

MODEL = "scripted"
KEY, OTHER_KEY = "sk-first", "sk-second"


def reply_tokens(prompt: str, n: int) -> list[int]:
    return expected_tokens(tuple(ord(c) for c in prompt), n)


def reply_text(prompt: str, n: int) -> str:
    return "".join(token_text(t) for t in reply_tokens(prompt, n))


# "why?" opens a thinking block (its "?"), which the reply's third token closes.
QUESTION = "why?"
THINK_END = reply_tokens(QUESTION, 8)[2]
# With tools offered, the reply to CALLER holds a call between its second and fourth tokens.
CALLER = "call it"
CALL_TOKENS = [token_text(t) for t in reply_tokens(CALLER, 8)]
SYNTAX = ReplySyntax(
    think=("<think>", token_text(THINK_END)),
    think_ids=((ord("?"),), (THINK_END,)),
    native_calls=(CALL_TOKENS[1], CALL_TOKENS[3]),
    native_parser=lambda text, tools: {"name": "lookup", "arguments": {"q": text.strip()}},
)
LOOKUP = {
    "type": "function",
    "name": "lookup",
    "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
}
# Each streamed event's type, as the SDK's own classes (a malformed event fails validation).
EVENT_TYPES: dict[str, type[BaseModel]] = {
    typing.get_args(cls.model_fields["type"].annotation)[0]: cls
    for cls in typing.get_args(typing.get_args(ResponseStreamEvent)[0])
}


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    options = ServeOptions(
        runtime=RuntimeConfig(max_batch=4, max_live=16, max_queued=16),
        http=HttpSettings(api_keys=(KEY, OTHER_KEY)),
    )
    engine = ScriptedEngine(Script(step_s=0.002, context_length=2048), reply_syntax=SYNTAX)
    with ServerThread(options, engine=engine) as running:
        yield running


@pytest.fixture(scope="module")
def sdk(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)


@pytest.fixture
def client(server: ServerThread) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=30) as http:
        yield http


def raw_events(client: httpx.Client, body: dict[str, Any]) -> list[dict[str, Any]]:
    """A streamed response's events as sent, each validated against the SDK's type."""
    events = []
    with client.stream("POST", "/v1/responses", json=body | {"stream": True}) as stream:
        assert stream.status_code == 200
        for line in stream.iter_lines():
            if line.startswith("data: "):
                event = json.loads(line.removeprefix("data: "))
                EVENT_TYPES[event["type"]].model_validate(event)
                events.append(event)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


# -- text -----------------------------------------------------------------------------------


def test_a_string_input_gets_one_message_with_usage(sdk):
    response = sdk.responses.create(model=MODEL, input="hello", max_output_tokens=6)
    assert response.id.startswith("resp_")
    assert response.output_text == reply_text("hello", 6)
    assert response.status == "incomplete"  # the scripted engine never ends by itself
    assert response.incomplete_details.reason == "max_output_tokens"
    assert [item.type for item in response.output] == ["message"]
    usage = response.usage
    assert (usage.input_tokens, usage.output_tokens, usage.total_tokens) == (5, 6, 11)
    assert usage.input_tokens_details.cached_tokens == 0
    assert usage.output_tokens_details.reasoning_tokens == 0


def test_instructions_and_items_make_one_chat(sdk):
    response = sdk.responses.create(
        model=MODEL,
        instructions="be brief",
        input=[
            {"role": "developer", "content": "use words"},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"}]},
            {"role": "assistant", "content": [{"type": "output_text", "text": "b"}]},
            {"type": "function_call", "call_id": "c1", "name": "lookup", "arguments": "{}"},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"type": "function_call_output", "call_id": "c1", "output": "found"},
        ],
        tools=[LOOKUP],
        max_output_tokens=4,
    )
    # instructions and the developer message are one system turn; the reasoning is left out
    assert response.output_text == reply_text("be brief\n\nuse words\na\nb\nfound", 4)


def test_the_stream_is_the_typed_event_sequence(client):
    events = raw_events(client, {"model": MODEL, "input": "stream me", "max_output_tokens": 5})
    types = [e["type"] for e in events]
    deltas = types.count("response.output_text.delta")  # whitespace is held to the next text
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert "".join(e["delta"] for e in events if "delta" in e) == reply_text("stream me", 5)
    last = events[-1]["response"]
    assert last["output"][0]["content"][0]["text"] == reply_text("stream me", 5)
    assert last["usage"]["output_tokens"] == 5


def ending(prompt: str, n: int) -> dict[str, Any]:
    """The ``stop`` (an extension, as chat's) that ends the reply to ``prompt`` after ``n``
    tokens: the scripted engine never ends by itself, and the SDK's stream wants an end."""
    return {"stop": [token_text(reply_tokens(prompt, n + 1)[n]).strip()]}


def test_the_sdk_stream_accumulates_the_response(sdk):
    with sdk.responses.stream(
        model=MODEL, input="stream me", extra_body=ending("stream me", 4)
    ) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == reply_text("stream me", 4)
    assert final.status == "completed"
    assert final.usage.output_tokens == 5  # the stop string's token is generated, not shown


def test_thinking_is_a_reasoning_item_with_its_tokens_counted(sdk, client):
    response = sdk.responses.create(model=MODEL, input=QUESTION, max_output_tokens=8)
    words = [token_text(t) for t in reply_tokens(QUESTION, 8)]
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output[0].content[0].text == "".join(words[:2])
    assert response.output_text == "".join(words[3:])
    assert response.usage.output_tokens_details.reasoning_tokens == 3
    events = raw_events(client, {"model": MODEL, "input": QUESTION, "max_output_tokens": 8})
    reasoning = [e["delta"] for e in events if e["type"] == "response.reasoning_text.delta"]
    assert "".join(reasoning) == "".join(words[:2])
    assert events[-1]["response"]["usage"]["output_tokens_details"]["reasoning_tokens"] == 3


# -- function calls -------------------------------------------------------------------------


def test_a_call_is_a_function_call_item_streamed_or_not(sdk, client):
    response = sdk.responses.create(model=MODEL, input=CALLER, tools=[LOOKUP], max_output_tokens=6)
    kinds = [item.type for item in response.output]
    assert kinds == ["message", "function_call", "message"]
    call = response.output[1]
    assert (call.name, json.loads(call.arguments)) == ("lookup", {"q": CALL_TOKENS[2].strip()})
    assert call.call_id.startswith("call_")
    body = {"model": MODEL, "input": CALLER, "tools": [LOOKUP], "max_output_tokens": 6}
    events = raw_events(client, body)
    done = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    assert [json.loads(e["arguments"]) for e in done] == [{"q": CALL_TOKENS[2].strip()}]
    with sdk.responses.stream(**body, extra_body=ending(CALLER, 5)) as stream:
        final = stream.get_final_response()
    assert [item.type for item in final.output] == kinds
    assert final.output[1].arguments == call.arguments


def test_a_namespaced_function_is_offered_and_its_call_names_the_namespace(sdk, client):
    """Codex's default tools: its sub-agent functions in a ``namespace`` tool, and the hosted
    ``web_search``, which is left out (no web here) rather than refused."""
    agents = {"type": "namespace", "name": "agents", "description": "d", "tools": [LOOKUP]}
    hosted = {"type": "web_search", "external_web_access": False}
    response = sdk.responses.create(
        model=MODEL, input=CALLER, tools=[agents, hosted], max_output_tokens=6
    )
    (call,) = [item for item in response.output if item.type == "function_call"]
    assert (call.name, call.namespace) == ("lookup", "agents")
    assert [t.type for t in response.tools] == ["namespace"]
    body = {"model": MODEL, "input": CALLER, "tools": [agents], "max_output_tokens": 6}
    added = [
        e["item"]
        for e in raw_events(client, body)
        if e["type"] == "response.output_item.done" and e["item"]["type"] == "function_call"
    ]
    assert [item["namespace"] for item in added] == ["agents"]
    plain = sdk.responses.create(model=MODEL, input=CALLER, tools=[LOOKUP], max_output_tokens=6)
    (plain_call,) = [item for item in plain.output if item.type == "function_call"]
    assert plain_call.namespace is None


def test_a_call_and_its_output_continue_from_the_previous_response(sdk):
    first = sdk.responses.create(model=MODEL, input=CALLER, tools=[LOOKUP], max_output_tokens=6)
    call = first.output[1]
    second = sdk.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "42"}],
        tools=[LOOKUP],
        max_output_tokens=3,
    )
    # the assistant's turn is the reply's text around the call (its call goes in the template)
    assert second.output_text == reply_text(f"{CALLER}\n{first.output_text}\n42", 3)
    assert second.previous_response_id == first.id


# -- stored responses -------------------------------------------------------------------------


def test_previous_response_id_continues_the_conversation(sdk):
    first = sdk.responses.create(model=MODEL, input="first", max_output_tokens=3)
    second = sdk.responses.create(
        model=MODEL, input="second", previous_response_id=first.id, max_output_tokens=3
    )
    assert second.output_text == reply_text(f"first\n{first.output_text}\nsecond", 3)
    third = sdk.responses.create(
        model=MODEL, input="third", previous_response_id=second.id, max_output_tokens=3
    )
    history = f"first\n{first.output_text}\nsecond\n{second.output_text}\nthird"
    assert third.output_text == reply_text(history, 3)


def test_a_stored_response_is_read_back_and_deleted_by_its_key_only(sdk, server):
    made = sdk.responses.create(model=MODEL, input="keep me", max_output_tokens=3)
    assert sdk.responses.retrieve(made.id).output_text == made.output_text
    other = openai.OpenAI(base_url=f"{server.url}/v1", api_key=OTHER_KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        other.responses.retrieve(made.id)
    with pytest.raises(openai.NotFoundError):
        other.responses.create(model=MODEL, input="x", previous_response_id=made.id)
    sdk.responses.delete(made.id)
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(made.id)


def test_an_unknown_or_unstored_previous_response_is_a_404_naming_it(sdk):
    with pytest.raises(openai.NotFoundError) as caught:
        sdk.responses.create(model=MODEL, input="x", previous_response_id="resp_nope")
    assert caught.value.body["param"] == "previous_response_id"
    assert "resp_nope" in caught.value.body["message"]
    unstored = sdk.responses.create(model=MODEL, input="x", store=False, max_output_tokens=2)
    with pytest.raises(openai.NotFoundError):
        sdk.responses.create(model=MODEL, input="y", previous_response_id=unstored.id)


# -- refusals ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("extra", "param", "code"),
    [
        ({"tools": [{"type": "file_search"}]}, "tools.[0].type", "unsupported"),
        (
            {"tools": [{"type": "namespace", "name": "n", "tools": [{"type": "custom"}]}]},
            "tools.[0].tools.[0].type",
            "unsupported",
        ),
        ({"tools": [LOOKUP, {"type": "custom", "name": "x"}]}, "tools.[1].type", "unsupported"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
            "input.[0].content.[0].type",
            "unsupported",
        ),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input.[0].type", "unsupported"),
        ({"input": [{"type": "function_call", "name": "f"}]}, "input.[0].call_id", None),
        ({"max_output_tokens": 0}, "max_output_tokens", None),
        ({"text": {"format": {"type": "json_object"}}}, "text.format", None),
        ({"tool_choice": "required"}, "tool_choice", None),
        ({"background": True}, "background", "unsupported"),
        ({"truncation": "auto"}, "truncation", "unsupported"),
        ({"conversation": "conv_1"}, "conversation", "unsupported"),
        ({"reasoning": {"effort": "lots"}}, "reasoning.effort", None),
        ({"input": "x" * 3000}, "input", "context_length_exceeded"),
    ],
)
def test_what_is_not_served_is_a_400_naming_it(client, extra, param, code):
    reply = client.post("/v1/responses", json={"model": MODEL, "input": "hi"} | extra)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert (error["param"], error["code"]) == (param, code)


def test_what_changes_nothing_is_accepted(sdk):
    response = sdk.responses.create(
        model=MODEL,
        input="hi",
        max_output_tokens=2,
        include=["reasoning.encrypted_content"],
        prompt_cache_key="k",
        metadata={"a": "b"},
        text={"verbosity": "low"},
        reasoning={"effort": "low", "summary": "auto"},
        parallel_tool_calls=False,
    )
    assert response.output_text == reply_text("hi", 2)
    assert response.reasoning.effort == "low"


def test_a_model_not_served_is_a_404(sdk):
    with pytest.raises(openai.NotFoundError) as caught:
        sdk.responses.create(model="gpt-5", input="hi")
    assert caught.value.body["code"] == "model_not_found"


def test_reasoning_effort_goes_to_the_template_as_chat_does():
    """``reasoning.effort`` here and chat's ``reasoning_effort`` are one template variable."""
    body = ResponsesRequest.model_validate(
        {"model": MODEL, "input": "hi", "reasoning": {"effort": "high"}}
    )
    assert body.chat(body.messages()).template_kwargs == {"reasoning_effort": "high"}
    chat = ChatCompletionRequest.model_validate(
        {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "reasoning_effort": "low"}
    )
    chat.check_fields()
    assert chat.chat().template_kwargs == {"reasoning_effort": "low"}
    chat.chat_template_kwargs = {"reasoning_effort": "high"}  # an explicit kwarg wins
    assert chat.chat().template_kwargs == {"reasoning_effort": "high"}


# -- the runtime's promises -------------------------------------------------------------------


def stats(client: httpx.Client) -> dict:
    return client.get("/v1/stats").json()


def test_a_disconnect_mid_stream_frees_the_row(client):
    before = stats(client)["cancelled"]["consumer_closed"]
    body = {"model": MODEL, "input": "leaver", "max_output_tokens": 1000, "stream": True}
    with client.stream("POST", "/v1/responses", json=body) as stream:
        lines = stream.iter_lines()
        assert next(line for line in lines if "response.output_text.delta" in line)
    wait_for(lambda: stats(client)["cancelled"]["consumer_closed"] == before + 1, 10, "cancel")
    wait_for(lambda: stats(client)["active_rows"] == 0, 10, "the row freed")


def test_a_disconnect_before_the_whole_response_frees_the_row(server, client):
    before = stats(client)["cancelled"]["consumer_closed"]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{server.url}/v1/responses",
            json={"model": MODEL, "input": "patient", "max_output_tokens": 1000},
            headers={"Authorization": f"Bearer {KEY}"},
            timeout=httpx.Timeout(30, read=0.2),
        )
    wait_for(lambda: stats(client)["cancelled"]["consumer_closed"] == before + 1, 10, "cancel")
    wait_for(lambda: stats(client)["active_rows"] == 0, 10, "the row freed")


def test_a_stream_cancelled_by_id_ends_with_response_failed(client):
    body = {"model": MODEL, "input": "cancel me", "max_output_tokens": 1000, "stream": True}
    events = []
    with client.stream("POST", "/v1/responses", json=body) as stream:
        request_id = stream.headers["x-request-id"]
        for line in stream.iter_lines():
            if line.startswith("data: "):
                events.append(json.loads(line.removeprefix("data: ")))
                if events[-1]["type"] == "response.output_text.delta" and len(events) == 5:
                    client.post(f"/v1/requests/{request_id}/cancel")
    failed = events[-1]
    EVENT_TYPES[failed["type"]].model_validate(failed)
    assert failed["type"] == "response.failed"
    error = failed["response"]["error"]
    assert error["code"] == "server_error"  # the Responses API's codes are a closed set
    assert error["message"] == "the request was cancelled: requested (request_cancelled)"
    assert failed["response"]["output"][0]["status"] == "incomplete"


def test_responses_are_counted_under_their_own_endpoint(sdk, client):
    sdk.responses.create(model=MODEL, input="count me", max_output_tokens=2)
    metrics = client.get("/metrics").text
    assert 'mlx_trio_requests_total{endpoint="responses",outcome="completed"}' in metrics


def test_the_store_keeps_the_most_recent_within_its_count_and_bytes():
    store = ResponseStore(max_count=2, max_bytes=10_000)
    turn = (ChatMessage("user", "x" * 1000),)
    for name in ("a", "b", "c"):
        store.put(name, stored(None, turn, {"id": name}))
    assert (store.get("a", None), len(store)) == (None, 2)  # the oldest went first
    assert store.get("c", 1) is None  # another key's
    store.put("big", stored(None, (ChatMessage("user", "x" * 8000),), {}))
    assert [store.get(n, None) is not None for n in ("b", "c", "big")] == [False, True, True]
    assert store.num_bytes <= store.max_bytes
    store.put("huge", stored(None, (ChatMessage("user", "x" * 20_000),), {}))
    assert store.get("huge", None) is None  # over the bound by itself: not kept
