"""Images in for the vision-language families beyond Qwen2-VL (design/031-images.md): a tiny
random checkpoint of each, built in a folder, served by the real server and asked through the
openai SDK. An image request answers with mlx-vlm's own greedy text, and another image changes
it; text requests to the same model batch, each answering mlx-vlm's own text.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from mlx_trio.engine.generate import Engine
from mlx_trio.engine.generation import Generation
from mlx_trio.engine.model.loader import load_model
from mlx_trio.engine.model.vision import has_vision_weights
from mlx_trio.engine.params import SamplingParams
from mlx_trio.engine.vocabulary.images import ImageInput
from mlx_trio.engine.vocabulary.prompt import ChatMessage, PlacedImage
from tests import families
from tests.test_images import MAX_TOKENS, QUESTION, image_chat, mlx_vlm_text, serve
from tests.tiny_vlm import build, data_url, png

FAMILIES = ["qwen3_5", "qwen3_5_moe", "qwen3_vl", "qwen3_vl_moe"]


@pytest.fixture(scope="module", params=FAMILIES)
def family_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    family = request.param
    return build(tmp_path_factory.mktemp(family) / "tiny-vlm", family=family)  # image_chat's name


@pytest.fixture(scope="module")
def family_client(family_dir: Path):
    with serve(family_dir) as running:
        running.wait_healthy()
        yield running, openai.OpenAI(base_url=f"{running.url}/v1", api_key="none", max_retries=0)


def test_an_image_request_answers_as_mlx_vlm_does_and_the_image_matters(family_client, family_dir):
    _, client = family_client
    first, second = png(112, 84, seed=1), png(112, 84, seed=2)
    text = image_chat(client, data_url(first))
    assert text == mlx_vlm_text(family_dir, first, QUESTION)
    assert text != image_chat(client, data_url(second))  # the image changes the answer
    assert text == image_chat(client, data_url(first))  # nothing is left over from the last


def test_an_image_prompt_prefilled_in_chunks_answers_as_mlx_vlm_does(family_dir):
    """Chunks of 8 tokens: the image's positions, Qwen3-VL's deepstack features and Qwen3.5's
    recurrent state are each taken up a chunk at a time."""
    engine = Engine(load_model(str(family_dir), device="cpu"), prefill_step_size=8)
    image = ImageInput(png(112, 84, seed=1), "messages.[0].content.[0]", 4096 * 4096)
    message = ChatMessage("user", QUESTION, images=(PlacedImage(0, image),))
    request = engine.prepare([message], SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    assert len(request.prompt_tokens) > 3 * 8
    text = "".join(d.text for d in Generation(engine, request, None))
    assert text == mlx_vlm_text(family_dir, png(112, 84, seed=1), QUESTION)


def test_text_requests_batch_and_answer_as_mlx_vlm_does(family_client, family_dir):
    server, client = family_client
    before = httpx.get(f"{server.url}/v1/stats").json()
    questions = [f"Say {'a' * (3 * i)} {i}" for i in range(4)]  # different lengths: padding

    def ask(question: str) -> str:
        reply = client.chat.completions.create(
            model="tiny-vlm",
            messages=[{"role": "user", "content": question}],
            max_tokens=MAX_TOKENS,
            temperature=0,
        )
        return reply.choices[0].message.content or ""

    with ThreadPoolExecutor(len(questions)) as pool:
        texts = list(pool.map(ask, questions))
    assert texts == [mlx_vlm_text(family_dir, q) for q in questions]
    after = httpx.get(f"{server.url}/v1/stats").json()
    assert after["rows_submitted"]["batch"] == before["rows_submitted"]["batch"] + 4
    assert after["rows_submitted"]["serial"] == before["rows_submitted"]["serial"]


def test_qwen3_5s_text_model_holds_mlx_vlms_arrays_quantized_as_they_are(tmp_path):
    """On a GPU a quantized checkpoint stays quantized: mlx-lm's class for Qwen3.5's text is
    quantized where mlx-vlm's language model is, holds its arrays and gives its logits."""
    import json

    import mlx.core as mx
    import mlx.nn as nn
    import mlx_vlm
    from mlx_lm.models.cache import make_prompt_cache

    from mlx_trio.engine.model.vision import VisionParts, language_model

    path = build(tmp_path / "tiny-vlm", family="qwen3_5")
    model, processor = mlx_vlm.load(str(path))
    nn.quantize(
        model.language_model,
        group_size=32,
        bits=8,
        class_predicate=lambda _p, m: isinstance(m, nn.Linear) and m.weight.shape[-1] % 32 == 0,
    )
    config = json.loads((path / "config.json").read_text())
    config["quantization"] = {"group_size": 32, "bits": 8}
    text = language_model(VisionParts(model, processor, "qwen3_5"), config)
    assert any(isinstance(m, nn.QuantizedLinear) for _, m in text.named_modules())
    theirs = model.language_model.model.layers[0].linear_attn.in_proj_qkv.weight
    assert text.language_model.model.layers[0].linear_attn.in_proj_qkv.weight is theirs
    ids = mx.array([[5, 9, 30, 41, 2, 7]])
    ours = text(ids, cache=make_prompt_cache(text))
    expected = model.language_model(ids, cache=model.language_model.make_cache()).logits
    assert mx.allclose(ours, expected, atol=1e-4).item()


def test_a_text_only_conversion_of_a_vision_model_serves_text_through_mlx_lm(tmp_path):
    """A conversion that dropped the tower (as mlx-lm's does) keeps the ``vision_config``: with
    no vision weights to load, the checkpoint is a text model, as it was before images."""
    model = families.save("qwen3_5", tmp_path / "qwen3_5-text")
    config = json.loads((model / "config.json").read_text())
    config["vision_config"] = {"depth": 1, "hidden_size": 16}
    (model / "config.json").write_text(json.dumps(config))
    assert not has_vision_weights(model)
    assert has_vision_weights(build(tmp_path / "with-tower", family="qwen3_5"))
    loaded = load_model(str(model), device="cpu")
    assert loaded.vision is None
    engine = Engine(loaded)
    request = engine.prepare("Hello", SamplingParams(max_tokens=3, temperature=0))
    assert len([t for d in engine.generate(request) for t in d.token_ids]) == 3
