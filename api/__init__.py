"""mlx-trio's public surface: everything a user of the in-process API imports comes from here.

    from . import ChatMessage
    from . import GenerationRequest
    from . import SamplingParams
    from . import open_runtime

Internals (the actors, the engine's modules) may move; these names stay. The HTTP server and
the CLI are ``mlx-trio serve`` and ``mlx-trio generate``; the fault-injection harness is
``mlx_trio.api.chaos``.

Importing it loads OpenBLAS (``mlx_trio.engine._blas``), so that a program that imports MLX
after it gets fast CPU matmuls too; it imports no MLX itself.
"""

from ..engine import _blas  # noqa: F401  (OpenBLAS before any MLX the caller imports)

# isort: split

from ..actors.config import RuntimeConfig, RuntimeStatistics
from ..actors.messages import (
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
from ..engine.errors import (
    AdapterError,
    ContextLengthExceededError,
    EngineError,
    EngineUnavailableError,
    InvalidRequestError,
    MlxTrioError,
    ModelError,
    ModelImportError,
    ModelNotFoundError,
    OverloadedError,
    RuntimeClosedError,
    RuntimeRefusal,
    SecondReaderError,
    UnknownAdapterError,
    UnsupportedModelError,
)
from ..engine.options import AdapterSpec, EngineOptions
from ..engine.outputs import AdapterInfo, FinishReason, TokenLogprob
from ..engine.params import Grammar, SamplingParams
from ..engine.vocabulary.prompt import Chat, ChatMessage
from ..engine.vocabulary.reply import Called, Content, Reasoning, ReplySplitter, ReplySyntax
from ..engine.vocabulary.sampling_defaults import SamplingDefaults
from ..engine.vocabulary.tools import Tool, ToolCall, ToolChoice, call_grammar
from .inprocess import (
    Collected,
    RuntimeHandle,
    SessionHandle,
    freeze_startup_heap,
    open_runtime,
)

__all__ = [
    "AdapterError",
    "AdapterInfo",
    "AdapterSpec",
    "Called",
    "CancelReason",
    "Cancelled",
    "Chat",
    "ChatMessage",
    "Collected",
    "Completed",
    "Content",
    "ContextLengthExceededError",
    "EngineError",
    "EngineOptions",
    "EngineUnavailableError",
    "Event",
    "Failed",
    "FinishReason",
    "GenerationRequest",
    "Grammar",
    "InvalidRequestError",
    "MlxTrioError",
    "ModelError",
    "ModelImportError",
    "ModelNotFoundError",
    "Outcome",
    "OverloadedError",
    "Progress",
    "Reasoning",
    "ReplySplitter",
    "ReplySyntax",
    "RuntimeClosedError",
    "RuntimeConfig",
    "RuntimeHandle",
    "RuntimeRefusal",
    "RuntimeStatistics",
    "SamplingDefaults",
    "SamplingParams",
    "SecondReaderError",
    "SessionHandle",
    "TextDelta",
    "Timings",
    "TokenLogprob",
    "Tool",
    "ToolCall",
    "ToolChoice",
    "UnknownAdapterError",
    "UnsupportedModelError",
    "Usage",
    "call_grammar",
    "freeze_startup_heap",
    "open_runtime",
]
