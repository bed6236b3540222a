"""What an encoder checkpoint (BERT, XLM-RoBERTa) says beside config.json: how
sentence-transformers pools it (`modules.json`, `1_Pooling/config.json`) and its separator
token's id (the tokenizer's files), which types a (query, document) pair's second segment."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from dgpp.engine.errors import ConfigError

log = logging.getLogger(__name__)

ENCODER_ARCHITECTURES = frozenset(
    {
        "BertModel",
        "XLMRobertaModel",
        "BertForSequenceClassification",
        "XLMRobertaForSequenceClassification",
    }
)
# sentence-transformers' pooling flags, by the mode dgpp serves
_MODES = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_lasttoken": "last",
}
_SEPARATORS = ("[SEP]", "</s>")


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except (OSError, ValueError) as err:
        log.warning("ignoring %s: %s", path, err)
        return None


def pooling_mode(checkpoint: Path) -> str:
    """ "cls", "mean" or "last" as the checkpoint's sentence-transformers pooling names it; ""
    where it names none (the model's default: CLS). Another mode is refused by name."""
    modules = _json(checkpoint / "modules.json")
    folder = "1_Pooling"
    if isinstance(modules, list):
        for module in modules:
            if isinstance(module, dict) and str(module.get("type", "")).endswith(".Pooling"):
                folder = str(module.get("path") or folder)
    found = _json(checkpoint / folder / "config.json")
    if not isinstance(found, dict):
        return ""
    chosen = [mode for flag, mode in _MODES.items() if found.get(flag)]
    others = [
        k for k, v in found.items() if k.startswith("pooling_mode_") and v and k not in _MODES
    ]
    if others or len(chosen) > 1:
        raise ConfigError(
            f"{checkpoint / folder / 'config.json'} pools by {', '.join(others + chosen)}; "
            "dgpp pools by one of: the CLS token, the mean of the tokens, the last token"
        )
    return chosen[0] if chosen else ""


def sep_token_id(checkpoint: Path) -> int | None:
    """The separator's id from tokenizer.json's added tokens, or None."""
    tokenizer = _json(checkpoint / "tokenizer.json")
    added = tokenizer.get("added_tokens") if isinstance(tokenizer, dict) else None
    for token in added or ():
        if isinstance(token, dict) and token.get("content") in _SEPARATORS:
            return int(token["id"])
    return None
