"""What the HTTP fuzz tests share: a scripted engine that refuses what a real one would, and the
check that a 4xx is an error body in the API's shape that names its field."""

from __future__ import annotations

import os
import re
from collections.abc import AsyncIterator
from typing import Any

from dgpp.engine.errors import ContextLengthExceededError
from dgpp.engine.sampling.sampling_params import SamplingParams
from dgpp.engine.scheduling.request import RequestOutput
from dgpp.engine.scheduling.stats import EngineCounters, EngineStats
from dgpp.engine.tokenization.tokenizer import check_token_ids
from tests.engine.server.scripted import ScriptedEngine


def fuzz_examples(default: int) -> int:
    """The example budget: `DGPP_FUZZ_EXAMPLES` when set (a bigger run), else `default`."""
    return int(os.environ.get("DGPP_FUZZ_EXAMPLES", default))


# A reply with reasoning and a tool call, so the parsers run on every generation route.
TEXT = (
    '<think>\nchecking\n</think>\nSure.<tool_call>\n{"name": "ls", "arguments": '
    '{"path": "/tmp"}}\n</tool_call>'
)
# Codes of a 4xx about the body as a whole (not JSON, not an object), which has no field to name.
WHOLE_BODY_CODES = frozenset({"invalid_json", "request_too_large"})
FIELD_IN_MESSAGE = re.compile(r"^[\w.\[\]]+: |\b(param(eter)?|field)\b|`\w+`|'\w+'")


class FuzzEngine(ScriptedEngine):
    """The scripted engine with the admission checks `LLMEngine.add_request` makes (context
    length, token ids), so input a real engine refuses is refused here too, and with stats."""

    def stats(self) -> EngineStats:
        blocks = self.engine.max_model_len // 16
        return EngineStats(0, 0, 0, blocks, 0, 16, False, 0, EngineCounters())

    async def generate(
        self,
        prompt: list[int],
        params: SamplingParams,
        request_id: str,
        use_prefix_cache: bool = True,
        admission: Any = None,
    ) -> AsyncIterator[RequestOutput]:
        check_token_ids(prompt, self.engine.model_config.vocab_size)
        max_len = self.engine.max_model_len
        if len(prompt) >= max_len or len(prompt) + (params.max_tokens or 1) > max_len:
            raise ContextLengthExceededError("the request does not fit the context", param="prompt")
        async for output in super().generate(prompt, params, request_id, use_prefix_cache):
            yield output


def assert_error_shape(path: str, status: int, body: Any) -> None:
    """A 4xx body in the API's shape; a validation error names its field."""
    assert isinstance(body, dict), body
    if path.startswith("/v1/messages"):
        assert body.get("type") == "error" and set(body["error"]) == {"type", "message"}, body
        assert body["error"]["message"], body
        return
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"], error
    if status == 400 and error["code"] not in WHOLE_BODY_CODES and error["param"] is None:
        assert FIELD_IN_MESSAGE.search(error["message"]), f"names no field: {error}"
