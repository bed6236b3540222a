"""What every route needs: the engine front, the tokenizer, and the server settings."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any

from dgpp.engine.async_engine import AsyncEngine
from dgpp.engine.sampling.sampling_defaults import SamplingDefaults
from dgpp.engine.server.chat.image_inputs import ServerImages, server_images
from dgpp.engine.server.chat.render import TemplateTraits, probe_template
from dgpp.engine.server.core.config import ServerConfig, concrete_names, is_pattern
from dgpp.engine.server.core.errors import APIError
from dgpp.engine.server.responses.store import ResponseStore
from dgpp.engine.server.tool_formats.output_format import OutputFormat, choose_output_format


@dataclass
class ServerState:
    engine: AsyncEngine
    config: ServerConfig
    served_model_names: tuple[str, ...]
    side_names: tuple[str, ...] = ()  # the side models behind the front (`core.side_proxy`)
    started_at: float = field(default_factory=time.time)
    template_traits: TemplateTraits = field(init=False)
    output_format: OutputFormat = field(init=False)  # how the model writes calls and reasoning
    responses: ResponseStore = field(init=False)  # stored Responses API answers
    images: ServerImages | None = field(init=False)  # a vision-language model's image front

    def __post_init__(self) -> None:
        self.template_traits = probe_template(self.tokenizer)
        self.images = server_images(self.engine.engine)
        self.output_format = choose_output_format(self.config.tool_call_parser, self.tokenizer)
        self.responses = ResponseStore(
            self.config.responses_store_size, self.config.responses_store_ttl_s
        )

    @property
    def tokenizer(self) -> Any:
        return self.engine.engine.tokenizer

    @property
    def hint_system(self) -> bool:
        """Whether prompts carry the end of their system part as a prefix-cache hint (models
        with recurrent layers snapshot their state there)."""
        return self.engine.engine.has_recurrent_state

    @property
    def sampling_defaults(self) -> SamplingDefaults:
        """What a request that leaves a sampling setting out gets (`generation_config`)."""
        if self.config.generation_config != "auto":
            return SamplingDefaults()
        return self.engine.engine.sampling_defaults

    @property
    def max_model_len(self) -> int:
        return self.engine.engine.max_model_len

    @property
    def model_name(self) -> str:
        """The name responses and `/v1/models` report: the first that is not a pattern."""
        return concrete_names(self.served_model_names)[0]

    def check_model(self, name: str | None) -> str:
        """The reported name for a requested `model`; 404 `model_not_found` for anything else.
        A served name may be a pattern (`claude-*`, or `*` for any name)."""
        if name is None or any(
            name == served or (is_pattern(served) and fnmatchcase(name, served))
            for served in self.served_model_names
        ):
            return self.model_name
        raise APIError(
            404,
            f"the model {name!r} does not exist; this server serves "
            f"{', '.join(repr(n) for n in self.served_model_names)}"
            + (f"; side models {', '.join(map(repr, self.side_names))}" if self.side_names else ""),
            code="model_not_found",
            param="model",
        )

    @property
    def kind(self) -> str:
        """What the model serves (`engine.kind`): generate, embed or rerank."""
        return self.engine.engine.config.kind

    def check_kind(self, kind: str, endpoint: str) -> None:
        """400 naming the endpoints the model serves when `endpoint` needs a `kind` model."""
        if self.kind != kind:
            raise APIError(
                400,
                f"the model {self.model_name!r} is served as {self.kind!r} "
                f"({KIND_ENDPOINTS[self.kind]}); {endpoint} needs a {kind!r} model",
                code="wrong_model_kind",
                param="model",
            )


# What each kind of model serves (`ServerState.check_kind`'s errors say it)
KIND_ENDPOINTS = {
    "generate": "POST /v1/chat/completions, /v1/completions, /v1/responses, /v1/messages",
    "embed": "POST /v1/embeddings",
    "rerank": "POST /v1/rerank, /v2/rerank, /v1/score",
}
