"""A rank's vision side of a step: the images the step message says to encode (one batched
encoder call, kept in the `EncoderCache`), the M-RoPE positions of rows that hold image tokens,
and what the decoder takes from them (`VisionInputs`: the image tokens' embeddings in place of
their placeholders' and the DeepStack features added after the first layers)."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dgpp.engine.vision.encoder_cache import Encoded, EncoderCache
from dgpp.engine.vision.qwen_vision import QwenVisionEncoder
from dgpp.engine.vision.spans import ImageSpan, chunk_positions


@dataclass(frozen=True)
class VisionInputs:
    """Image tokens of one step: their rows among the step's tokens, their embeddings and
    DeepStack features (each [n, hidden])."""

    index: torch.Tensor
    embeds: torch.Tensor
    deepstack: tuple[torch.Tensor, ...] = ()

    def merge(self, hidden: torch.Tensor) -> torch.Tensor:
        """The token embeddings with the images' in place of their placeholders'."""
        return hidden.index_copy(0, self.index, self.embeds.to(hidden.dtype))

    def after_layer(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """The residual stream after decoder layer `layer`, DeepStack features added."""
        if layer >= len(self.deepstack):
            return hidden
        return hidden.index_add(0, self.index, self.deepstack[layer].to(hidden.dtype))


class StepVision:
    """The encoder and its cache on one rank."""

    def __init__(
        self,
        encoder: QwenVisionEncoder,
        capacity_tokens: int,
        device: torch.device,
        dtype: torch.dtype,
    ) -> None:
        self.encoder = encoder
        self.merge = encoder.config.spatial_merge_size
        self.cache = EncoderCache(capacity_tokens)
        self.device, self.dtype = device, dtype
        self.encoder_seconds = 0.0  # cumulative, this rank
        self.images_encoded = 0
        self.fresh: set[int] = set()  # the images the current step encoded

    def encode(
        self, digests: Sequence[int], pixels: torch.Tensor | None, spans: Sequence[ImageSpan]
    ) -> None:
        """A step's images to encode: `digests` (their `pixels` rows concatenated in the same
        order, flat or not; their grids from `spans`) in one call, the outputs held; the step's
        other images stay held. Called every step (none to encode: nothing runs)."""
        self.fresh = set(digests)  # read this step: encoded now, not cache hits
        if not digests:
            return
        assert pixels is not None, "images to encode without their pixels"
        started = time.monotonic()
        by_digest = {span.digest: span for span in spans}
        grids = [by_digest[digest].patch_grid(self.merge) for digest in digests]
        values = pixels.to(self.device, self.dtype).reshape(-1, self.encoder.config.patch_dim)
        tokens, deepstack = self.encoder(values, torch.tensor(grids, dtype=torch.int64))
        sizes = [t * h * w // self.merge**2 for t, h, w in grids]
        layers = [layer.split(sizes) for layer in deepstack]
        for index, (digest, part) in enumerate(zip(digests, tokens.split(sizes), strict=True)):
            encoded = Encoded(part, tuple(layer[index] for layer in layers))
            self.cache.add(digest, encoded, by_digest)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.encoder_seconds += time.monotonic() - started
        self.images_encoded += len(digests)

    def inputs(
        self, rows: Sequence[tuple[int, int, int, tuple[ImageSpan, ...]]]
    ) -> tuple[torch.Tensor, VisionInputs] | None:
        """For rows (start, tokens, shift, spans) in step order: the step's positions [3, T]
        and its image tokens, or None when no row holds one."""
        if not any(spans for *_, spans in rows):
            return None
        positions, index, embeds = [], [], []
        deepstack: list[list[torch.Tensor]] = []
        at = 0
        for start, num_tokens, shift, spans in rows:
            end = start + num_tokens
            if not spans:
                positions.append(torch.arange(start, end).expand(3, -1) + shift)
                at += num_tokens
                continue
            positions.append(chunk_positions(spans, shift, start, end))
            for span in spans:
                first, last = max(start, span.offset), min(end, span.end)
                encoded = self.cache.use(span.digest, span.digest in self.fresh)
                part = slice(first - span.offset, last - span.offset)
                index.append(torch.arange(first - start, last - start) + at)
                embeds.append(encoded.tokens[part])
                deepstack.append([layer[part] for layer in encoded.deepstack])
            at += num_tokens
        device = self.device
        layers = tuple(torch.cat(list(feats)) for feats in zip(*deepstack, strict=True))
        return torch.cat(positions, dim=1).to(device), VisionInputs(
            torch.cat(index).to(device), torch.cat(embeds), layers
        )
