"""``mlx-trio generate``: one request through the runtime, its text streamed to stdout.

The engine is opened as ``serve`` opens it (``open_runtime`` over ``EngineOptions``: the same
memory budget, token budget and admission checks, over several ranks too), with a batch of
one row: the request takes the serial lane.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable

from ..actors.messages import Completed, GenerationRequest, Outcome, TextDelta
from ..engine.errors import InvalidRequestError
from ..engine.options import EngineOptions
from ..engine.params import SamplingParams
from ..engine.vocabulary.prompt import ChatMessage
from ..engine.vocabulary.sampling_defaults import SamplingDefaults, Source, built_in, describe
from .cli_args import model_refused
from .cli_flags import GENERATE_ADAPTER

logger = logging.getLogger("mlx_trio.cli")


def generate(
    args: argparse.Namespace,
    options: EngineOptions,
    sampling_params: Callable[[SamplingDefaults], SamplingParams],
    flags: SamplingDefaults,
) -> int:
    """Run ``args.prompt`` on the engine ``options`` describe and write its text to stdout.
    ``sampling_params``: the request's parameters over the model's defaults (from the flags,
    ``flags`` being the sampling defaults they set, logged with the model's)."""
    import trio

    from .inprocess import open_runtime

    async def run() -> None:
        async with open_runtime(options, max_batch=1) as rt:
            layers: list[tuple[Source, SamplingDefaults]] = [
                ("flag", flags),
                ("model", rt.sampling_defaults),
                ("built-in", built_in()),
            ]
            logger.info("sampling defaults: %s", describe(layers))
            prompt: str | tuple[ChatMessage, ...] = args.prompt
            if not args.raw:
                system = () if args.system is None else (ChatMessage("system", args.system),)
                prompt = (*system, ChatMessage("user", args.prompt))
            adapter = GENERATE_ADAPTER if options.adapters else None
            params = sampling_params(rt.sampling_defaults)
            request = GenerationRequest(prompt, params, adapter=adapter)
            try:
                handle = await rt.submit(request)
            except InvalidRequestError as exc:  # --top-k past the vocabulary, ...
                raise model_refused(exc) from None
            async with handle:
                async for event in handle:
                    if isinstance(event, TextDelta):
                        sys.stdout.write(event.text)
                        sys.stdout.flush()
            sys.stdout.write("\n")
            _log_outcome(rt.model_id, await handle.result())

    trio.run(run)
    return 0


def _log_outcome(model_id: str, outcome: Outcome) -> None:
    if not isinstance(outcome, Completed):
        logger.warning("%s: the request ended %s", model_id, outcome)
        return
    usage, timings = outcome.usage, outcome.timings
    rate = usage.completion_tokens / timings.decode_s if timings.decode_s > 0 else 0.0
    logger.info(
        "%s: %d prompt tokens, %d generated (finish: %s), prefill %.2f s, decode %.1f tok/s%s",
        model_id,
        usage.prompt_tokens,
        usage.completion_tokens,
        outcome.finish_reason,
        timings.prefill_s or 0.0,
        rate,
        f"; drafted {usage.drafted_tokens}, accepted {usage.accepted_tokens}"
        if usage.drafted_tokens
        else "",
    )
