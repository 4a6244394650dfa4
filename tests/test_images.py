"""Images in (issue 41, design/031-images.md): a tiny random Qwen2-VL built in a folder, served by
the real server, asked through the official SDKs. Its greedy text for an image is mlx-vlm's
own; text requests to it still batch; images that cannot be used get a 400 naming the part;
a text model refuses images; a reader that leaves frees the serial lane.
"""

from __future__ import annotations

import base64
import io
import json
import logging
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from PIL import Image

from mlx_trio.actors.config import RuntimeConfig
from mlx_trio.api.http_state import HttpSettings
from mlx_trio.api.images import ImageSettings
from mlx_trio.api.server import ServeOptions
from mlx_trio.engine.core import SERIAL_ROW, EngineCore
from mlx_trio.engine.generate import Engine
from mlx_trio.engine.model.loader import load_model
from mlx_trio.engine.options import EngineOptions
from mlx_trio.engine.outputs import RowOutput, RowProgress
from mlx_trio.engine.params import SamplingParams
from mlx_trio.engine.vocabulary.images import ImageInput
from mlx_trio.engine.vocabulary.prompt import ChatMessage, PlacedImage
from tests.families import save
from tests.server_thread import ServerThread, wait_for
from tests.tiny_vlm import build, data_url, png

QUESTION = "What is this?"
MAX_TOKENS = 10


def serve(model: Path, **http: object) -> ServerThread:
    options = ServeOptions(
        engine=EngineOptions(model=str(model), device="cpu", engine_process=False),
        runtime=RuntimeConfig(max_batch=8),
        http=HttpSettings(**http),  # type: ignore[arg-type]
    )
    return ServerThread(options)


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build(tmp_path_factory.mktemp("models") / "tiny-vlm")


@pytest.fixture(scope="module")
def server(vlm_dir: Path):
    # URLs allowed: a private address is still refused.
    with serve(vlm_dir, images=ImageSettings(allow_urls=True, max_pixels=4096 * 4096)) as running:
        running.wait_healthy()
        yield running


@pytest.fixture(scope="module")
def client(server: ServerThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def image_chat(client: openai.OpenAI, url: str) -> str:
    reply = client.chat.completions.create(
        model="tiny-vlm",
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": url}},
                    {"type": "text", "text": QUESTION},
                ],
            }
        ],
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    return reply.choices[0].message.content or ""


def mlx_vlm_text(model_dir: Path, *parts: str | bytes) -> str:
    """mlx-vlm's own greedy text for a user message of ``parts`` (text, or an image's bytes),
    its prompt rendered by the checkpoint's template as the server renders it."""
    import mlx_vlm

    model, processor = mlx_vlm.load(str(model_dir))
    content = [
        {"type": "text", "text": p} if isinstance(p, str) else {"type": "image"} for p in parts
    ]
    prompt = processor.tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    pictures = [Image.open(io.BytesIO(p)) for p in parts if isinstance(p, bytes)]
    result = mlx_vlm.generate(
        model, processor, prompt, image=pictures, max_tokens=MAX_TOKENS, temperature=0.0
    )
    return result.text


def stats(server: ServerThread) -> dict:
    return httpx.get(f"{server.url}/v1/stats").json()


def test_an_image_request_answers_as_mlx_vlm_does_and_the_image_matters(server, client, vlm_dir):
    first, second = png(112, 84, seed=1), png(112, 84, seed=2)
    text = image_chat(client, data_url(first))
    assert text == mlx_vlm_text(vlm_dir, first, QUESTION)
    assert text != image_chat(client, data_url(second))  # the image changes the answer
    assert text == image_chat(client, data_url(first))


def test_two_images_between_text_answer_as_mlx_vlm_does(server, client, vlm_dir):
    first, second = png(112, 84, seed=1), png(60, 90, seed=2)
    reply = client.chat.completions.create(
        model="tiny-vlm",
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": data_url(first)}},
                    {"type": "text", "text": "Compare this "},
                    {"type": "image_url", "image_url": {"url": data_url(second)}},
                    {"type": "text", "text": "with that."},
                ],
            }
        ],
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    expected = mlx_vlm_text(vlm_dir, first, "Compare this ", second, "with that.")
    assert reply.choices[0].message.content == expected
    assert reply.usage is not None and reply.usage.prompt_tokens > 2 * 4  # both images' tokens


