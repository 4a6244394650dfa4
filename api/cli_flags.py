"""The command line's flags that ``generate`` and ``serve`` share: the model and where it runs
(``--model``, ``--device``, ``--memory-limit``), and sampling (``--temperature``, ...), with
what they make: ``EngineOptions`` and ``SamplingDefaults``."""

from __future__ import annotations

import argparse

from ..engine.errors import AdapterError
from ..engine.options import KV_BITS, KV_GROUP_SIZES, AdapterSpec, EngineOptions
from ..engine.params import (
    MAX_DRAFT_TOKENS,
    MAX_NGRAM_SIZE,
    MAX_STOP_STRINGS,
    SamplingParams,
    Speculation,
)
from ..engine.speculative.plan import DEFAULT_NGRAM_SIZE, DEFAULT_NUM_DRAFT_TOKENS
from ..engine.vocabulary.sampling_defaults import SamplingDefaults
from .cli_args import (
    MAX_TOKENS,
    SEED,
    TOKENS,
    given,
    integer,
    logit_bias,
    memory_limit,
    model,
    nonempty,
    number,
    sampling,
)
from .cli_ranks import rank_group

# The name ``generate --adapter-path`` serves its one adapter as.
GENERATE_ADAPTER = "adapter"

ENGINE = EngineOptions()  # the defaults the flags' help shows


MODEL_HELP = (
    "model directory, GGUF file or Hugging Face id org/name[@revision] "
    "(default: SmolLM2-135M-Instruct)"
)


def add_default_flags(
    group: argparse._ArgumentGroup, *max_tokens_aliases: str, max_tokens: str
) -> None:
    """The flags over the model's ``generation_config.json``; one not given takes the model's
    value, else OpenAI's (for ``--max-tokens``: ``max_tokens``)."""
    fallback = "default: the model's generation_config.json, else"
    group.add_argument(
        "--max-tokens",
        *max_tokens_aliases,
        type=TOKENS,
        default=None,
        help=f"new tokens at most; {fallback} {max_tokens}",
    )
    group.add_argument(
        "--temperature",
        type=sampling("temperature", number),
        default=None,
        help=f"0 to 2, 0: greedy; {fallback} 1",
    )
    group.add_argument(
        "--top-p",
        type=sampling("top_p", number),
        default=None,
        help=f"above 0 to 1; {fallback} 1",
    )
    group.add_argument(
        "--top-k",
        type=integer(0, MAX_TOKENS),
        default=None,
        help=f"0 (off) or below the vocabulary size; {fallback} 0",
    )
    group.add_argument(
        "--min-p",
        type=sampling("min_p", number),
        default=None,
        help=f"0 (off) to 1; {fallback} 0",
    )
    group.add_argument(
        "--repetition-penalty",
        type=sampling("repetition_penalty", number),
        default=None,
        help=f"above 0 to 2, 1: off; {fallback} 1",
    )


def flag_defaults(args: argparse.Namespace) -> SamplingDefaults:
    """The sampling defaults given as flags (checked: ``InvalidRequestError``)."""
    return SamplingDefaults(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        max_tokens=args.max_tokens,
    )


def add_sampling_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    add_default_flags(group, max_tokens="256")
    group.add_argument(
        "--presence-penalty", type=sampling("presence_penalty", number), default=0.0, help="-2 to 2"
    )
    group.add_argument(
        "--frequency-penalty",
        type=sampling("frequency_penalty", number),
        default=0.0,
        help="-2 to 2",
    )
    group.add_argument(
        "--logit-bias",
        type=logit_bias,
        default={},
        help="JSON object of token id to bias, -100 to 100, e.g. '{\"42\": -100}' (default: none)",
    )
    group.add_argument(
        "--seed", type=SEED, default=None, help="reproducible sampling (default: random)"
    )
    group.add_argument(
        "--stop",
        type=nonempty("a stop string"),
        action="append",
        default=[],
        help=f"stop string, up to {MAX_STOP_STRINGS} (repeatable; default: none)",
    )
    group.add_argument(
        "--stop-token-id",
        type=integer(0, MAX_TOKENS),
        action="append",
        default=[],
        help="stop at this token (repeatable; default: the model's end tokens only)",
    )


def sampling_params(args: argparse.Namespace, defaults: SamplingDefaults) -> SamplingParams:
    """The flags' params, ``defaults`` for the sampling flags not given."""
    return defaults.params(
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        logit_bias=args.logit_bias,
        seed=args.seed,
        stop=tuple(args.stop),
        stop_token_ids=tuple(args.stop_token_id),
    )


def add_device(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device",
        choices=["auto", "cpu", "gpu"],
        default=None,
        help=f"auto: a GPU if any (default: {ENGINE.device})",
    )


