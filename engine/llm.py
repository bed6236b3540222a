"""The offline API, in the shape vLLM users know: `LLM(model=...).generate(prompts, params)`."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

from dgpp.engine.configuration.engine_config import EngineConfig
from dgpp.engine.engine import LLMEngine
from dgpp.engine.errors import ConfigError, InvalidRequestError, ModelLoadError
from dgpp.engine.planning.resolved import resolve
from dgpp.engine.quant.gguf_view import view_for
from dgpp.engine.sampling.sampling_params import SamplingParams
from dgpp.engine.scheduling.request import PromptIds, RequestOutput
from dgpp.engine.scheduling.step_pooling import embedding

Prompt = str | list[int]
Message = dict[str, Any]

_KNOBS = {f.name for f in fields(EngineConfig)} - {"model"}


class LLM:
    """Loads a checkpoint and generates for batches of prompts or conversations.

    `model` is a checkpoint directory; `checkpoint` is the directory when the caller resolved
    `model` from another kind of reference (`dgpp.appliance.offline.LLM` does, for `default`
    and cached Hugging Face repo ids). `resident_dir` keeps resident weight images (see
    `ModelRunner`). Other keyword arguments are `EngineConfig` knobs.
    """

    def __init__(
        self,
        model: str | Path,
        *,
        checkpoint: Path | None = None,
        resident_dir: Path | None = None,
        **knobs: Any,
    ) -> None:
        unknown = sorted(set(knobs) - _KNOBS)
        if unknown:
            raise ConfigError(
                f"unknown engine option(s): {', '.join(unknown)}; "
                f"known: {', '.join(sorted(_KNOBS))}"
            )
        if checkpoint is None:
            checkpoint = checkpoint_directory(str(model))
        config = EngineConfig(model=str(model), **knobs)
        self.engine = LLMEngine(resolve(config, checkpoint), resident_dir=resident_dir)

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` and `chat` use when given no params: the checkpoint's recommended
        settings (generation_config.json) where it names them, else `SamplingParams()`'s."""
        named = {
            key: value
            for key, value in vars(self.engine.sampling_defaults).items()
            if value is not None
        }
        return SamplingParams(**named)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order."""
        batch = _as_batch(prompts)
        params = _params_for(batch, sampling_params, self.get_default_sampling_params)
        # Validate every prompt before queueing any, so a bad one leaves no work behind.
        request_ids = [f"offline-{uuid.uuid4().hex}" for _ in batch]
        try:
            for prompt, param, request_id in zip(batch, params, request_ids, strict=True):
                self.engine.add_request(prompt, param, request_id)
        except Exception:
            for request_id in request_ids:
                self.engine.abort(request_id)
            self.engine.step()
            raise
        finished: dict[str, RequestOutput] = {}
        while len(finished) < len(batch):
            for output in self.engine.step():
                if output.finished:
                    finished[output.request_id] = output
        return [finished[request_id] for request_id in request_ids]

    def embed(self, prompts: Prompt | Sequence[Prompt]) -> list[list[float]]:
        """Each prompt's unit-length embedding, in prompt order (`kind="embed"`)."""
        self._check_kind("embed")
        return [embedding(out.pooled or ()) for out in self.generate(prompts, _POOL)]

    def score(self, prompts: Prompt | Sequence[Prompt]) -> list[float]:
        """Each prompt's relevance, P("yes"), in prompt order (`kind="rerank"`: the prompt is the
        reranker's template filled with a query and a document)."""
        self._check_kind("rerank")
        return [(out.pooled or (0.0,))[0] for out in self.generate(prompts, _POOL)]

    def _check_kind(self, kind: str) -> None:
        if self.engine.config.kind != kind:
            raise InvalidRequestError(
                f"this model is served as {self.engine.config.kind!r}, not {kind!r} (kind=)"
            )

    def chat(
        self,
        messages: Sequence[Message] | Sequence[Sequence[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Render each conversation with the checkpoint's chat template, then generate."""
        conversations = _as_conversations(messages)
        prompts: list[Prompt] = [
            self.render_chat(conversation, chat_template_kwargs, add_generation_prompt)
            for conversation in conversations
        ]
        return self.generate(prompts, sampling_params)

    def render_chat(
        self,
        messages: Sequence[Message],
        chat_template_kwargs: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """Token ids of a conversation rendered through the checkpoint's own chat template."""
        try:
            text = self.tokenizer.apply_chat_template(
                list(messages),
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                **(chat_template_kwargs or {}),
            )
        except Exception as err:
            raise InvalidRequestError(f"the chat template rejected the messages: {err}") from None
        # The template already wrote any BOS it wants; do not add special tokens twice.
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)


_POOL = SamplingParams(max_tokens=1)


def checkpoint_directory(model: str) -> Path:
    """`model` as a checkpoint directory; `ModelLoadError` when it is not one."""
    path = Path(model).expanduser()
    if (path / "config.json").is_file():
        return path
    view = view_for(path)  # a GGUF file, served as it is through a view directory
    if view is not None:
        return view
    raise ModelLoadError(
        f"{model!r} is not a checkpoint directory (one with a config.json) or a GGUF file; "
        "names such as "
        "`default` or a Hugging Face repo id are resolved by dgpp.appliance.offline.LLM",
        param="model",
    )


def _as_batch(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, PromptIds):
        return [prompts]
    if isinstance(prompts, list | tuple) and prompts and all(isinstance(p, int) for p in prompts):
        return [list(prompts)]  # one prompt of token ids
    if isinstance(prompts, list | tuple):
        if not prompts:
            raise InvalidRequestError("no prompts given", param="prompt")
        # a PromptIds (ids with cache hints or images) goes as it is
        return [p if isinstance(p, str | PromptIds) else list(p) for p in prompts]
    raise InvalidRequestError(
        f"prompts must be a string, token ids, or a list of those; got {type(prompts).__name__}",
        param="prompt",
    )


def _params_for(
    batch: list[Prompt],
    sampling_params: SamplingParams | Sequence[SamplingParams] | None,
    default: Callable[[], SamplingParams],
) -> list[SamplingParams]:
    if sampling_params is None:
        return [default()] * len(batch)
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * len(batch)
    params = list(sampling_params)
    if len(params) != len(batch):
        raise InvalidRequestError(
            f"{len(params)} sampling params for {len(batch)} prompts", param="sampling_params"
        )
    return params


def _as_conversations(
    messages: Sequence[Message] | Sequence[Sequence[Message]],
) -> list[list[Message]]:
    if not messages:
        raise InvalidRequestError("no messages given", param="messages")
    if isinstance(messages[0], dict):
        return [list(messages)]  # type: ignore[arg-type]
    return [list(conversation) for conversation in messages]  # type: ignore[arg-type]
