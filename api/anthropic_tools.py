"""Anthropic Messages API request parts about tools and thinking (pydantic): the tools offered
(client tools with an ``input_schema``; server tools refused by type), the choice among them,
and the thinking switch. ``anthropic_schemas`` assembles them into a request.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import StrictBool, StrictInt

from ..engine.errors import InvalidRequestError
from ..engine.vocabulary.tools import Tool
from .chat_parts import Body


class ToolDefinition(Body):
    """A client tool (``type`` absent or ``custom``); Anthropic's server tools (``bash_...``,
    ``web_search_...``) are refused by type."""

    name: str
    description: str = ""
    input_schema: dict[str, Any] | None = None
    type: str | None = None

    def tool(self, index: int) -> Tool:
        if self.type not in (None, "custom"):
            raise InvalidRequestError(
                f"tools.[{index}]: tools of type {self.type[:40]!r} (Anthropic's server tools) "
                "are not supported by this server; send client tools with an input_schema",
                param=f"tools.[{index}]",
                code="unsupported",
            )
        return Tool.of(self.name, self.description, self.input_schema)


class ToolChoiceSpec(Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: StrictBool = False


class ThinkingSpec(Body):
    """``enabled`` or ``disabled``: the template's thinking switch where it has one
    (``enable_thinking``); ``adaptive`` (the model decides): the template's default.
    ``budget_tokens`` is accepted, not enforced."""

    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: StrictInt | None = None

    def template_kwargs(self) -> dict[str, Any]:
        if self.type == "adaptive":
            return {}
        return {"enable_thinking": self.type == "enabled"}
