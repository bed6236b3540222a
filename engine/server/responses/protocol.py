"""Request body of the OpenAI Responses API (`POST /v1/responses`).

Input items stay plain mappings here and are checked one by one in `responses.convert`, which
names the failing item (`input.3.call_id`); the rest is validated like every request model
(strict types, unknown fields ignored and logged once).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, StrictBool, StrictInt, StrictStr

from dgpp.engine.sampling.sampling_params import PRIORITY_RANGE
from dgpp.engine.server.openai.protocol import ImageOptions
from dgpp.engine.server.openai.tolerant import TolerantModel

Effort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]


class ReasoningConfig(TolerantModel):
    effort: Effort | None = None
    summary: StrictStr | None = None  # accepted; the reasoning text itself is returned


class ResponsesRequest(ImageOptions):
    model: StrictStr
    input: StrictStr | list[dict[str, Any]] = Field(default_factory=list)
    instructions: StrictStr | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    stream: StrictBool = False
    store: StrictBool = True
    previous_response_id: StrictStr | None = None
    metadata: dict[str, StrictStr] | None = None
    text: dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    user: StrictStr | None = None
    background: StrictBool = False
    # extensions (vLLM names)
    top_k: StrictInt | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=10.0)
    seed: StrictInt | None = None
    prefix_cache: StrictBool = True
    priority: StrictInt | None = Field(default=None, ge=PRIORITY_RANGE[0], le=PRIORITY_RANGE[1])
    prompt_cache_key: StrictStr | None = None  # the agent session (Codex sends it)
