"""Loads a checkpoint's tokenizer and the token ids that end generation."""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from dgpp.engine.checkpoint.config import ModelConfig, read_generation_config
from dgpp.engine.errors import InvalidRequestError, ModelLoadError
from dgpp.engine.tokenization import chat_dsv4


def check_token_ids(token_ids: object, vocab_size: int, param: str = "prompt") -> list[int]:
    """`token_ids` as a list of ints in [0, vocab_size); `InvalidRequestError` naming `param`."""
    if not isinstance(token_ids, list | tuple):
        raise InvalidRequestError(
            f"expected a list of token ids, got {type(token_ids).__name__}", param=param
        )
    for token in token_ids:
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size:
            raise InvalidRequestError(
                f"token ids must be integers in [0, {vocab_size}), got {token!r}", param=param
            )
    return list(token_ids)


def load_tokenizer(path: Path, architecture: str = "") -> PreTrainedTokenizerBase:
    """The checkpoint's tokenizer; DeepSeek-V4's (released without a chat template) encoding
    chats as its release documents (`chat_dsv4`)."""
    try:
        direct = _direct_class(path)
        if direct is not None:
            tokenizer = direct.from_pretrained(str(path))
        else:
            tokenizer = AutoTokenizer.from_pretrained(str(path))
    except Exception as err:
        raise ModelLoadError(f"cannot load the tokenizer from {path}: {err}") from None
    if architecture == "DeepseekV4ForCausalLM":
        chat_dsv4.attach(tokenizer)
    return tokenizer


def _direct_class(path: Path) -> type[PreTrainedTokenizerBase] | None:
    """The fast tokenizer class that tokenizer_config.json names, when it can be used as it is.
    `AutoTokenizer` would resolve the same class, but it loads the model's config first, and
    that imports a large part of transformers' modelling code: ~1 s of every start."""
    import transformers

    try:
        name = json.loads((path / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError):
        return None
    if not isinstance(name, str) or not (name.endswith("Fast") or name == "TokenizersBackend"):
        return None
    found = getattr(transformers, name, None)
    if isinstance(found, type) and issubclass(found, PreTrainedTokenizerBase):
        return found
    return None


def eos_token_ids(
    path: Path, model_config: ModelConfig, tokenizer: PreTrainedTokenizerBase
) -> frozenset[int]:
    """EOS ids from generation_config.json, config.json and the tokenizer, as HF generate."""
    ids: set[int] = set(model_config.eos_token_ids)
    eos = read_generation_config(path).get("eos_token_id")
    ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(int(token) for token in ids)
