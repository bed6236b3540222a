"""The model families' tool-call and reasoning formats end to end over HTTP: OpenAI chat (whole
and streamed), the Responses API and Anthropic messages, with the format chosen from the chat
template. The engine replays recorded output as tokens of a tokenizer whose markers are special
tokens, decoded as the engine decodes (so markers reach the parser only if the route keeps
special tokens), and no marker may reach the client."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any

import anthropic
import openai
from fastapi.testclient import TestClient

from dgpp.engine.sampling.sampling_params import SamplingParams
from dgpp.engine.scheduling.request import CompletionOutput, RequestOutput
from dgpp.engine.server.app import create_app
from dgpp.engine.server.core.config import ServerConfig
from dgpp.engine.server.pipeline.state import ServerState
from dgpp.engine.server.tool_formats.output_format import ToolFormat
from dgpp.engine.tokenization.detokenizer import IncrementalDetokenizer
from tests.engine.server.scripted import ScriptedEngine

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        },
    },
}
RESPONSES_TOOL = {"type": "function", **WEATHER_TOOL["function"]}
ANTHROPIC_TOOL = {"name": "get_weather", "input_schema": WEATHER_TOOL["function"]["parameters"]}
ASK = [{"role": "user", "content": "Weather in Paris for 3 days?"}]
PARIS = {"city": "Paris", "days": 3}
CONVERSATION = (
    "{%- for m in messages %}{{ '<|user|>' + m.content }}{%- endfor %}"
    "{%- if tools %}{{ 'tools: ' + tools | map(attribute='function.name') | join(',') }}"
    "{%- endif %}"
)

GLM_TEMPLATE = (
    CONVERSATION + "{{ 'Call as <tool_call>NAME\\n<arg_key>K</arg_key>\\n<arg_value>V</arg_value>"
    "</tool_call>; think in <think></think>.' }}{{ '<|assistant|>' }}"
)
GLM_MARKERS = [
    "<tool_call>",
    "</tool_call>",
    "<arg_key>",
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
]
GLM_OUTPUT = (
    "<think>Paris, three days: call get_weather.</think>\nChecking.\n<tool_call>get_weather\n"
    "<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
    "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>"
)
DS_CALLS = ["<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>"]
DS_MARKERS = [*DS_CALLS, "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"]
DEEPSEEK_TEMPLATE = (
    CONVERSATION + "{{ 'Calls: <｜tool▁calls▁begin｜>' + '<｜Assistant｜><think>' }}"
)
DEEPSEEK_OUTPUT = (
    "The user wants Paris.</think>Let me check."
    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
    '{"city": "Paris", "days": 3}'
    "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
)
HARMONY_MARKERS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|constrain|>"]
HARMONY_TEMPLATE = CONVERSATION + "{{ '<|start|>assistant' }}{# <|channel|> #}"
HARMONY_CALL = (
    "<|channel|>analysis<|message|>Need the weather tool.<|end|>"
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city":"Paris","days":3}'
)
HARMONY_ANSWER = (
    "<|channel|>analysis<|message|>Greet back.<|end|>"
    "<|start|>assistant<|channel|>final<|message|>Hello<file_sep> there!"
)
QWEN_TEMPLATE = (
    CONVERSATION
    + "{{ 'Call as <tool_call>\\n<function=NAME>\\n<parameter=K>\\nV\\n</parameter>' }}"
)
QWEN_OUTPUT = (
    "I'll check.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
)
LEAKS = ("<tool_call>", "<arg_", "<｜", "<|channel|>", "<|message|>", "<|end|>", "<file_sep>")


class TokenEngine(ScriptedEngine):
    """Replays `text` one token at a time through the engine's own detokenizer."""

    async def generate(
        self,
        prompt: list[int],
        params: SamplingParams,
        request_id: str,
        use_prefix_cache: bool = True,
        admission: Any = None,
    ) -> AsyncIterator[RequestOutput]:
        self.params.append(params)
        tokenizer = self.engine.tokenizer
        ids = list(tokenizer(self.text, add_special_tokens=False).input_ids)
        detokenizer = IncrementalDetokenizer(
            tokenizer, prompt, (), False, params.skip_special_tokens
        )
        for number, token in enumerate(ids, start=1):
            detokenizer.add_token(token)
            done = number == len(ids)
            delta = detokenizer.flush() if done else detokenizer.take_delta()
            completion = CompletionOutput(
                0, detokenizer.text, tuple(ids[:number]), "stop" if done else None
            )
            yield RequestOutput(request_id, None, tuple(prompt), (completion,), done, delta, 1)


@contextmanager
def serving(
    base: Any, template: str, markers: list[str], text: str, **config: Any
) -> Iterator[TestClient]:
    tokenizer = base.__class__.from_pretrained(base.name_or_path)
    tokenizer.chat_template = template
    if markers:
        tokenizer.add_special_tokens({"additional_special_tokens": markers})
    state = ServerState(TokenEngine(tokenizer, text), ServerConfig(**config), ("m",))  # type: ignore[arg-type]
    with TestClient(create_app(state)) as client:
        yield client