def add_memory_limit(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--memory-limit",
        type=memory_limit,
        default=None,
        help="memory budget: bytes (6GB, 512MiB) or a share of the device's memory (0.3, 30%%); "
        "weights, activations and KV cache stay within it, requests wait for KV room "
        "(default: 0.9 of a GPU's memory, 0.5 of the CPU's)",
    )


def lora_spec(text: str) -> AdapterSpec:
    """``NAME=PATH`` of ``--lora``, the directory checked here (its fit, at load)."""
    try:
        spec = AdapterSpec.parse(text)
    except AdapterError as exc:
        raise argparse.ArgumentTypeError(exc.message) from None
    if not spec.path.is_dir():
        raise argparse.ArgumentTypeError(f"{spec.path} is not a directory (an mlx-lm adapter)")
    return spec


def adapter_directory(text: str) -> AdapterSpec:
    """``--adapter-path PATH`` of ``generate`` (mlx_lm.generate's flag): one adapter, used."""
    return lora_spec(f"{GENERATE_ADAPTER}={text}")


def add_adapter_path(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--adapter-path",
        type=adapter_directory,
        default=None,
        metavar="DIR",
        help="generate with this LoRA adapter (mlx_lm.lora's output: adapter_config.json and "
        "adapters.safetensors; default: none)",
    )


def add_kv_bits(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--kv-bits",
        type=int,
        choices=KV_BITS,
        default=None,
        help="keep keys and values quantized to this many bits (4: about 0.28x of bfloat16's bytes "
        "a token, 0.16x of float32's; 8: 0.53x, 0.28x), so more rows fit the memory budget; rows "
        "still batch (default: the model's dtype)",
    )
    parser.add_argument(
        "--kv-group-size",
        type=int,
        choices=KV_GROUP_SIZES,
        default=None,
        help=f"values sharing a scale and bias under --kv-bits (default: {ENGINE.kv_group_size})",
    )


def add_speculative(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("speculative decoding (design/032)")
    group.add_argument(
        "--speculative",
        choices=["prompt_lookup", "draft_model", "none"],
        default=None,
        help="how a request that does not say (its `speculative` field) drafts tokens for the "
        "model to verify in one forward: prompt_lookup, the tokens after the latest earlier "
        "match of its last tokens in its prompt and output (pays where output repeats input: "
        "edits, rewrites); the serial lane and a lone batch row speculate, a batch of several "
        "steps plain; draft_model, --draft-model's greedy tokens (default: draft_model with "
        "--draft-model, else none)",
    )
    group.add_argument(
        "--draft-model",
        type=model,
        default=None,
        metavar="DIR|ID",
        help="a small model sharing the model's tokenizer (checked at start), loaded beside it "
        "to draft tokens; its KV is kept beside each row's and counted in the memory budget "
        "(default: none)",
    )
    group.add_argument(
        "--num-draft-tokens",
        type=integer(1, MAX_DRAFT_TOKENS),
        default=None,
        help=f"tokens drafted a step at most (default: {DEFAULT_NUM_DRAFT_TOKENS})",
    )
    group.add_argument(
        "--ngram-size",
        type=integer(2, MAX_NGRAM_SIZE),
        default=None,
        help=f"prompt lookup matches the last this many tokens, down to 2 "
        f"(default: {DEFAULT_NGRAM_SIZE})",
    )


def speculation(args: argparse.Namespace) -> Speculation | None:
    """The server's default speculation (None: none given)."""
    method = getattr(args, "speculative", None)
    if method is None and getattr(args, "draft_model", None) is not None:
        method = "draft_model"
    draft = getattr(args, "num_draft_tokens", None)
    ngram = getattr(args, "ngram_size", None)
    if method is None and draft is None and ngram is None:
        return None
    return Speculation(method or "none", draft, ngram)


def engine_options(args: argparse.Namespace) -> EngineOptions:
    """The engine's options the flags give (``EngineOptions``' defaults for the rest)."""
    engine = getattr(args, "engine", None)
    adapters = tuple(getattr(args, "lora", None) or ())
    if (one := getattr(args, "adapter_path", None)) is not None:
        adapters = (one,)
    return given(
        EngineOptions,
        model=args.model,
        device=args.device,
        memory_limit=args.memory_limit,
        prompt_cache_bytes=getattr(args, "prompt_cache_bytes", None),
        max_preparation_tokens=getattr(args, "max_preparation_tokens", None),
        max_iteration_tokens=getattr(args, "max_iteration_tokens", None),
        prefill_alone_from=getattr(args, "prefill_alone_from", None),
        engine_process=None if engine in (None, "auto") else engine == "process",
        ranks=rank_group(args),
        adapters=adapters or None,
        kv_bits=getattr(args, "kv_bits", None),
        kv_group_size=getattr(args, "kv_group_size", None),
        speculation=speculation(args),
        draft_model=getattr(args, "draft_model", None),
    )
