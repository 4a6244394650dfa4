"""The tools of a Responses API request: ``function`` tools, ``namespace`` tools grouping
functions (Codex's sub-agent tools: offered as functions, and a call of one names its
namespace), hosted tools this server has nothing to run with (left out), and the rest
(refused with a 400 naming the tool).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import Discriminator, StrictBool, Tag

from ..engine.errors import InvalidRequestError
from .chat_parts import Body

logger = logging.getLogger(__name__)
_logged_hosted: set[str] = set()  # hosted tool types left out and logged (once each)


def type_of(value: Any) -> Any:
    """A discriminator's view of an item, a part or a tool: its ``type``."""
    return value.get("type") if isinstance(value, dict) else getattr(value, "type", None)


class FunctionTool(Body):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class OtherTool(Body):
    """A tool of a type not served (``custom``, ``local_shell``, ``file_search``, ...), or a
    hosted one (``HOSTED_TOOLS``) that this server has nothing to run with."""

    type: str
    name: str | None = None


# Tools OpenAI runs on its side; here there is no web to search. Codex offers web_search by
# default: it is left out of the prompt (logged once), not refused, so that a turn can run.
HOSTED_TOOLS = frozenset({"web_search", "web_search_preview"})

FunctionOrOther = Annotated[
    Annotated[FunctionTool, Tag("function_tool")] | Annotated[OtherTool, Tag("other")],
    Discriminator(lambda v: "function_tool" if type_of(v) == "function" else "other"),
]


class NamespaceTool(Body):
    """Function tools grouped under a name (Codex's sub-agent tools): offered as functions;
    a call of one names its ``namespace``."""

    type: Literal["namespace"]
    name: str
    description: str | None = None
    tools: list[FunctionOrOther]


ToolSpec = Annotated[
    Annotated[FunctionTool, Tag("function_tool")]
    | Annotated[NamespaceTool, Tag("namespace_tool")]
    | Annotated[OtherTool, Tag("other")],
    Discriminator(
        lambda v: {"function": "function_tool", "namespace": "namespace_tool"}.get(
            type_of(v) or "", "other"
        )
    ),
]


class FunctionChoice(Body):
    type: Literal["function"]
    name: str


def check_tools(tools: Sequence[FunctionTool | NamespaceTool | OtherTool]) -> None:
    """Raise ``InvalidRequestError`` naming the first tool of a type not served; log, once a
    type, the hosted tools left out."""
    for i, tool in enumerate(tools):
        if isinstance(tool, OtherTool):
            if tool.type not in HOSTED_TOOLS:
                raise unsupported_tool(f"tools.[{i}]", tool.type)
            if tool.type not in _logged_hosted:
                _logged_hosted.add(tool.type)
                logger.info("leaving out the hosted tool %r: this server runs none", tool.type)
        elif isinstance(tool, NamespaceTool):
            for j, inner in enumerate(tool.tools):
                if isinstance(inner, OtherTool):
                    raise unsupported_tool(f"tools.[{i}].tools.[{j}]", inner.type)


def unsupported_tool(where: str, kind: str) -> InvalidRequestError:
    return InvalidRequestError(
        f"{where}: tools of type {kind!r} are not supported by this server; it serves tools of "
        "type 'function' (and namespaces of them)",
        param=f"{where}.type",
        code="unsupported",
    )
