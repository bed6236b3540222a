"""Request bodies of the Anthropic Messages API (`/v1/messages`, `/v1/messages/count_tokens`)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, field_validator

from dgpp.engine.server.openai.protocol import ImageOptions, StopStrings
from dgpp.engine.server.openai.tolerant import TolerantModel
from dgpp.engine.server.openai.tool_schema import schema_problem


class Block(BaseModel):
    """A content block; which fields matter depends on `type` (see anthropic_convert)."""

    model_config = ConfigDict(extra="allow")
    type: StrictStr
    text: StrictStr | None = None
    # tool_use
    id: StrictStr | None = None
    name: StrictStr | None = None
    input: Any = None
    # tool_result
    tool_use_id: StrictStr | None = None
    content: StrictStr | list[Block] | None = None
    is_error: StrictBool | None = None
    # thinking
    thinking: StrictStr | None = None


class AnthropicMessage(TolerantModel):
    # `system` turns inside `messages` are what Claude Code sends for mid-conversation
    # instructions (beta); they keep their place in the conversation.
    role: Literal["user", "assistant", "system"]
    content: StrictStr | list[Block]


class AnthropicTool(BaseModel):
    model_config = ConfigDict(extra="allow")  # e.g. cache_control, type
    name: StrictStr
    description: StrictStr | None = None
    input_schema: dict[str, Any] = Field(default_factory=dict)

    @field_validator("input_schema")
    @classmethod
    def _a_json_schema(cls, schema: dict[str, Any]) -> dict[str, Any]:
        if schema and (problem := schema_problem(schema)):
            raise ValueError(f"input_schema is not a JSON schema: {problem}")
        return schema


class ThinkingConfig(BaseModel):
    model_config = ConfigDict(extra="allow")
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: StrictInt | None = Field(default=None, ge=0)


class OutputConfig(TolerantModel):
    """Claude's `output_config`: `effort` maps onto the chat template's reasoning knob."""

    effort: Literal["low", "medium", "high", "max"] | None = None


class CountTokensRequest(ImageOptions):
    model: StrictStr
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: StrictStr | list[Block] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None
    context_management: dict[str, Any] | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: StrictInt = Field(ge=1)
    stop_sequences: StopStrings | None = None
    temperature: float | None = Field(default=None, ge=0.0, le=1.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: StrictInt | None = Field(default=None, ge=0)
    stream: StrictBool = False
    metadata: dict[str, Any] | None = None
    service_tier: StrictStr | None = None
