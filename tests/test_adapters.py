"""LoRA adapters served beside the default model (issue 40): each row with its own adapter, in
one batch, equal to mlx-lm's own LoRA layers; the prompt cache apart per adapter; an adapter
that does not fit refused at load; over HTTP as model ids and mlx_lm.server's ``adapters``."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import httpx
import mlx.core as mx
import openai
import pytest
import trio
from mlx_lm.generate import generate_step
from mlx_lm.tuner.utils import load_adapters

from mlx_trio.actors.config import RuntimeConfig
from mlx_trio.actors.messages import Completed, GenerationRequest
from mlx_trio.api.inprocess import open_runtime
from mlx_trio.api.server import ServeOptions
from mlx_trio.engine.batch.batch import BatchEngine
from mlx_trio.engine.errors import AdapterError, UnknownAdapterError
from mlx_trio.engine.generate import Engine
from mlx_trio.engine.model.loader import load_model
from mlx_trio.engine.model.random_model import random_adapter
from mlx_trio.engine.options import AdapterSpec, EngineOptions
from mlx_trio.engine.params import SamplingParams
from mlx_trio.engine.vocabulary.prompt import ChatMessage
from tests.server_thread import ServerThread
from tests.test_engine import run_batch

pytestmark = pytest.mark.e2e

GREEDY = SamplingParams(temperature=0, max_tokens=12)
PROMPTS = ("Tell me a story about a cat.", "What is the capital of France?")
ATTENTION = ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")
MLP = ("self_attn.k_proj", "mlp.up_proj")


def chat(text: str) -> tuple[ChatMessage, ...]:
    return (ChatMessage("user", text),)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two adapters of the default model: rank 4 over attention projections, rank 8 over MLP
    ones, each over its last 8 layers."""
    root = tmp_path_factory.mktemp("adapters")
    model = load_model(None, device="cpu").model
    return {
        "cat": random_adapter(model, root / "cat", seed=1, rank=4, keys=ATTENTION),
        "wide": random_adapter(model, root / "wide", seed=2, rank=8, keys=MLP),
    }


@pytest.fixture(scope="module")
def engine(adapters: dict[str, Path]) -> Engine:
    specs = [AdapterSpec(name, path) for name, path in adapters.items()]
    return Engine.load(None, device="cpu", prompt_cache_bytes=1 << 28, adapters=specs)


def reference(engine: Engine, adapter: Path | None, texts: tuple[str, ...]) -> list[list[int]]:
    """Greedy tokens of mlx-lm's own LoRA layers (``load_adapters``) over the same model."""
    model = load_model(None, device="cpu").model
    if adapter is not None:
        load_adapters(model, str(adapter))
    replies = []
    for text in texts:
        prompt = engine.prepare(chat(text), GREEDY).prompt_tokens
        steps = generate_step(mx.array(prompt), model, max_tokens=GREEDY.max_tokens)
        replies.append(upto_stop(engine, [int(token) for token, _ in steps]))
    return replies


def upto_stop(engine: Engine, tokens: list[int]) -> list[int]:
    """``tokens`` as the engine emits them: up to the first stop token, which is not sent."""
    stops = {engine.tokenizer.eos_token_id, *engine.tokenizer.eos_token_ids}
    cut = next((i for i, t in enumerate(tokens) if t in stops), len(tokens))
    return tokens[:cut]


def test_rows_of_each_adapter_in_one_batch_equal_mlx_lm_lora_layers(engine, adapters):
    """Six rows, two prompts on the base model and on each adapter, batched together: each
    row's greedy tokens are mlx-lm's own LoRA model's; the serial lane's too."""
    names: list[str | None] = [None, "cat", "wide"]
    want = {
        (name, text): tokens
        for name in names
        for text, tokens in zip(
            PROMPTS, reference(engine, adapters.get(name or ""), PROMPTS), strict=True
        )
    }
    assert want[("cat", PROMPTS[0])] != want[(None, PROMPTS[0])]  # the adapter changes text
    assert want[("wide", PROMPTS[0])] != want[("cat", PROMPTS[0])]
    batch = BatchEngine(engine, max_batch=8)
    rows = {
        batch.add(replace(engine.prepare(chat(text), GREEDY), adapter=name)): (name, text)
        for name in names
        for text in PROMPTS
    }
    got = run_batch(batch)
    assert {rows[row]: tokens for row, tokens in got.items()} == want
    serial = replace(engine.prepare(chat(PROMPTS[1]), GREEDY), adapter="wide")
    tokens = [t for delta in engine.generate(serial) for t in delta.token_ids]
    assert tokens == want[("wide", PROMPTS[1])]


