"""A chat conversation to prompt token ids, images included: what the chat, Anthropic and
Responses routes (and /tokenize) share."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dgpp.engine.scheduling.request import PromptIds
from dgpp.engine.server.chat.render import normalise, render
from dgpp.engine.server.openai.protocol import ChatMessage
from dgpp.engine.server.pipeline.state import ServerState


def render_chat(
    state: ServerState,
    messages: list[ChatMessage],
    tools: list[dict[str, Any]] | None,
    template_kwargs: dict[str, Any],
    add_generation_prompt: bool = True,
    image_options: Mapping[str, Any] | None = None,
    hint_system: bool = True,
) -> PromptIds:
    """The prompt of `messages` through the checkpoint's chat template; image parts (a
    vision-language model) decoded, resized within the quality bounds (`image_options`: a
    request's `mm_processor_kwargs`) and widened to their vision tokens."""
    urls: list[str] | None = [] if state.images is not None else None
    normalised = normalise(messages, state.template_traits, urls)
    prepared = []
    if urls and state.images is not None:
        prepared = state.images.prepare(urls, state.config, image_options)
    hint = state.hint_system and hint_system
    prompt = render(
        state.tokenizer, normalised, tools, template_kwargs, add_generation_prompt, hint
    )
    if prepared and state.images is not None:
        return state.images.expand(prompt, prepared)
    return prompt
