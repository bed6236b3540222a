"""`dgpp eval`'s figures from per-token results, and the reference file `kld` compares against.

A reference is a safetensors file: the reference run's top K log-probabilities and their token
ids per scored token, and the log-probability of the text's own token, with metadata naming
what must match for a comparison to mean anything: the tokenizer's vocabulary digest, the
text's digest (of its bytes) and its tokens', and the windows (context, stride).
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors import safe_open as _safe_open
from safetensors.torch import save_file

from dgpp.engine.errors import ConfigError
from dgpp.engine.evaluation.eval_scoring import Collector, Reference

FORMAT = "dgpp-eval-reference/1"
Z95 = 1.959964  # two-sided 95% normal quantile
PERCENTILES = (50, 90, 95, 99, 99.9)


def tokenizer_digest(tokenizer: Any) -> str:
    """sha256 of the vocabulary (token text and id, special tokens included)."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()


def tokens_digest(tokens: list[int]) -> str:
    return hashlib.sha256(torch.tensor(tokens, dtype=torch.int64).numpy().tobytes()).hexdigest()


@dataclass(frozen=True)
class Identity:
    """What a comparison must share with its reference."""

    tokenizer: str
    text: str
    tokens: str
    context: int
    stride: int


def save_reference(path: Path, collector: Collector, identity: Identity, model: str) -> None:
    metadata = {
        "format": FORMAT,
        "model": model,
        **{k: str(v) for k, v in asdict(identity).items()},
    }
    tensors = {
        "top_ids": collector.top_ids.to(torch.int32).contiguous(),
        "top_logprobs": collector.top_logprobs.contiguous(),
        "token_logprobs": (-collector.nll).contiguous(),
    }
    partial = path.with_name(path.name + ".partial")
    save_file(tensors, str(partial), metadata=metadata)
    partial.replace(path)


def load_reference(path: Path) -> tuple[Reference, Identity, str]:
    """The reference, what it was made of, and its model's name; `ConfigError` for anything
    that is not a dgpp eval reference."""
    if not path.is_file():
        raise ConfigError(f"no reference file at {path}", param="reference")
    try:
        with _safe_open(str(path), framework="pt") as handle:  # one read: metadata, tensors
            metadata = handle.metadata() or {}
            tensors = {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118
    except (SafetensorError, OSError, ValueError) as err:
        raise ConfigError(
            f"{path} is not a dgpp eval reference: {err}", param="reference"
        ) from None
    if metadata.get("format") != FORMAT or set(tensors) != {
        "top_ids",
        "top_logprobs",
        "token_logprobs",
    }:
        raise ConfigError(
            f"{path} is not a dgpp eval reference (format {metadata.get('format')!r})",
            param="reference",
        )
    identity = Identity(
        metadata["tokenizer"],
        metadata["text"],
        metadata["tokens"],
        int(metadata["context"]),
        int(metadata["stride"]),
    )
    reference = Reference(
        tensors["top_ids"].to(torch.int64), tensors["top_logprobs"], tensors["token_logprobs"]
    )
    return reference, identity, metadata.get("model", "?")


def check_match(reference: Identity, this: Identity) -> None:
    """Refuse a comparison of different things, saying which."""
    if reference.tokenizer != this.tokenizer:
        raise ConfigError(
            "the reference was made with another tokenizer (vocabulary digest "
            f"{reference.tokenizer[:12]}, this model's {this.tokenizer[:12]}): KL divergence "
            "compares distributions over the same tokens",
            param="reference",
        )
    if reference.text != this.text or reference.tokens != this.tokens:
        raise ConfigError(
            f"the reference scored another text (digest {reference.text[:12]}, this file's "
            f"{this.text[:12]})",
            param="reference",
        )
    if (reference.context, reference.stride) != (this.context, this.stride):
        raise ConfigError(
            f"the reference scored windows of {reference.context} tokens every "
            f"{reference.stride}; compare with the same --context and --stride",
            param="context",
        )


def mean_se(values: torch.Tensor) -> tuple[float, float]:
    """Mean and its standard error."""
    values = values.double()
    n = values.numel()
    spread = float(values.std()) if n > 1 else 0.0
    return float(values.mean()), spread / math.sqrt(n)


def perplexity(nll: torch.Tensor) -> dict[str, float]:
    """Perplexity with its 95% interval (from the mean negative log-likelihood's)."""
    mean, se = mean_se(nll)
    return {
        "tokens": nll.numel(),
        "nll": mean,
        "ppl": math.exp(mean),
        "ppl_low": math.exp(mean - Z95 * se),
        "ppl_high": math.exp(mean + Z95 * se),
    }


def divergence(collector: Collector, reference: Reference) -> dict[str, Any]:
    """KL statistics, top-token agreement and the perplexity change against the reference."""
    kl_mean, kl_se = mean_se(collector.kl)
    quantiles = torch.tensor([p / 100 for p in PERCENTILES], dtype=torch.float64)
    kl_q = torch.quantile(collector.kl.double(), quantiles).tolist()
    same = (collector.top1 == reference.top_ids[:, 0]).double()
    ref_nll = -reference.token_logprobs
    delta_mean, delta_se = mean_se(collector.nll - ref_nll)  # ln(ppl / ppl_ref) per token
    dp = collector.nll.neg().exp() - reference.token_logprobs.exp()
    ours, theirs = perplexity(collector.nll), perplexity(ref_nll)
    return {
        "tokens": collector.nll.numel(),
        "kl_mean": kl_mean,
        "kl_se": kl_se,
        "kl_percentiles": dict(zip([str(p) for p in PERCENTILES], kl_q, strict=True)),
        "kl_max": float(collector.kl.max()),
        "same_top": float(same.mean()),
        "top_changed": 1.0 - float(same.mean()),
        "ppl": ours["ppl"],
        "ppl_reference": theirs["ppl"],
        "delta_ppl": ours["ppl"] - theirs["ppl"],
        "ln_ppl_ratio": delta_mean,
        "ln_ppl_ratio_se": delta_se,
        "rms_delta_p": float(dp.double().pow(2).mean().sqrt()),
        "top_k": reference.top_ids.shape[1],
        "reference_mass": float(reference.top_logprobs.double().exp().sum(-1).mean()),
    }
