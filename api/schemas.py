"""OpenAI-compatible request bodies (pydantic) and their translation to runtime requests.

Type errors are pydantic's, named by :func:`error_param` as OpenAI names them
(``messages.[0].content``); range errors come from ``SamplingParams``, named by the field the
client sent (``max_completion_tokens`` or ``max_tokens``). A field of OpenAI's that would change
what is generated and that this server does not implement (``functions``, ``audio``, ...) gets
a 400 naming it: answering 200 with free text to a client that asked for something else is worse
than a clear refusal. Fields OpenAI does not define are ignored, and
logged once per name.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt

from ..engine.errors import InvalidRequestError
from ..engine.params import MAX_SEED, Grammar, SamplingParams, Speculation
from ..engine.vocabulary.images import ImageInput
from ..engine.vocabulary.prompt import Chat
from ..engine.vocabulary.sampling_defaults import NO_DEFAULTS, SamplingDefaults
from ..engine.vocabulary.tools import Tool, ToolChoice, call_grammar, check_choice
from .chat_parts import (
    Body,
    CalledFunction,
    FunctionName,
    FunctionSpec,
    ImageURL,
    ImageURLPart,
    Message,
    MessageToolCall,
    NamedToolChoice,
    ResponseFormat,
    TextPart,
    ToolSpec,
)
from .field_names import fields_of, format_param, log_ignored
from .images import ImageRef

Number = Annotated[float, Field(allow_inf_nan=False)]
COMPLETIONS_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]
# OpenAI's fields that change what is generated and that this server does not implement yet.
UNSUPPORTED_CHAT_FIELDS = frozenset(
    {
        "functions",  # OpenAI's deprecated form of tools
        "function_call",
        "audio",
        "prediction",
        "web_search_options",
        "verbosity",
    }
)
UNSUPPORTED_COMPLETION_FIELDS = frozenset({"suffix", "best_of"})
# OpenAI's fields that change nothing here (metadata, storage, routing): accepted, ignored.
NO_EFFECT_FIELDS = frozenset(
    {"user", "store", "metadata", "service_tier", "prompt_cache_key", "safety_identifier"}
)


class StreamOptions(Body):
    include_usage: StrictBool = False


class SpeculativeOptions(Body):
    """mlx-trio's extension: how a request's tokens are drafted and verified (``method``
    ``prompt_lookup`` or ``none``; the server's ``--speculative`` default for what is left out)."""

    method: str
    num_draft_tokens: StrictInt | None = None
    ngram_size: StrictInt | None = None

    def speculation(self) -> Speculation:
        return Speculation(self.method, self.num_draft_tokens, self.ngram_size)  # type: ignore[arg-type]


class _Sampling(Body):
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
    timeout: Number | None = Field(default=None, gt=0, description="seconds; mlx-trio extension")
    # vLLM's: the prompt cache's partition; hits only among requests with the same salt.
    cache_salt: str | None = Field(default=None, min_length=1, max_length=256)
    # mlx_lm.server's: the LoRA adapter to run with (a served adapter's name or directory).
    adapters: str | None = Field(default=None, min_length=1, max_length=4096)
    speculative: SpeculativeOptions | None = None

    def _stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    def _choice_seed(self, choice: int) -> int | None:
        """Choice i draws from ``seed + i``, wrapping past the largest seed so that any valid
        seed serves any ``n`` (an invalid one stays invalid for ``SamplingParams`` to refuse)."""
        if self.seed is None:
            return None
        seed = self.seed + choice
        return seed - (MAX_SEED + 1) if seed > MAX_SEED >= self.seed else seed

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
        grammar: Grammar | None = None,
    ) -> SamplingParams:
        """The request's values; ``defaults`` (then OpenAI's) for the sampling fields omitted.
        An error names what the client sent (``field_names``)."""
        try:
            return self._sampling_params(
                max_tokens, logprobs, top_logprobs, seed_offset, defaults, grammar
            )
        except InvalidRequestError as exc:
            raise exc.renamed(self.field_names()) from None

    def field_names(self) -> Mapping[str, str]:
        """This body's name for each part of the engine's request where it differs (the
        engine's errors name the engine's fields: ``InvalidRequestError.renamed``)."""
        return {}

    def _sampling_params(
        self,
        max_tokens: int,
        logprobs: bool,
        top_logprobs: int,
        seed_offset: int,
        defaults: SamplingDefaults,
        grammar: Grammar | None = None,
    ) -> SamplingParams:
        return defaults.params(
            grammar=grammar,
            max_tokens=max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
            presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            logit_bias=self._logit_bias(),
            seed=self._choice_seed(seed_offset),
            stop=self._stops(),
            logprobs=logprobs,
            top_logprobs=top_logprobs,
            speculative=self.speculative.speculation() if self.speculative else None,
        )

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class _Request(_Sampling):
    """A top-level body: its undeclared fields are kept (``model_extra``) to be checked."""

    model_config = ConfigDict(extra="allow")
    unsupported: ClassVar[frozenset[str]] = frozenset()
    no_effect: ClassVar[frozenset[str]] = NO_EFFECT_FIELDS

    def check_fields(self) -> None:
        """Raise ``InvalidRequestError`` naming the first OpenAI field sent that this server
        does not implement; log, once per name, fields OpenAI does not define."""
        for name, value in (self.model_extra or {}).items():
            if name in self.unsupported:
                if value is not None and not _is_default(name, value):
                    raise InvalidRequestError(
                        f"{name} is not supported by this server yet",
                        param=name,
                        code="unsupported",
                    )
            elif name not in self.no_effect:
                log_ignored(name, "OpenAI")


