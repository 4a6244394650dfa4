"""The shared prompt cache does not leak prompts between clients (issue 34, red team 18).

``cached_tokens`` in a reply's usage let one client confirm a guess at another client's prompt:
send the guess, and a hit says someone sent it before. With several API keys each key's requests
reuse only their own entries, and a request's ``cache_salt`` (vLLM's field) partitions further.
The real server on a tiny checkpoint, the openai SDK as the clients.
"""

from __future__ import annotations

import openai
import pytest

from mlx_trio.actors.config import RuntimeConfig
from mlx_trio.api.http_state import HttpSettings
from mlx_trio.api.server import ServeOptions
from mlx_trio.engine.options import EngineOptions
from tests.families import save
from tests.server_thread import ServerThread

PROMPT = "You are a helpful assistant who answers briefly. What is the tallest mountain?"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    model = save("llama", tmp_path_factory.mktemp("models") / "tiny-llama")
    options = ServeOptions(
        engine=EngineOptions(
            model=str(model), device="cpu", engine_process=False, prompt_cache_bytes=64 << 20
        ),
        runtime=RuntimeConfig(max_batch=4),
        http=HttpSettings(api_keys=("alice-key", "bob-key")),
    )
    with ServerThread(options) as running:
        running.wait_healthy()
        yield running


def cached(server: ServerThread, key: str, salt: str | None = None) -> int:
    """``cached_tokens`` of a greedy chat of ``PROMPT`` with ``key`` (and ``salt``)."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=key, max_retries=0)
    reply = client.chat.completions.create(
        model="tiny-llama",
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=4,
        temperature=0,
        extra_body={"cache_salt": salt} if salt is not None else None,
    )
    assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
    return reply.usage.prompt_tokens_details.cached_tokens or 0


def test_one_keys_prompts_are_never_hits_for_another_key(server):
    assert cached(server, "alice-key") == 0
    assert cached(server, "alice-key") > 0  # alice's own repeat reuses her entry
    assert cached(server, "bob-key") == 0  # bob learns nothing of alice's prompt
    assert cached(server, "bob-key") > 0


def test_a_cache_salt_partitions_within_a_key(server):
    assert cached(server, "alice-key", salt="tenant-1") == 0
    assert cached(server, "alice-key", salt="tenant-2") == 0
    assert cached(server, "alice-key", salt="tenant-1") > 0


def test_an_empty_cache_salt_is_a_400_naming_it(server):
    with pytest.raises(openai.BadRequestError) as caught:
        cached(server, "alice-key", salt="")
    assert caught.value.body["param"] == "cache_salt"
