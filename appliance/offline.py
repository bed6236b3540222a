"""The offline API with the appliance's model names and resident images:
`LLM("default").generate(prompts, params)`, as vLLM users write it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dgpp.appliance.common.paths import resident_dir
from dgpp.appliance.models.store import resolve_model
from dgpp.engine.llm import LLM as EngineLLM


class LLM(EngineLLM):
    """`dgpp.engine.llm.LLM` for any reference `dgpp model` understands: a checkpoint
    directory, `default`, or a Hugging Face repo id already in the local cache. Resident weight
    images go where the appliance keeps them (`dgpp cache list`) unless `resident_cache_dir`
    says otherwise."""

    def __init__(self, model: str | Path, **knobs: Any) -> None:
        checkpoint = resolve_model(str(model))
        super().__init__(model, checkpoint=checkpoint, resident_dir=resident_dir(), **knobs)
