"""What the HTTP app serves from: its settings (``HttpSettings``, the edge's limits and
sampling flags, fixed at start) and its state (``AppState``: the runtime once the model has
loaded, the requests running by id, the metrics registry).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ..actors.config import RuntimeStatistics
from ..engine.errors import InvalidRequestError
from ..engine.vocabulary.images import ImageInput
from ..engine.vocabulary.sampling_defaults import NO_DEFAULTS, SamplingDefaults, Source, built_in
from .http_errors import refusal_error
from .images import ImageLoader, ImageRef, ImageSettings
from .inprocess import RuntimeHandle, SessionHandle
from .metrics import Metrics

API_KEY_STATE = "api_key_index"  # a request's state: which of the API keys its bearer token is


TEXT_BODY_BYTES = 2 * 1024 * 1024  # a request body's default limit, before images


@dataclass(frozen=True, slots=True)
class HttpSettings:
    """The HTTP edge's limits. ``max_n``: the choices one request may ask for, counted as
    prompts x ``n`` (each choice takes an admission slot); more is refused with 400.
    ``api_keys``: the bearer tokens accepted (none: no key needed); each key's requests reuse
    only their own prompt-cache entries. ``served_model_names``: the names a request may give
    the model (vLLM's ``--served-model-name``); none: the model's own id."""

    api_keys: tuple[str, ...] = ()
    served_model_names: tuple[str, ...] = ()
    allowed_origins: tuple[str, ...] = ()  # CORS: the browser origins allowed ("*": any)
    max_body_bytes: int | None = None  # None: ``body_limit``'s default
    max_n: int = 8
    default_max_tokens: int = 512
    sampling: SamplingDefaults = NO_DEFAULTS  # serve's flags: over the model's defaults
    request_timeout_s: float | None = None
    body_timeout_s: float = 30.0
    images: ImageSettings = field(default_factory=ImageSettings)  # image parts' limits, URLs

    def body_limit(self, *, takes_images: bool) -> int:
        """The largest request body: ``max_body_bytes`` where given, else 2 MiB, and for a
        model that takes images room for one more image of ``images.max_bytes`` as base64
        (an agent's screenshot is often past 2 MiB alone)."""
        if self.max_body_bytes is not None:
            return self.max_body_bytes
        return TEXT_BODY_BYTES + (-(-self.images.max_bytes // 3) * 4 if takes_images else 0)


@dataclass
class AppState:
    """What the app serves from; ``runtime`` is None while the model loads."""

    settings: HttpSettings
    runtime: RuntimeHandle | None = None
    model_id: str | None = None  # the name the model is listed by, once loaded
    live: dict[str, list[SessionHandle]] = field(default_factory=dict)
    metrics: Metrics = field(init=False)
    adapter_requests: Counter[str] = field(default_factory=Counter)  # generations per adapter

    def __post_init__(self) -> None:
        self.metrics = Metrics(self.statistics)

    def body_limit(self) -> int:
        """The largest request body now (``HttpSettings.body_limit``; while the model loads,
        a text model's)."""
        rt = self.runtime
        return self.settings.body_limit(takes_images=rt is not None and rt.takes_images)

    def model_names(self, rt: RuntimeHandle) -> tuple[str, ...]:
        """The names requests may give the model, the first the one it is listed by."""
        return self.settings.served_model_names or (rt.model_id,)

    async def load_images(self, refs: Callable[[], Sequence[ImageRef]]) -> dict[str, ImageInput]:
        """The bytes of the image parts ``refs()`` names, by part path (``api/images.py``);
        raises ``HttpError`` 400 naming the part that cannot be had. If cancelled, nothing
        is kept."""
        try:
            found = refs()
            return await ImageLoader(self.settings.images).load(found) if found else {}
        except InvalidRequestError as exc:
            raise refusal_error(exc) from None

    def statistics(self) -> RuntimeStatistics | None:
        return self.runtime.statistics() if self.runtime else None

    def sampling_layers(self, rt: RuntimeHandle) -> list[tuple[Source, SamplingDefaults]]:
        """What a request's omitted sampling fields get, highest precedence first."""
        return [
            ("flag", self.settings.sampling),
            ("model", rt.sampling_defaults),
            ("built-in", built_in(max_tokens=self.settings.default_max_tokens)),
        ]
