"""Multi-turn environments and their tools (JAX-free, the contract package): what an episode's
environment takes from the policy and gives back. The types every side shares are here; the
chat formats that turn a policy's text into `ToolCall`s live in rlax_tpu/data/tool_format.py.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

# A chat message as chat templates take it: {"role": ..., "content": ..., and for an
# assistant turn with calls "tool_calls": [...], for a tool's result "name" / "tool_call_id"}.
Message = Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One call the policy made: the tool's name and its arguments (a JSON object), and the
    call's id where the format gives one ("" otherwise)."""

    name: str
    arguments: Mapping[str, Any]
    id: str = ""

    def message(self) -> dict[str, Any]:
        """The call as an assistant message's `tool_calls` entry (OpenAI's shape, which chat
        templates read)."""
        call: dict[str, Any] = {
            "type": "function",
            "function": {"name": self.name, "arguments": dict(self.arguments)},
        }
        if self.id:
            call["id"] = self.id
        return call