def sdks(client: TestClient) -> tuple[openai.OpenAI, anthropic.Anthropic]:
    return (
        openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=client),
        anthropic.Anthropic(base_url="http://testserver", api_key="x", http_client=client),
    )


def streamed_chat(sdk: openai.OpenAI, **kwargs: Any) -> tuple[str, str, list[tuple[str, Any]]]:
    content, reasoning, calls = "", "", []
    for chunk in sdk.chat.completions.create(model="m", messages=ASK, stream=True, **kwargs):
        delta = chunk.choices[0].delta
        content += delta.content or ""
        reasoning += getattr(delta, "reasoning_content", None) or ""
        for call in delta.tool_calls or []:
            calls.append((call.function.name, json.loads(call.function.arguments)))
    return content, reasoning, calls


def no_leaks(*texts: str | None) -> bool:
    return not any(marker in (text or "") for text in texts for marker in LEAKS)


def test_glm_chat_and_anthropic(tokenizer: Any) -> None:
    with serving(tokenizer, GLM_TEMPLATE, GLM_MARKERS, GLM_OUTPUT) as client:
        assert client.app.state.dgpp.output_format.tool_format is ToolFormat.GLM45  # type: ignore[attr-defined]
        sdk, claude = sdks(client)
        reply = sdk.chat.completions.create(model="m", messages=ASK, tools=[WEATHER_TOOL])
        message = reply.choices[0].message
        assert reply.choices[0].finish_reason == "tool_calls"
        assert message.content == "Checking.\n" and no_leaks(message.content)
        assert message.reasoning_content == "Paris, three days: call get_weather."  # type: ignore[attr-defined]
        (call,) = message.tool_calls
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == PARIS
        streamed = streamed_chat(sdk, tools=[WEATHER_TOOL])
        assert streamed == ("Checking.\n", message.reasoning_content, [("get_weather", PARIS)])  # type: ignore[attr-defined]
        answer = claude.messages.create(
            model="m", max_tokens=64, messages=ASK, tools=[ANTHROPIC_TOOL]
        )
        assert [block.type for block in answer.content] == ["thinking", "text", "tool_use"]
        assert answer.content[2].input == PARIS and answer.stop_reason == "tool_use"


def test_glm_without_tools_keeps_the_markup_as_content(tokenizer: Any) -> None:
    # GLM's markers show as the model wrote them, as with skip_special_tokens, except the
    # special ones, which the client never sees.
    with serving(tokenizer, GLM_TEMPLATE, GLM_MARKERS, GLM_OUTPUT) as client:
        message = sdks(client)[0].chat.completions.create(model="m", messages=ASK)
        content = message.choices[0].message.content
        assert content == "Checking.\nget_weather\ncity\nParis\ndays\n3\n" and no_leaks(content)


def test_deepseek_stream_responses_and_tools_off(tokenizer: Any) -> None:
    with serving(tokenizer, DEEPSEEK_TEMPLATE, DS_MARKERS, DEEPSEEK_OUTPUT) as client:
        sdk, claude = sdks(client)
        streamed = streamed_chat(sdk, tools=[WEATHER_TOOL])
        assert streamed == ("Let me check.", "The user wants Paris.", [("get_weather", PARIS)])
        response = sdk.responses.create(model="m", input="Weather?", tools=[RESPONSES_TOOL])
        kinds = [item.type for item in response.output]
        assert kinds == ["reasoning", "message", "function_call"]
        assert json.loads(response.output[2].arguments) == PARIS
        plain = sdk.chat.completions.create(model="m", messages=ASK).choices[0].message
        assert plain.content == 'Let me check.get_weather{"city": "Paris", "days": 3}'
        with claude.messages.stream(
            model="m", max_tokens=64, messages=ASK, tools=[ANTHROPIC_TOOL]
        ) as stream:
            final = stream.get_final_message()
        assert [block.type for block in final.content] == ["thinking", "text", "tool_use"]
        assert final.content[2].input == PARIS