def effort_kwargs(effort: ReasoningEffort | None) -> dict[str, Any]:
    """A reasoning effort asked for, as the chat template variable that templates which take
    one read (gpt-oss's ``reasoning_effort``); a template without it ignores it."""
    return {} if effort is None else {"reasoning_effort": effort}


def _is_default(name: str, value: Any) -> bool:
    """Values of an unsupported field that ask for nothing it would do."""
    match name, value:
        case ("best_of", 1) | ("suffix", ""):
            return True
    return False


class ChatCompletionRequest(_Request):
    unsupported = UNSUPPORTED_CHAT_FIELDS
    messages: list[Message]
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    response_format: ResponseFormat | None = None
    modalities: list[str] | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool = True
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: ReasoningEffort | None = None

    def check_fields(self) -> None:
        super().check_fields()
        if self.modalities is not None and set(self.modalities) - {"text"}:
            raise InvalidRequestError(
                "modalities: this server generates text only", param="modalities"
            )
        check_choice(self.offered_tools, self.choice)
        forced = self.choice.forces_call
        if forced and self.response_format is not None and self.response_format.type != "text":
            raise InvalidRequestError(
                "a forced tool call (tool_choice required or a function) and a response_format "
                "other than text cannot hold one reply together",
                param="tool_choice",
            )

    # The tools, the choice and the grammar are read by every choice's params and by the
    # reply splitters: made once a request.
    @functools.cached_property
    def offered_tools(self) -> tuple[Tool, ...]:
        return tuple(spec.tool() for spec in self.tools or ())

    @functools.cached_property
    def choice(self) -> ToolChoice:
        """``tool_choice`` as sent, else OpenAI's default: ``auto`` with tools, else ``none``."""
        match self.tool_choice:
            case NamedToolChoice(function=function):
                return ToolChoice("function", function.name)
            case None:
                return ToolChoice("auto" if self.tools else "none")
            case mode:
                return ToolChoice(mode)

    def image_refs(self) -> list[ImageRef]:
        return [ref for i, m in enumerate(self.messages) for ref in m.image_refs(f"messages.[{i}]")]

    def chat(self, images: Mapping[str, ImageInput] | None = None) -> Chat:
        """The chat for the engine, its image parts' bytes from ``images`` (by part path)."""
        if not self.messages:
            raise InvalidRequestError("messages must not be empty", param="messages")
        tools = self.offered_tools if self.choice.mode != "none" else ()
        return Chat(
            tuple(m.chat_message(f"messages.[{i}]", images) for i, m in enumerate(self.messages)),
            tools,
            effort_kwargs(self.reasoning_effort) | (self.chat_template_kwargs or {}),
        )

    @functools.cached_property
    def grammar(self) -> Grammar | None:
        """What the reply is held to: a forced tool call's grammar, or ``response_format``'s."""
        choice = self.choice
        if choice.forces_call:
            return call_grammar(self.offered_tools, choice, parallel=self.parallel_tool_calls)
        return None if self.response_format is None else self.response_format.grammar()

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
            grammar=self.grammar,
        )

    def field_names(self) -> Mapping[str, str]:
        names = {
            "prompt": "messages",
            # the constraint is the response_format's, or the forced tool call's
            "grammar": "tools" if self.choice.forces_call else "response_format",
        }
        if self.max_completion_tokens is not None:
            names["max_tokens"] = "max_completion_tokens"
        return names


