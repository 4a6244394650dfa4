"""mlx-trio's public surface: everything a user of the in-process API imports comes from here.

    from mlx_trio.api import ChatMessage, GenerationRequest, SamplingParams, open_runtime

Internals (the actors, the engine's modules) may move; these names stay. The HTTP server and
the CLI are ``mlx-trio serve`` and ``mlx-trio generate``; the fault-injection harness is
``mlx_trio.api.chaos``.
"""

from mlx_trio.actors.messages import (
    Cancelled,
    CancelReason,
    Completed,
    Event,
    Failed,
    GenerationRequest,
    Outcome,
    Progress,
    TextDelta,
    Timings,
    Usage,
)
from mlx_trio.actors.runtime import RuntimeConfig, RuntimeStatistics
from mlx_trio.api.inprocess import (
    Collected,
    RuntimeHandle,
    SessionHandle,
    freeze_startup_heap,
    open_runtime,
)
from mlx_trio.engine.errors import (
    ContextLengthExceededError,
    EngineError,
    InvalidRequestError,
    MlxTrioError,
    ModelError,
    ModelImportError,
    ModelNotFoundError,
    OverloadedError,
    RuntimeClosedError,
    RuntimeRefusal,
    UnsupportedModelError,
)
from mlx_trio.engine.outputs import FinishReason, TokenLogprob
from mlx_trio.engine.params import SamplingParams
from mlx_trio.engine.prompt import ChatMessage
from mlx_trio.engine.sampling_defaults import SamplingDefaults

__all__ = [
    "CancelReason",
    "Cancelled",
    "ChatMessage",
    "Collected",
    "Completed",
    "ContextLengthExceededError",
    "EngineError",
    "Event",
    "Failed",
    "FinishReason",
    "GenerationRequest",
    "InvalidRequestError",
    "MlxTrioError",
    "ModelError",
    "ModelImportError",
    "ModelNotFoundError",
    "Outcome",
    "OverloadedError",
    "Progress",
    "RuntimeClosedError",
    "RuntimeConfig",
    "RuntimeHandle",
    "RuntimeRefusal",
    "RuntimeStatistics",
    "SamplingDefaults",
    "SamplingParams",
    "SessionHandle",
    "TextDelta",
    "Timings",
    "TokenLogprob",
    "UnsupportedModelError",
    "Usage",
    "freeze_startup_heap",
    "open_runtime",
]