def test_the_messages_and_responses_apis_take_the_same_image(server, client):
    image = png(112, 84, seed=1)
    expected = image_chat(client, data_url(image))
    claude = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
    message = claude.messages.create(
        model="tiny-vlm",
        max_tokens=MAX_TOKENS,
        extra_body={"temperature": 0},
        messages=[
            {
                "role": "user",
                "content": [
                    {
                        "type": "image",
                        "source": {
                            "type": "base64",
                            "media_type": "image/png",
                            "data": base64.b64encode(image).decode(),
                        },
                    },
                    {"type": "text", "text": QUESTION},
                ],
            }
        ],
    )
    assert "".join(b.text for b in message.content if b.type == "text") == expected
    response = client.responses.create(
        model="tiny-vlm",
        max_output_tokens=MAX_TOKENS,
        temperature=0,
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_image", "image_url": data_url(image), "detail": "auto"},
                    {"type": "input_text", "text": QUESTION},
                ],
            }
        ],
    )
    assert response.output_text == expected


def test_the_request_log_line_says_its_images_and_pixels(server, client, caplog):
    caplog.set_level(logging.INFO, logger="mlx_trio.http")
    image_chat(client, data_url(png(112, 84, seed=6)))
    lines = [r.getMessage() for r in caplog.records if "status=200" in r.getMessage()]
    assert len(lines) == 1 and " images=1 pixels=9408 " in lines[0]


def test_text_requests_to_a_vision_model_still_batch_and_images_take_the_serial_lane(
    server, client
):
    before = stats(server)
    for _ in range(3):
        image_chat(client, data_url(png(112, 84, seed=3)))
    middle = stats(server)
    assert middle["media"]["requests"] == before["media"]["requests"] + 3
    assert middle["media"]["images"] == before["media"]["images"] + 3
    assert middle["media"]["pixels"] == before["media"]["pixels"] + 3 * 112 * 84
    assert middle["rows_submitted"]["serial"] == before["rows_submitted"]["serial"] + 3
    texts = [
        client.chat.completions.create(
            model="tiny-vlm",
            messages=[{"role": "user", "content": f"Say {i}"}],
            max_tokens=6,
            temperature=0,
        )
        for i in range(4)
    ]
    assert all(t.choices[0].message.content for t in texts)
    after = stats(server)
    assert after["rows_submitted"]["batch"] == middle["rows_submitted"]["batch"] + 4
    assert after["rows_submitted"]["serial"] == middle["rows_submitted"]["serial"]


def huge_png() -> bytes:
    """5000 x 5000 pixels (over 4096 x 4096) in a few kilobytes."""
    out = io.BytesIO()
    Image.new("1", (5000, 5000)).save(out, format="PNG")
    return out.getvalue()


def truncated_png() -> bytes:
    whole = png(112, 84, seed=4)
    return whole[: len(whole) // 2]  # a header that opens, pixels that do not decode


@pytest.mark.parametrize(
    ("url", "says"),
    [
        (data_url(huge_png()), "5000x5000 (25000000 pixels), over this server's limit"),
        (data_url(truncated_png()), "could not be decoded"),
        (data_url(b"hello", "text/plain"), "type is text/plain, not image/*"),
        (data_url(b"not a picture at all"), "not an image"),
        ("http://127.0.0.1:9/cat.png", "private or local address"),
        ("http://[::1]:9/cat.png", "private or local address"),
        ("ftp://example.com/cat.png", "data: URL or http(s)"),
    ],
)
def test_an_image_that_cannot_be_used_is_a_400_naming_the_part(server, client, url, says):
    before = stats(server)
    with pytest.raises(openai.BadRequestError) as caught:
        image_chat(client, url)
    error = caught.value.body
    assert isinstance(error, dict)
    assert error["param"] == "messages.[0].content.[0]"
    assert error["message"].startswith("messages.[0].content.[0]: ")
    assert says in error["message"]
    after = stats(server)  # nothing admitted, nothing held
    assert after["live_sessions"] == 0
    assert after["media"] == before["media"]


def test_a_bad_image_block_is_an_anthropic_400_naming_the_block(server):
    claude = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(
            model="tiny-vlm",
            max_tokens=4,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": QUESTION},
                        {
                            "type": "image",
                            "source": {"type": "base64", "media_type": "image/png", "data": "@@"},
                        },
                    ],
                }
            ],
        )
    body = caught.value.body
    assert isinstance(body, dict) and body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"].startswith("messages.[0].content.[1]: ")