class CompletionRequest(_Request):
    """``prompt``: a string, a list of strings, or (OpenAI's other forms, parsed to be counted
    and refused) one list of token ids or a list of them."""

    unsupported = UNSUPPORTED_COMPLETION_FIELDS

    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    logprobs: StrictInt | None = None
    echo: StrictBool = False

    @property
    def num_prompts(self) -> int:
        """How many prompts ``prompt`` holds: each gets ``n`` choices."""
        if isinstance(self.prompt, str) or _is_token_ids(self.prompt):
            return 1
        return len(self.prompt)

    def prompts(self) -> list[str]:
        if isinstance(self.prompt, str):
            prompts = [self.prompt]
        elif _is_token_ids(self.prompt) or not all(isinstance(p, str) for p in self.prompt):
            raise InvalidRequestError(
                "prompt as token ids is not supported; send text", param="prompt"
            )
        else:
            prompts = [p for p in self.prompt if isinstance(p, str)]
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
        """As the chat's; ``default_max_tokens`` is the chat's fallback and goes unused here:
        a completion that sets no ``max_tokens`` anywhere gets OpenAI's 16."""
        limits = (self.max_tokens, defaults.max_tokens)
        return self.sampling_params(
            max_tokens=next((v for v in limits if v is not None), COMPLETIONS_MAX_TOKENS),
            logprobs=self.logprobs is not None,
            top_logprobs=self.logprobs or 0,
            seed_offset=seed_offset,
            defaults=defaults,
        )

    def field_names(self) -> Mapping[str, str]:
        return {"top_logprobs": "logprobs"}


def _is_token_ids(prompt: list[str] | list[int] | list[list[int]]) -> bool:
    return bool(prompt) and isinstance(prompt[0], int)


_BODIES: tuple[type[BaseModel], ...] = (
    ChatCompletionRequest,
    CompletionRequest,
    Message,
    TextPart,
    ImageURLPart,
    ImageURL,
    StreamOptions,
    MessageToolCall,
    CalledFunction,
    ToolSpec,
    FunctionSpec,
    NamedToolChoice,
    FunctionName,
)


_FIELD_NAMES = fields_of(*_BODIES)


def error_param(loc: tuple[int | str, ...], fields: frozenset[str] | None = None) -> str | None:
    """A pydantic error location as OpenAI names a parameter: ``("messages", 0, "content",
    "str")`` is ``messages.[0].content``. Pydantic's names for the members of a union
    (``str``, ``list[str]``) and dict keys are left out: only ``fields`` are kept (another
    API's bodies pass theirs; None: the OpenAI chat and completion bodies')."""
    kept = _FIELD_NAMES if fields is None else fields
    return format_param([part for part in loc if isinstance(part, int) or part in kept])