def test_harmony_across_the_apis(tokenizer: Any) -> None:
    with serving(tokenizer, HARMONY_TEMPLATE, HARMONY_MARKERS, HARMONY_CALL) as client:
        sdk, claude = sdks(client)
        reply = sdk.chat.completions.create(model="m", messages=ASK, tools=[WEATHER_TOOL])
        message = reply.choices[0].message
        assert message.content is None and reply.choices[0].finish_reason == "tool_calls"
        assert message.reasoning_content == "Need the weather tool."  # type: ignore[attr-defined]
        assert json.loads(message.tool_calls[0].function.arguments) == PARIS
        assert streamed_chat(sdk, tools=[WEATHER_TOOL]) == (
            "",
            "Need the weather tool.",
            [("get_weather", PARIS)],
        )
        with sdk.responses.stream(model="m", input="Weather?", tools=[RESPONSES_TOOL]) as stream:
            response = stream.get_final_response()
        assert [item.type for item in response.output] == ["reasoning", "function_call"]
        assert response.output[1].name == "get_weather"
        with claude.messages.stream(
            model="m", max_tokens=64, messages=ASK, tools=[ANTHROPIC_TOOL]
        ) as stream:
            final = stream.get_final_message()
        assert [block.type for block in final.content] == ["thinking", "tool_use"]
        assert final.content[0].thinking == "Need the weather tool."
        assert final.content[1].input == PARIS and final.stop_reason == "tool_use"


def test_harmony_answer_strips_other_special_tokens(tokenizer: Any) -> None:
    with serving(tokenizer, HARMONY_TEMPLATE, HARMONY_MARKERS, HARMONY_ANSWER) as client:
        sdk, claude = sdks(client)
        message = sdk.chat.completions.create(model="m", messages=ASK).choices[0].message
        assert message.content == "Hello there!"
        assert message.reasoning_content == "Greet back."  # type: ignore[attr-defined]
        assert streamed_chat(sdk) == ("Hello there!", "Greet back.", [])
        answer = claude.messages.create(model="m", max_tokens=64, messages=ASK)
        assert [(block.type, getattr(block, "text", None)) for block in answer.content] == [
            ("thinking", None),
            ("text", "Hello there!"),
        ]
        raw = client.post(
            "/v1/chat/completions",
            json={"model": "m", "messages": ASK, "skip_special_tokens": False},
        ).json()["choices"][0]["message"]
        assert raw["content"] == "Hello<file_sep> there!"  # asked for: only the markers go


def test_qwen3_coder_chat_and_responses(tokenizer: Any) -> None:
    with serving(tokenizer, QWEN_TEMPLATE, [], QWEN_OUTPUT) as client:
        sdk, _ = sdks(client)
        message = (
            sdk.chat.completions.create(model="m", messages=ASK, tools=[WEATHER_TOOL])
            .choices[0]
            .message
        )
        assert message.content == "I'll check.\n"
        assert json.loads(message.tool_calls[0].function.arguments) == PARIS
        assert streamed_chat(sdk, tools=[WEATHER_TOOL]) == (
            "I'll check.\n",
            "",
            [("get_weather", PARIS)],
        )
        response = sdk.responses.create(model="m", input="Weather?", tools=[RESPONSES_TOOL])
        assert json.loads(response.output[-1].arguments) == PARIS


def test_the_setting_overrides_the_template(tokenizer: Any) -> None:
    with serving(tokenizer, GLM_TEMPLATE, [], GLM_OUTPUT, tool_call_parser="hermes") as client:
        message = (
            sdks(client)[0]
            .chat.completions.create(model="m", messages=ASK, tools=[WEATHER_TOOL])
            .choices[0]
            .message
        )
        assert not message.tool_calls and "<tool_call>get_weather" in (message.content or "")


def test_forced_calls_under_harmony_and_deepseek(tokenizer: Any) -> None:
    """Neither template writes `<tool_call>`: a forced call starts the Hermes opening and, the
    rest being constrained to the tool's schema (test_parsed_outputs.py), the model writes the
    arguments; they come back as the call, with no marker in sight."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    rest = json.dumps(PARIS) + "}"  # after `<tool_call>\n{"name": "get_weather", "arguments": `
    for template, markers in ((HARMONY_TEMPLATE, HARMONY_MARKERS), (DEEPSEEK_TEMPLATE, DS_MARKERS)):
        with serving(tokenizer, template, markers, rest) as client:
            sdk, claude = sdks(client)
            reply = sdk.chat.completions.create(
                model="m", messages=ASK, tools=[WEATHER_TOOL], tool_choice=named
            )
            (call,) = reply.choices[0].message.tool_calls or []
            assert call.function.name == "get_weather" and reply.choices[0].message.content is None
            assert json.loads(call.function.arguments) == PARIS
            assert reply.choices[0].finish_reason == "tool_calls"
            assert streamed_chat(sdk, tools=[WEATHER_TOOL], tool_choice=named)[2] == [
                ("get_weather", PARIS)
            ]
            answer = claude.messages.create(
                model="m",
                max_tokens=64,
                messages=ASK,
                tools=[ANTHROPIC_TOOL],
                tool_choice={"type": "tool", "name": "get_weather"},
            )
            assert [block.type for block in answer.content] == ["tool_use"]
            assert answer.content[0].input == PARIS and answer.stop_reason == "tool_use"
            engine = client.app.state.dgpp.engine  # type: ignore[attr-defined]
            assert len(engine.params) == 3  # whole, streamed, Anthropic: each constrained
            assert all(params.grammar is not None for params in engine.params)
