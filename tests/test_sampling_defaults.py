"""Sampling defaults: a model's generation_config.json, serve's flags, and what a request omits.

Unit tests of the parsing and the precedence, then the in-process runtime and the HTTP server
on the scripted engine, recording the params each request reaches the engine with.
"""

from __future__ import annotations

import json
import logging
import pickle
from collections.abc import Iterator

import httpx
import openai
import pytest

from mlx_trio.actors.messages import GenerationRequest
from mlx_trio.actors.testing.scripted import ScriptedEngine
from mlx_trio.api.http import build_app
from mlx_trio.api.http_state import AppState, HttpSettings
from mlx_trio.api.inprocess import open_runtime
from mlx_trio.api.schemas import ChatCompletionRequest, CompletionRequest
from mlx_trio.api.server import ServeOptions
from mlx_trio.engine.errors import InvalidRequestError
from mlx_trio.engine.params import SamplingParams
from mlx_trio.engine.vocabulary.prompt import Prompt
from mlx_trio.engine.vocabulary.sampling_defaults import SamplingDefaults, built_in, describe
from tests.server_thread import ServerThread

MODEL = SamplingDefaults(temperature=0.2, top_p=0.9, top_k=40, max_tokens=3)
FLAGS = SamplingDefaults(top_p=0.5, min_p=0.1, max_tokens=4)
QUESTION = [{"role": "user", "content": "hi"}]


class RecordingEngine(ScriptedEngine):
    """The scripted engine, keeping the params of every request it prepares."""

    def __init__(self, sampling_defaults: SamplingDefaults) -> None:
        super().__init__(sampling_defaults=sampling_defaults)
        self.params: list[SamplingParams] = []

    async def prepare(self, prompt: Prompt, params: SamplingParams):
        self.params.append(params)
        return await super().prepare(prompt, params)


def knobs(params: SamplingParams) -> tuple:
    return (
        params.temperature,
        params.top_p,
        params.top_k,
        params.min_p,
        params.repetition_penalty,
        params.max_tokens,
    )


# -- generation_config.json ---------------------------------------------------------------


def test_the_hugging_face_keys_become_defaults():
    config = {
        "bos_token_id": 1,
        "temperature": 0.6,
        "top_p": 0.95,
        "top_k": 20,
        "min_p": 0.05,
        "repetition_penalty": 1.05,
        "max_new_tokens": 100,
    }
    assert SamplingDefaults.from_generation_config(config) == SamplingDefaults(
        temperature=0.6, top_p=0.95, top_k=20, min_p=0.05, repetition_penalty=1.05, max_tokens=100
    )


@pytest.mark.parametrize(("do_sample", "temperature"), [(False, 0.0), (True, 0.7), (None, 0.7)])
def test_do_sample_false_means_greedy(do_sample, temperature):
    config = {"temperature": 0.7} | ({} if do_sample is None else {"do_sample": do_sample})
    assert SamplingDefaults.from_generation_config(config).temperature == temperature


def test_values_out_of_range_are_left_out_and_logged(caplog):
    config = {"temperature": 5, "top_p": 0.9, "top_k": "many", "max_new_tokens": 0}
    with caplog.at_level(logging.WARNING):
        assert SamplingDefaults.from_generation_config(config) == SamplingDefaults(top_p=0.9)
    assert "ignoring temperature=5 (temperature must be in [0, 2], got 5)" in caplog.text
    assert "ignoring top_k='many'" in caplog.text
    assert "ignoring max_new_tokens=0" in caplog.text


def test_a_model_directory_without_a_usable_file_has_no_defaults(tmp_path):
    assert SamplingDefaults.read(tmp_path) == SamplingDefaults()
    path = tmp_path / "generation_config.json"
    for text in ("{not json", "[0.2]"):
        path.write_text(text)
        assert SamplingDefaults.read(tmp_path) == SamplingDefaults()
    path.write_text(json.dumps({"temperature": 0.2, "eos_token_id": [2]}))
    assert SamplingDefaults.read(tmp_path) == SamplingDefaults(temperature=0.2)


def test_a_flag_out_of_range_is_refused_naming_it():
    with pytest.raises(InvalidRequestError, match=r"^top_p must be in \(0, 1\], got 0$") as info:
        SamplingDefaults(top_p=0)
    assert info.value.param == "top_p"


