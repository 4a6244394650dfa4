"""OpenAI-compatible request bodies (pydantic) and their translation to runtime requests.

Type errors are pydantic's; range errors come from ``SamplingParams`` with the OpenAI
parameter name as ``param``. Unknown fields are ignored, as OpenAI-compatible servers do.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from mlx_trio.engine.errors import InvalidRequestError
from mlx_trio.engine.params import SamplingParams
from mlx_trio.engine.prompt import ChatMessage
from mlx_trio.engine.sampling_defaults import NO_DEFAULTS, SamplingDefaults

Number = Annotated[float, Field(allow_inf_nan=False)]
COMPLETIONS_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TextPart(_Body):
    type: Literal["text"]
    text: str


class Message(_Body):
    role: str
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(_Body):
    include_usage: StrictBool = False


class _Sampling(_Body):
    model: str
    max_tokens: StrictInt | None = None
    temperature: Number | None = None
    top_p: Number | None = None
    top_k: StrictInt | None = None
    min_p: Number | None = None
    repetition_penalty: Number | None = None
    presence_penalty: Number | None = None
    frequency_penalty: Number | None = None
    logit_bias: dict[str, Number] | None = None
    seed: StrictInt | None = None
    stop: str | list[str] | None = None
    n: StrictInt = 1
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    timeout: Number | None = Field(default=None, description="seconds; mlx-trio extension")

    def _stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def _logit_bias(self) -> dict[int, float]:
        bias = {}
        for key, value in (self.logit_bias or {}).items():
            try:
                bias[int(key)] = value
            except ValueError:
                raise InvalidRequestError(
                    f"logit_bias keys must be token ids, got {key!r}", param="logit_bias"
                ) from None
        return bias

    def sampling_params(
        self,
        *,
        max_tokens: int,
        logprobs: bool,
        top_logprobs: int,
        seed_offset: int = 0,
        defaults: SamplingDefaults = NO_DEFAULTS,
    ) -> SamplingParams:
        """The request's values; ``defaults`` (then OpenAI's) for the sampling fields omitted."""
        return defaults.params(
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            logit_bias=self._logit_bias(),
            seed=None if self.seed is None else self.seed + seed_offset,
            stop=self._stops(),
            logprobs=logprobs,
            top_logprobs=top_logprobs,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_Sampling):
    messages: list[Message]
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None

    def chat(self) -> tuple[ChatMessage, ...]:
        if not self.messages:
            raise InvalidRequestError("messages must not be empty", param="messages")
        return tuple(ChatMessage(m.role, m.text()) for m in self.messages)

    def params(
        self,
        *,
        default_max_tokens: int,
        seed_offset: int = 0,
        defaults: SamplingDefaults = NO_DEFAULTS,
    ) -> SamplingParams:
        limits = (self.max_completion_tokens, self.max_tokens, defaults.max_tokens)
        max_tokens = next((v for v in limits if v is not None), default_max_tokens)
        return self.sampling_params(
            max_tokens=max_tokens,
            logprobs=self.logprobs,
            top_logprobs=self.top_logprobs or 0,
            seed_offset=seed_offset,
            defaults=defaults,
        )


class CompletionRequest(_Sampling):
    prompt: str | list[str]
    logprobs: StrictInt | None = None
    echo: StrictBool = False

    def prompts(self) -> list[str]:
        prompts = [self.prompt] if isinstance(self.prompt, str) else self.prompt
        if not prompts:
            raise InvalidRequestError("prompt must not be empty", param="prompt")
        if self.echo:
            raise InvalidRequestError("echo is not supported", param="echo")
        return prompts

    def params(
        self,
        *,
        default_max_tokens: int,
        seed_offset: int = 0,
        defaults: SamplingDefaults = NO_DEFAULTS,
    ) -> SamplingParams:
        limits = (self.max_tokens, defaults.max_tokens)
        return self.sampling_params(
            max_tokens=next((v for v in limits if v is not None), COMPLETIONS_MAX_TOKENS),
            logprobs=self.logprobs is not None,
            top_logprobs=self.logprobs or 0,
            seed_offset=seed_offset,
            defaults=defaults,
        )
