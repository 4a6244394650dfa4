"""Preparing a request for the model: its prompt tokenized through the chat template (its
images decoded and processed, for a vision model), its parameters checked against the model.
No weights are needed: an engine process's parent prepares with one while the model lives in
the child.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

from mlx_lm.tokenizer_utils import TokenizerWrapper

from .errors import ImageError, InvalidRequestError
from .params import PreparedRequest, SamplingParams
from .vocabulary.grammar_sandbox import GrammarSandbox, TokenizerSpec
from .vocabulary.images import PreparedImages, process_images
from .vocabulary.prompt import (
    Prompt,
    check_fits,
    check_length_before_rendering,
    encode_prompt,
    prompt_images,
    render_chat,
)
from .vocabulary.reply import ReplySyntax


class RequestPreparer:
    """What ``prepare`` needs of a model, its tokenizer and context length, without its weights:
    an engine process's parent tokenizes with one while the model lives in the child.
    ``processor``: a vision model's, which turns a prompt's images into its input (None: the
    model takes no images). ``has_draft_model``: a draft model is loaded beside the model
    (``--draft-model``), so requests may ask to speculate with it."""

    def __init__(
        self,
        tokenizer: TokenizerWrapper,
        context_length: int,
        processor: Any = None,
        *,
        has_draft_model: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.context_length = context_length
        self.processor = processor
        self.has_draft_model = has_draft_model
        self.vocab_size = len(tokenizer)

    def prepare(self, prompt: Prompt, params: SamplingParams) -> PreparedRequest:
        """Tokenize and check a request; raises :class:`InvalidRequestError` subclasses (an
        image that cannot be used: :class:`ImageError`). Images are decoded and resized here,
        on the caller's thread (a worker thread's, ``CorePort.prepare``)."""
        self.check_params(params)
        check_length_before_rendering(prompt, self.context_length)
        tokens, images = self._encode(prompt)
        if not tokens:
            raise InvalidRequestError("prompt encodes to no tokens", param="prompt")
        check_fits(len(tokens), params.max_tokens, self.context_length)
        return PreparedRequest(prompt_tokens=tuple(tokens), params=params, images=images)

    def _encode(self, prompt: Prompt) -> tuple[list[int], PreparedImages | None]:
        images = prompt_images(prompt)
        if not images:
            return encode_prompt(self.tokenizer, prompt), None
        if self.processor is None:
            raise ImageError(images[0].where, "this model takes no images on this server")
        assert not isinstance(prompt, str)  # a text prompt has no images
        return process_images(
            self.processor, render_chat(self.tokenizer, prompt, tokenize=False), images
        )

    def check_params(self, params: SamplingParams) -> None:
        """The bounds that depend on the model: token ids inside the vocabulary, ``top_k``
        below its size (0 turns top-k off)."""
        size = self.vocab_size
        if params.top_k >= size:
            raise InvalidRequestError(
                f"top_k must be below the vocabulary size ({size}), or 0 to turn it off; "
                f"got {params.top_k}",
                param="top_k",
            )
        for param, tokens in (
            ("logit_bias", params.logit_bias),
            ("stop_token_ids", params.stop_token_ids),
        ):
            for token in tokens:
                if token >= size:
                    raise InvalidRequestError(
                        f"{param} token id {token} is outside the vocabulary (size {size})",
                        param=param,
                    )
        if params.grammar is not None:
            self.grammar_sandbox.check(params.grammar)
        spec = params.speculative
        if spec is not None and spec.method == "draft_model" and not self.has_draft_model:
            raise InvalidRequestError(
                "speculative.method draft_model needs a server started with --draft-model",
                param="speculative.method",
            )

    @functools.cached_property
    def grammar_sandbox(self) -> GrammarSandbox:
        """Where a request's grammar is compiled first
        (``engine/vocabulary/grammar_sandbox.py``)."""
        return GrammarSandbox(TokenizerSpec.of(self.tokenizer))

    def tokenize(self, prompt: Prompt) -> list[int]:
        """The prompt's token ids with no check of its length (for counting), its images'
        tokens among them."""
        return self._encode(prompt)[0]

    def detokenize(self, token_ids: Sequence[int]) -> str:
        if any(not 0 <= t < self.vocab_size for t in token_ids):
            raise InvalidRequestError(
                f"token ids must be from 0 to {self.vocab_size - 1}", param="tokens"
            )
        return self.tokenizer.decode(list(token_ids))

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    @functools.cached_property
    def reply_syntax(self) -> ReplySyntax:
        return ReplySyntax.of(self.tokenizer)