def test_defaults_pickle_for_the_engine_process():
    assert pickle.loads(pickle.dumps(MODEL)) == MODEL


def test_the_log_line_names_where_each_value_comes_from():
    layers = [("flag", FLAGS), ("model", MODEL), ("built-in", built_in(max_tokens=512))]
    assert describe(layers) == (
        "temperature=0.2 (model) top_p=0.5 (flag) top_k=40 (model) min_p=0.1 (flag) "
        "repetition_penalty=1 (built-in) max_tokens=4 (flag)"
    )


# -- the in-process runtime ---------------------------------------------------------------


async def test_a_request_without_params_samples_with_the_models_defaults(autojump_clock):
    engine = RecordingEngine(MODEL)
    async with open_runtime(engine=engine) as rt:
        assert rt.sampling_defaults == MODEL
        collected = await rt.collect(GenerationRequest("hello"))
        explicit = await rt.collect(GenerationRequest("hello", SamplingParams(max_tokens=5)))
    assert collected.outcome.usage.completion_tokens == 3
    assert knobs(engine.params[0]) == (0.2, 0.9, 40, 0.0, 1.0, 3)
    assert explicit.outcome.usage.completion_tokens == 5
    assert knobs(engine.params[1]) == (1.0, 1.0, 0, 0.0, 1.0, 5)


# -- the HTTP edge: precedence --------------------------------------------------------


def test_each_field_takes_the_request_then_the_flag_then_the_model_then_openai():
    defaults = FLAGS.over(MODEL)
    omitted = ChatCompletionRequest(model="m", messages=QUESTION)
    params = omitted.params(default_max_tokens=512, defaults=defaults)
    assert knobs(params) == (0.2, 0.5, 40, 0.1, 1.0, 4)

    given = ChatCompletionRequest(
        model="m", messages=QUESTION, temperature=0, top_p=1, top_k=0, min_p=0, max_tokens=9
    )
    assert knobs(given.params(default_max_tokens=512, defaults=defaults)) == (0, 1, 0, 0, 1.0, 9)

    assert knobs(omitted.params(default_max_tokens=512)) == (1.0, 1.0, 0, 0.0, 1.0, 512)


def test_max_tokens_takes_the_defaults_then_each_endpoints_own():
    text = CompletionRequest(model="m", prompt="hi")
    assert text.params(default_max_tokens=512).max_tokens == 16
    assert text.params(default_max_tokens=512, defaults=MODEL).max_tokens == 3
    chat = ChatCompletionRequest(model="m", messages=QUESTION, max_completion_tokens=7)
    assert chat.params(default_max_tokens=512, defaults=MODEL).max_tokens == 7


# -- the HTTP server ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    options = ServeOptions(http=HttpSettings(sampling=FLAGS))
    with ServerThread(options, engine=RecordingEngine(MODEL)) as running:
        yield running


def test_models_lists_the_defaults_that_apply_and_the_sdk_still_parses_it(server):
    sdk = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    [model] = sdk.models.list().data
    assert model.id == "scripted"
    assert model.model_extra["sampling_defaults"] == {
        "temperature": {"value": 0.2, "source": "model"},
        "top_p": {"value": 0.5, "source": "flag"},
        "top_k": {"value": 40, "source": "model"},
        "min_p": {"value": 0.1, "source": "flag"},
        "repetition_penalty": {"value": 1.0, "source": "built-in"},
        "max_tokens": {"value": 4, "source": "flag"},
    }


def test_a_request_gets_defaults_only_for_what_it_omits(server):
    engine: RecordingEngine = server.engine
    sdk = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    reply = sdk.chat.completions.create(model="scripted", messages=QUESTION)
    assert reply.usage.completion_tokens == 4
    assert knobs(engine.params[-1]) == (0.2, 0.5, 40, 0.1, 1.0, 4)
    sdk.chat.completions.create(
        model="scripted", messages=QUESTION, temperature=0.7, top_p=1, max_tokens=2
    )
    assert knobs(engine.params[-1]) == (0.7, 1, 40, 0.1, 1.0, 2)


async def test_the_model_list_before_the_model_loads_is_empty():
    # serve listens before it loads: /v1/models answers (empty) while there is no runtime
    transport = httpx.ASGITransport(app=build_app(AppState(HttpSettings())))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        response = await client.get("/v1/models")
    assert response.json()["data"] == []