def test_fused_projections_keep_adapters(engine, adapters):
    """Fused query, key and value projections (the GPU's default) under an adapter give the
    tokens of the unfused model under it."""
    fused = Engine.load(
        None, device="cpu", fuse=True, adapters=[AdapterSpec("cat", adapters["cat"])]
    )
    texts = []
    for each in (engine, fused):  # a salt of its own: no prompt-cache hit from other tests
        request = replace(each.prepare(chat(PROMPTS[0]), GREEDY), adapter="cat", cache_salt="f")
        texts.append([t for delta in each.generate(request) for t in delta.token_ids])
    assert texts[0] == texts[1] and texts[0]


def test_the_prompt_cache_never_serves_one_adapters_prefix_to_another(engine):
    prompt = chat("Name three colours of the rainbow, please.")

    def cached(adapter: str | None) -> int:
        # A salt of the test's own: earlier tests left the chat template's prefix everywhere.
        request = replace(engine.prepare(prompt, GREEDY), adapter=adapter, cache_salt="colours")
        generation = engine.generate(request)
        list(generation)
        return generation.stats().cached_tokens

    assert cached("cat") == 0
    assert cached("wide") == 0  # the same prompt, another adapter: nothing of cat's
    assert cached(None) == 0
    assert cached("cat") >= len(engine.prepare(prompt, GREEDY).prompt_tokens) - 1  # its own


def test_an_adapter_that_does_not_fit_is_refused_naming_it(tmp_path, adapters):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text((adapters["cat"] / "adapter_config.json").read_text())
    weights = mx.load(str(adapters["cat"] / "adapters.safetensors"))
    key = next(k for k in weights if k.endswith("q_proj.lora_a"))
    mx.save_safetensors(str(bad / "adapters.safetensors"), {**weights, key: mx.zeros((7, 4))})
    with pytest.raises(AdapterError, match=r"adapter 'bad'.*q_proj maps 576 -> 576, its adapter 7"):
        Engine.load(None, device="cpu", adapters=[AdapterSpec("bad", bad)])
    missing = {"model.layers.0.self_attn.nothing.lora_a": mx.zeros((576, 4))}
    missing["model.layers.0.self_attn.nothing.lora_b"] = mx.zeros((4, 576))
    mx.save_safetensors(str(bad / "adapters.safetensors"), missing)
    with pytest.raises(AdapterError, match=r"has no module model\.layers\.0\.self_attn\.nothing"):
        Engine.load(None, device="cpu", adapters=[AdapterSpec("bad", bad)])
    (bad / "adapter_config.json").write_text(json.dumps({"fine_tune_type": "dora"}))
    with pytest.raises(AdapterError, match="fine_tune_type 'dora' is not served"):
        Engine.load(None, device="cpu", adapters=[AdapterSpec("bad", bad)])


def test_the_in_process_api_runs_a_named_adapter_and_refuses_an_unknown_one(adapters):
    async def main() -> tuple[str, str]:
        async with open_runtime(device="cpu", adapters={"cat": adapters["cat"]}) as rt:
            assert [a.name for a in rt.adapters] == ["cat"]
            assert rt.config.max_batch == 32  # none given: the CPU's default
            with pytest.raises(UnknownAdapterError, match="adapter 'dog' is not served"):
                await rt.submit(GenerationRequest(chat(PROMPTS[0]), GREEDY, adapter="dog"))
            tuned = await rt.collect(GenerationRequest(chat(PROMPTS[0]), GREEDY, adapter="cat"))
            base = await rt.collect(GenerationRequest(chat(PROMPTS[0]), GREEDY))
            assert isinstance(tuned.outcome, Completed)
            return tuned.text, base.text

    tuned, base = trio.run(main)
    assert tuned and base and tuned != base


