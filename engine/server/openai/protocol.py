"""Request bodies of the OpenAI-compatible routes.

Known fields are validated strictly (a wrong type or value is refused, naming the field); unknown
fields are ignored and logged once (`tolerant`), as vLLM does, so a client that adds a field in
its next release keeps working.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictInt,
    StrictStr,
)

from dgpp.engine.sampling.sampling_params import PRIORITY_RANGE
from dgpp.engine.server.openai.tolerant import TolerantModel
from dgpp.engine.server.openai.tool_schema import schema_problem

# Every stop string is matched against the text after each step, and every bias entry touches
# the logits of each step: both are bounded.
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024
MAX_LOGIT_BIAS = 1024


def bounded_stops(stops: Any) -> Any:
    """At most MAX_STOP_STRINGS stop strings of at most MAX_STOP_CHARS characters each."""
    items = [stops] if isinstance(stops, str) else stops or []
    if len(items) > MAX_STOP_STRINGS:
        raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(items)}")
    for item in items:
        if len(item) > MAX_STOP_CHARS:
            raise ValueError(f"a stop string has at most {MAX_STOP_CHARS} characters")
    return stops


StopStrings = Annotated[list[StrictStr], AfterValidator(bounded_stops)]


def function_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Tools whose `function`, where given, is an object (every reader of a tool looks inside)
    and whose `parameters`, where given, are a JSON schema."""
    for index, tool in enumerate(tools or []):
        function = tool.get("function")
        if "function" in tool and not isinstance(function, dict):
            raise ValueError(f"tools.{index}.function must be an object")
        parameters = (function or {}).get("parameters")
        if parameters is not None and (problem := schema_problem(parameters)):
            raise ValueError(f"tools.{index}.function.parameters is not a JSON schema: {problem}")
    return tools


class StreamOptions(TolerantModel):
    include_usage: StrictBool = False
    continuous_usage_stats: StrictBool = False


class SamplingFields(TolerantModel):
    """Fields shared by chat and text completions (OpenAI's plus vLLM-style extensions)."""

    model: StrictStr
    max_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: StrictInt = Field(default=1, ge=1, le=16)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: Annotated[StrictStr | list[StrictStr] | None, AfterValidator(bounded_stops)] = None
    seed: StrictInt | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: Annotated[dict[str, float], Field(max_length=MAX_LOGIT_BIAS)] | None = None
    user: StrictStr | None = None
    # extensions (vLLM names)
    top_k: StrictInt | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=10.0)
    ignore_eos: StrictBool = False
    stop_token_ids: Annotated[list[StrictInt], Field(max_length=MAX_STOP_STRINGS)] | None = None
    skip_special_tokens: StrictBool = True
    include_stop_str_in_output: StrictBool = False
    prefix_cache: StrictBool = True
    # Scheduling order, lower first (vLLM's field; `server.core.priority`)
    priority: StrictInt | None = Field(default=None, ge=PRIORITY_RANGE[0], le=PRIORITY_RANGE[1])
    # OpenAI's cache routing key (Codex sends its conversation's): the agent session
    prompt_cache_key: StrictStr | None = None


class ContentPart(BaseModel):
    """A part of a message's content: text, or an image (`image_url`: a URL or {url, detail};
    vision-language models only)."""

    model_config = ConfigDict(extra="allow")
    type: StrictStr
    text: StrictStr | None = None
    image_url: StrictStr | dict[str, Any] | None = None


class ImageOptions(TolerantModel):
    """A request's image settings (vision-language models): `mm_processor_kwargs` bounds the
    pixels of each resized image within the server's (`min_pixels`, `max_pixels`);
    `image_coordinates` overrides `http.image_coordinates` for the answer."""

    mm_processor_kwargs: dict[str, Any] | None = None
    image_coordinates: Literal["original", "model"] | None = None


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="allow")
    name: StrictStr
    arguments: StrictStr | dict[str, Any] = "{}"


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="allow")
    id: StrictStr | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # e.g. `name`, `refusal`, `annotations`
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: StrictStr | list[ContentPart] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: StrictStr | None = None
    reasoning_content: StrictStr | None = None
    reasoning: StrictStr | None = None


class ChatCompletionRequest(SamplingFields, ImageOptions):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(default=None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(default=None, ge=0, le=20)
    tools: Annotated[list[dict[str, Any]] | None, AfterValidator(function_tools)] = None
    tool_choice: StrictStr | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    response_format: dict[str, Any] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: StrictBool = True
    metadata: dict[str, Any] | None = None
    store: StrictBool | None = None
    service_tier: StrictStr | None = None


class CompletionRequest(SamplingFields):
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    logprobs: StrictInt | None = Field(default=None, ge=0, le=20)
    echo: StrictBool = False
    max_tokens: StrictInt | None = Field(default=None, ge=0)  # 0: score the prompt only
    prompt_logprobs: StrictInt | None = Field(default=None, ge=0, le=20)  # vLLM's
    best_of: StrictInt | None = Field(default=None, ge=1)
    suffix: StrictStr | None = None


class TokenizeRequest(TolerantModel):
    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True


class DetokenizeRequest(TolerantModel):
    model: StrictStr | None = None
    tokens: list[StrictInt]
