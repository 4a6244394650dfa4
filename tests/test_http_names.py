"""What agents and browser clients need around the generating endpoints: several served model
names, CORS, and vLLM's /tokenize and /detokenize; the real server over the scripted engine
(its tokens are the prompt's characters: ``ord(c)``)."""

from __future__ import annotations

from collections.abc import Iterator

import anthropic
import httpx
import openai
import pytest

from mlx_trio.actors.config import RuntimeConfig
from mlx_trio.actors.testing.scripted import token_text
from mlx_trio.api.http_state import HttpSettings
from tests.server_thread import ServerThread, scripted_server

ORIGIN = "http://app.example"
KEY = "sk-names"


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    http = HttpSettings(
        served_model_names=("claude-sonnet-4-5", "gpt-5-codex"),
        allowed_origins=(ORIGIN,),
        api_keys=(KEY,),
    )
    with scripted_server(RuntimeConfig(max_batch=4), http) as running:
        yield running


@pytest.fixture
def http(server: ServerThread) -> Iterator[httpx.Client]:
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=30) as client:
        yield client


def test_every_served_name_is_listed_and_answers_under_its_own_name(server: ServerThread):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY)
    assert [m.id for m in client.models.list().data] == ["claude-sonnet-4-5", "gpt-5-codex"]
    for name in ("claude-sonnet-4-5", "gpt-5-codex"):
        reply = client.chat.completions.create(
            model=name, messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
        assert reply.model == name
        assert reply.choices[0].message.content


def test_the_anthropic_sdk_lists_the_served_names_too(server: ServerThread):
    client = anthropic.Anthropic(base_url=server.url, api_key=KEY)
    page = client.models.list()
    assert [(m.id, m.display_name, m.type) for m in page.data] == [
        ("claude-sonnet-4-5", "claude-sonnet-4-5", "model"),
        ("gpt-5-codex", "gpt-5-codex", "model"),
    ]
    assert page.has_more is False and page.last_id == "gpt-5-codex"


def test_a_name_not_served_is_a_404_that_lists_the_names(server: ServerThread):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY)
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(
            model="scripted", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    assert caught.value.body["code"] == "model_not_found"
    assert "'claude-sonnet-4-5', 'gpt-5-codex'" in caught.value.body["message"]


def test_a_browser_preflight_from_an_allowed_origin_is_answered_without_a_key(
    server: ServerThread,
):
    preflight = httpx.options(
        f"{server.url}/v1/chat/completions",
        headers={
            "Origin": ORIGIN,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        },
    )
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == ORIGIN
    assert "authorization" in preflight.headers["access-control-allow-headers"].lower()


def test_cors_headers_reach_answers_and_refusals_of_allowed_origins_only(
    server: ServerThread, http: httpx.Client
):
    allowed = http.get("/v1/models", headers={"Origin": ORIGIN})
    assert allowed.headers["access-control-allow-origin"] == ORIGIN
    refused = httpx.get(f"{server.url}/v1/models", headers={"Origin": ORIGIN})
    assert refused.status_code == 401  # no key: the page can read why
    assert refused.headers["access-control-allow-origin"] == ORIGIN
    other = http.get("/v1/models", headers={"Origin": "http://elsewhere.example"})
    assert "access-control-allow-origin" not in other.headers


def test_tokenize_counts_a_prompt_or_a_chat_against_the_context(http: httpx.Client):
    text = http.post("/tokenize", json={"prompt": "hi!", "return_token_strs": True}).json()
    assert text["tokens"] == [ord("h"), ord("i"), ord("!")]
    assert text["count"] == 3
    assert text["max_model_len"] == 4096
    assert text["token_strs"] == [token_text(t) for t in text["tokens"]]
    chat = http.post(
        "/tokenize",
        json={"model": "gpt-5-codex", "messages": [{"role": "user", "content": "abcd"}]},
    ).json()
    assert chat["count"] == 4 and chat["token_strs"] is None
    long = http.post("/tokenize", json={"prompt": "x" * 5000}).json()
    assert long["count"] == 5000 > long["max_model_len"]  # counted, not refused


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({}, "prompt"),
        ({"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt"),
        ({"messages": []}, "messages"),
        ({"prompt": "a", "model": "nope"}, "model"),
    ],
)
def test_a_bad_tokenize_request_is_a_400_or_404_naming_its_field(http: httpx.Client, body, param):
    answer = http.post("/tokenize", json=body)
    assert answer.status_code == (404 if param == "model" else 400)
    assert answer.json()["error"]["param"] == param


def test_detokenize_gives_back_the_text_of_token_ids(http: httpx.Client):
    answer = http.post("/detokenize", json={"tokens": [104, 105]})
    assert answer.json() == {"prompt": token_text(104) + token_text(105)}
    assert http.post("/detokenize", json={"tokens": ["a"]}).status_code == 400