@pytest.fixture(scope="module")
def server(adapters):
    specs = tuple(AdapterSpec(name, path) for name, path in adapters.items())
    options = ServeOptions(
        engine=EngineOptions(device="cpu", adapters=specs), runtime=RuntimeConfig(max_batch=8)
    )
    with ServerThread(options) as running:
        running.wait_healthy()
        yield running


def test_over_http_adapters_are_models_and_mixed_streams_match_each_alone(server, engine):
    """``/v1/models`` lists each adapter over the base model; 8 concurrent greedy streams,
    half on an adapter, each equal to the engine's own run of it; ``/v1/stats`` counts them."""
    sdk = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    models = {m.id: m for m in sdk.models.list().data}
    base = next(iter(models))
    assert set(models) == {base, "cat", "wide"}
    assert models["cat"].model_extra["parent"] == base
    assert models["wide"].model_extra["adapter"]["rank"] == 8

    jobs = [(model, text) for model in (base, "cat") for text in PROMPTS for _ in range(2)]

    def alone(adapter: str | None, text: str) -> str:
        request = replace(engine.prepare(chat(text), GREEDY), adapter=adapter)
        return "".join(delta.text for delta in engine.generate(request))

    # Each of the four (model, prompt) pairs once: its two streams must both equal it.
    want = {job: alone(None if job[0] == base else job[0], job[1]) for job in dict.fromkeys(jobs)}

    async def stream(sdk: openai.AsyncOpenAI, model: str, text: str) -> str:
        chunks = await sdk.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": text}],
            max_tokens=GREEDY.max_tokens,
            temperature=0,
            stream=True,
            extra_body={"repetition_penalty": 1.0},  # the model's default is 1.1; GREEDY's off
        )
        return "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])

    async def main() -> list[str]:
        results: list[str] = [""] * len(jobs)
        async with openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused") as sdk:

            async def one(i: int) -> None:
                results[i] = await stream(sdk, *jobs[i])

            async with trio.open_nursery() as nursery:
                for i in range(len(jobs)):
                    nursery.start_soon(one, i)
        return results

    got = trio.run(main)
    for job, reply in zip(jobs, got, strict=True):
        assert reply == want[job], job
    stats = httpx.get(f"{server.url}/v1/stats").json()["adapters"]
    assert {a["name"]: a["requests"] for a in stats} == {"cat": 4, "wide": 0}


def test_mlx_lm_servers_adapters_field_names_an_adapter_by_directory(server, adapters):
    body = {
        "model": "default_model",
        "messages": [{"role": "user", "content": PROMPTS[1]}],
        "max_tokens": 8,
        "temperature": 0,
    }
    base_id = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
    by_path = {**body, "model": base_id, "adapters": str(adapters["wide"])}
    by_name = {**body, "model": "wide"}
    texts = [
        httpx.post(f"{server.url}/v1/chat/completions", json=b).json()["choices"][0]["message"]
        for b in (by_path, by_name)
    ]
    assert texts[0] == texts[1]
    unknown = httpx.post(
        f"{server.url}/v1/chat/completions", json={**by_path, "adapters": "/no/such/adapter"}
    )
    assert unknown.status_code == 400
    error = unknown.json()["error"]
    assert (error["param"], error["code"]) == ("adapters", "adapter_not_found")
    assert "'cat', 'wide'" in error["message"]
    wrong_model = httpx.post(f"{server.url}/v1/chat/completions", json={**body, "model": "dog"})
    assert wrong_model.status_code == 404 and "'wide'" in wrong_model.json()["error"]["message"]


def test_generate_with_an_adapter_that_does_not_fit_is_one_line(tmp_path, adapters):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_config.json").write_text(json.dumps({"fine_tune_type": "full"}))
    (bad / "adapters.safetensors").write_bytes(
        (adapters["cat"] / "adapters.safetensors").read_bytes()
    )
    done = subprocess.run(
        [sys.executable, "-m", "mlx_trio.api.cli", "generate", "hi", "--adapter-path", str(bad)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("mlx-trio: error: adapter 'adapter'") and "'full' is not served" in last
