"""Sampling defaults: what a request gets for the sampling fields it leaves out.

For each field, the first of these that sets it wins: the request; the server's flags
(``serve`` or ``generate``); the model's ``generation_config.json``; OpenAI's values, which are
:class:`SamplingParams`'s own defaults. The model's file is read as vLLM's
``--generation-config auto`` reads it: ``temperature``, ``top_p``, ``top_k``, ``min_p``,
``repetition_penalty`` and ``max_new_tokens`` (as ``max_tokens``). An explicit
``do_sample: false`` means greedy, as in Hugging Face's ``generate``: temperature 0. A value out
of range is logged and left out. Pure Python (no MLX).

A GGUF file has no ``generation_config.json``, but newer converters (llama.cpp's) copy the
source model's values into ``general.sampling.*`` keys (``GGUF_KEYS``): the importer writes
those into the imported model's ``generation_config.json`` (:func:`generation_config_from_gguf`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, Literal

from ..errors import InvalidRequestError
from ..params import SamplingParams

logger = logging.getLogger(__name__)

GENERATION_CONFIG = "generation_config.json"
Source = Literal["flag", "model", "built-in"]

# generation_config.json's key for each field
HF_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_tokens": "max_new_tokens",
}

# The GGUF metadata key llama.cpp's converter writes each field to (gguf-py's constants,
# ``Keys.General.SAMPLING_*``); it has none for max_tokens.
GGUF_KEYS = {
    "temperature": "general.sampling.temp",
    "top_p": "general.sampling.top_p",
    "top_k": "general.sampling.top_k",
    "min_p": "general.sampling.min_p",
    "repetition_penalty": "general.sampling.penalty_repeat",
}


@dataclass(frozen=True, slots=True)
class SamplingDefaults:
    """Values for the sampling fields a request omits; None: not set at this level.

    Each value set is checked as :class:`SamplingParams` checks it (``InvalidRequestError``).
    """

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None

    def __post_init__(self) -> None:
        SamplingParams(**self.values())

    @classmethod
    def from_generation_config(cls, config: Mapping[str, Any]) -> SamplingDefaults:
        """The defaults a Hugging Face ``generation_config.json`` states; bad values skipped."""
        values: dict[str, Any] = {}
        for name, key in HF_KEYS.items():
            value = config.get(key)
            if value is None:
                continue
            try:
                cls(**{name: value})
            except InvalidRequestError as exc:
                logger.warning("%s: ignoring %s=%r (%s)", GENERATION_CONFIG, key, value, exc)
                continue
            values[name] = value
        if config.get("do_sample") is False:
            values["temperature"] = 0.0
        return cls(**values)

    @classmethod
    def read(cls, model_dir: Path) -> SamplingDefaults:
        """The defaults in ``model_dir``'s ``generation_config.json``; none without one."""
        path = model_dir / GENERATION_CONFIG
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return cls()
        except (OSError, ValueError) as exc:
            logger.warning("ignoring %s: %s", path, exc)
            return cls()
        if not isinstance(config, dict):
            logger.warning("ignoring %s: not a JSON object", path)
            return cls()
        return cls.from_generation_config(config)

    def values(self) -> dict[str, float | int]:
        """The fields set here."""
        return {name: value for name, value in asdict(self).items() if value is not None}

    def over(self, base: SamplingDefaults) -> SamplingDefaults:
        """These values where set, ``base``'s for the rest."""
        return replace(base, **self.values())

    def params(self, **values: Any) -> SamplingParams:
        """``SamplingParams`` of ``values`` (a None counts as omitted), these defaults for the
        fields omitted, and ``SamplingParams``'s own defaults for the rest."""
        given = {name: value for name, value in values.items() if value is not None}
        return SamplingParams(**{**self.values(), **given})


NO_DEFAULTS = SamplingDefaults()


def generation_config_from_gguf(metadata: Mapping[str, Any]) -> dict[str, float | int]:
    """The ``generation_config.json`` keys a GGUF's ``general.sampling.*`` metadata states
    (``GGUF_KEYS``); a value out of range, or not a number, is logged and left out. GGUF keeps
    them as float32: each float comes back with the 7 digits float32 holds (0.1, not
    0.10000000149)."""
    config: dict[str, float | int] = {}
    for name, key in GGUF_KEYS.items():
        value = metadata.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, int | float):
            logger.warning("GGUF: ignoring %s=%r (not a number)", key, value)
            continue
        if name == "top_k":
            value = int(value)
        elif isinstance(value, float):
            value = float(f"{value:.7g}")
        try:
            SamplingDefaults(**{name: value})
        except InvalidRequestError as exc:
            logger.warning("GGUF: ignoring %s=%r (%s)", key, value, exc)
            continue
        config[HF_KEYS[name]] = value
    return config


def built_in(*, max_tokens: int | None = None) -> SamplingDefaults:
    """OpenAI's values (``SamplingParams``'s defaults); ``max_tokens`` where an edge has its own."""
    plain = SamplingParams()
    values = {f.name: getattr(plain, f.name) for f in fields(SamplingDefaults)}
    return SamplingDefaults(**{**values, **({"max_tokens": max_tokens} if max_tokens else {})})


def applied(
    layers: Sequence[tuple[Source, SamplingDefaults]],
) -> dict[str, tuple[float | int, Source]]:
    """Each field some layer sets: its value and the first layer (highest precedence first)
    that sets it."""
    result: dict[str, tuple[float | int, Source]] = {}
    for source, defaults in layers:
        for name, value in defaults.values().items():
            result.setdefault(name, (value, source))
    return {f.name: result[f.name] for f in fields(SamplingDefaults) if f.name in result}


def describe(layers: Sequence[tuple[Source, SamplingDefaults]]) -> str:
    """One line for a log: ``temperature=0.2 (model) top_p=1 (built-in) ...``."""
    return " ".join(
        f"{name}={value:g} ({source})" for name, (value, source) in applied(layers).items()
    )