def test_a_reader_that_leaves_an_image_request_frees_the_serial_lane(server, client):
    image = data_url(png(112, 84, seed=5))
    before = stats(server)
    body = {
        "model": "tiny-vlm",
        "messages": [
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}}]}
        ],
        "max_tokens": 200,
        "stream": True,
    }
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body) as response:
        assert response.status_code == 200
    # It ended (cancelled consumer_closed, or completed first), and nothing is held.
    wait_for(lambda: stats(server)["live_sessions"] == 0, 30, "the session's end")
    after = stats(server)
    ended = after["completed"] + sum(after["cancelled"].values())
    assert ended == before["completed"] + sum(before["cancelled"].values()) + 1
    assert after["lane_mode"] == "idle" and after["kv_bytes"] == 0
    first = png(112, 84, seed=1)
    assert image_chat(client, data_url(first)) == image_chat(client, data_url(first))


def test_an_image_prompt_prefills_a_chunk_a_call_and_stops_between_them(vlm_dir):
    """The serial lane sees a reader who left between engine calls: an image prompt's prefill
    is a call a chunk, and a run stopped mid-prefill holds nothing and spoils no later run."""
    engine = Engine(load_model(str(vlm_dir), device="cpu"), prefill_step_size=8)
    core = EngineCore(engine, max_batch=2)
    image = ImageInput(png(112, 84, seed=1), "messages.[0].content.[0]", 4096 * 4096)
    message = ChatMessage("user", QUESTION, images=(PlacedImage(0, image),))
    request = engine.prepare([message], SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    assert len(request.prompt_tokens) > 3 * 8
    core.serial_start(request)
    first = core.serial_step()
    assert first == [RowProgress(SERIAL_ROW, 8, len(request.prompt_tokens))]  # no token yet
    core.serial_stop()
    assert core.num_rows == 0
    core.serial_start(request)
    events: list = []
    while not any(isinstance(e, RowOutput) and e.delta.finish_reason for e in events):
        events += core.serial_step()
    done = [e.done for e in events if isinstance(e, RowProgress)]
    assert done[:3] == [8, 16, 24] and done == sorted(done)
    text = "".join(e.delta.text for e in events if isinstance(e, RowOutput))
    assert text == mlx_vlm_text(vlm_dir, png(112, 84, seed=1), QUESTION)


@pytest.fixture(scope="module")
def text_server(tmp_path_factory: pytest.TempPathFactory):
    """A vision model of a family whose images this server does not take (Gemma 3's config
    has a ``vision_config``): it loads through mlx-lm as before images, and serves text."""
    model = save("gemma3_text", tmp_path_factory.mktemp("models") / "tiny-gemma3")
    config = json.loads((model / "config.json").read_text())
    config["vision_config"] = {"depth": 1, "hidden_size": 16}
    (model / "config.json").write_text(json.dumps(config))
    with serve(model) as running:  # image URLs off: the default
        running.wait_healthy()
        yield running


def test_a_vision_model_whose_images_are_not_taken_still_serves_text(text_server):
    client = openai.OpenAI(base_url=f"{text_server.url}/v1", api_key="none", max_retries=0)
    reply = client.chat.completions.create(
        model="tiny-gemma3",
        messages=[{"role": "user", "content": [{"type": "text", "text": QUESTION}]}],
        max_tokens=4,
    )
    assert reply.usage is not None and reply.usage.completion_tokens > 0


@pytest.mark.parametrize(
    ("url", "says"),
    [
        (data_url(png(32, 32)), "this model takes no images"),
        ("https://example.com/cat.png", "without --allow-image-urls"),
    ],
)
def test_a_text_model_or_a_server_without_urls_refuses_the_part(text_server, url, says):
    client = openai.OpenAI(base_url=f"{text_server.url}/v1", api_key="none", max_retries=0)
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model="tiny-gemma3",
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": QUESTION},
                        {"type": "image_url", "image_url": {"url": url}},
                    ],
                }
            ],
            max_tokens=4,
        )
    error = caught.value.body
    assert isinstance(error, dict) and error["param"] == "messages.[0].content.[1]"
    assert says in error["message"]


def test_a_screenshot_past_a_text_bodys_limit_is_taken_by_a_vision_model_only(server, text_server):
    """A random-noise PNG of 2.7 MB (3.6 MB as base64): past the 2 MiB body a text model's
    server takes (413), within a vision model's default, which has room for an image."""
    shot = data_url(png(960, 960, seed=3))
    assert len(shot) > 3 * 1024 * 1024
    body = {
        "model": "m",
        "max_tokens": 2,
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": QUESTION},
                    {"type": "image_url", "image_url": {"url": shot}},
                ],
            }
        ],
    }
    for running, status in ((server, 200), (text_server, 413)):
        body["model"] = "tiny-vlm" if running is server else "tiny-gemma3"
        reply = httpx.post(f"{running.url}/v1/chat/completions", json=body, timeout=60)
        assert reply.status_code == status, reply.text
