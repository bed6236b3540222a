"""Chooses and drives the output parser of a request: the served model's format
(output_format.py), reasoning if the template knows `<think>`, tool calls if tools are on, and a
forced tool-call opening for `required`/named tool choices."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from dgpp.engine.sampling.sampling_params import SamplingParams
from dgpp.engine.server.chat.coordinates import CoordinateStream, ImageFrame
from dgpp.engine.server.parsers.tool_arguments import ToolSchemas
from dgpp.engine.server.pipeline.state import ServerState
from dgpp.engine.server.pipeline.tool_choice import HERMES_CLOSE, ForcedStart
from dgpp.engine.server.tool_formats.output_format import ToolFormat
from dgpp.engine.server.tool_formats.output_parser import OutputParser, ParsedDelta, merge

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


def decoding_params(state: ServerState, params: SamplingParams) -> SamplingParams:
    """`params` as the engine must decode for the served format: with special tokens kept
    where its markers are special tokens (the parser strips the rest, see `ResponseParser`)."""
    if not state.output_format.keeps_special_tokens or not params.skip_special_tokens:
        return params
    return replace(params, skip_special_tokens=False)


def coordinate_stream(
    state: ServerState, prompt: list[int], override: str | None
) -> CoordinateStream | None:
    """The rewriter of grounding coordinates into the prompt's last image (None: no image, or
    coordinates left as the model writes them)."""
    images = getattr(prompt, "images", ())
    mode = override or state.config.image_coordinates
    if not images or mode != "original" or state.images is None:
        return None
    last = images[-1]
    return CoordinateStream(
        ImageFrame(last.original_size, last.resized_size, state.images.convention)
    )


class ResponseParser:
    """An `OutputParser` that has already read the forced opening, if any.

    `tools`: the tools offered (Chat Completions shape), None when tool calls are off.
    `skip_special_tokens`: what the request asked for; where the engine decodes with special
    tokens kept for the format's sake (`decoding_params`), they are stripped from what the
    client sees unless the request asked to see them.
    """

    def __init__(
        self,
        state: ServerState,
        prompt: list[int],
        tools: list[dict[str, Any]] | None,
        forced: ForcedStart | None = None,
        skip_special_tokens: bool = True,
        image_coordinates: str | None = None,
    ) -> None:
        template = state.tokenizer.chat_template or ""
        reasoning = THINK_OPEN in template
        tail = state.tokenizer.decode(prompt[-4:]) if reasoning and forced is None else ""
        # The output starts inside a reasoning block the prompt opened (Qwen3 thinking on).
        self.starts_in_reasoning = tail.rstrip("\n").endswith(THINK_OPEN)
        served = state.output_format
        self.parser = OutputParser(
            reasoning=reasoning,
            tools=tools is not None or forced is not None,
            starts_in_reasoning=self.starts_in_reasoning,
            # A forced opening is Hermes JSON whatever the model's own format (tool_choice.py).
            tool_format=ToolFormat.HERMES if forced is not None else served.tool_format,
            schemas=ToolSchemas.of(tools),
            special_tokens=served.special_tokens if skip_special_tokens else None,
        )
        self.forced = forced
        self._pending = self.parser.feed(forced.text) if forced is not None else ParsedDelta()
        # Grounding answers about the request's last image, in that image's pixels.
        self.coordinates = coordinate_stream(state, prompt, image_coordinates)

    @property
    def num_tool_calls(self) -> int:
        return self.parser.num_tool_calls

    def tool_calls(self) -> list[dict]:
        return self.parser.tool_calls()

    def feed(self, text: str) -> ParsedDelta:
        delta = merge([self._pending, self.parser.feed(text)])
        self._pending = ParsedDelta()
        if self.coordinates is not None:
            delta = replace(delta, content=self.coordinates.feed(delta.content))
        return delta

    def finish(self, generated: str) -> ParsedDelta:
        """Flush at the end; closes a forced tool call the model left open."""
        pieces = [self._pending]
        if self.forced is not None and HERMES_CLOSE not in generated:
            pieces.append(self.parser.feed(self.forced.closing))
        pieces.append(self.parser.finish())
        self._pending = ParsedDelta()
        delta = merge(pieces)
        if self.coordinates is not None:
            content = self.coordinates.feed(delta.content) + self.coordinates.finish()
            delta = replace(delta, content=content)
        return delta

    def parse_whole(self, generated: str) -> ParsedDelta:
        return merge([self.feed(generated), self.finish(generated)])
