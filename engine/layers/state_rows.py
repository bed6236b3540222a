"""Key and value rows kept inside a float32 state slot (`backends.state_cache`) at
`engine.kv_cache_dtype`: a sliding window's last keys and values (MiMo's `window_kv`,
DeepSeek-V4's `v4_state`), which a paged cache would have stored quantized too.

At `auto` a row is its float32 values (exact for any model dtype). Quantized, it is the
format's bytes (`kernels.kv_quant` per head, `kernels.latent_quant` per row) in a byte view of
the slot's elements, padded to a whole element. A layer encodes its new rows before attending
over them, so a token's own key is read as it will be stored, as in a paged layer.
"""

from __future__ import annotations

import torch

from dgpp.engine.backends.state_cache import STATE_DTYPE
from dgpp.kernels.kv_quant import KvFormat
from dgpp.kernels.latent_quant import RowFormat

RowCodec = KvFormat | RowFormat | None


def row_bytes(fmt: RowCodec, width: int) -> int:
    """Bytes of one stored row of `width` values (a head, or a whole key)."""
    if fmt is None:
        return width * STATE_DTYPE.itemsize
    return fmt.width if isinstance(fmt, KvFormat) else fmt.width(STATE_DTYPE)


def region_numel(nbytes: int) -> int:
    """State elements that hold `nbytes` (rounded up to a whole element)."""
    return -(-nbytes // STATE_DTYPE.itemsize)


def region(
    pool: torch.Tensor, start: int, shape: tuple[int, ...], fmt: RowCodec, width: int
) -> torch.Tensor:
    """Rows `shape` of `width` values at element `start` of every slot of `pool` [slots, N]:
    float32 [slots, *shape, width] at `auto`, else uint8 [slots, *shape, row_bytes] (a view:
    writes land in the pool)."""
    slots, size = pool.shape[0], row_bytes(fmt, width)
    count = size * int(torch.Size(shape).numel())
    words = pool[:, start : start + region_numel(count)]
    if fmt is None:
        return words.view(slots, *shape, width)
    return words.view(torch.uint8)[:, :count].view(slots, *shape, size)


def encode(rows: torch.Tensor, fmt: RowCodec) -> torch.Tensor:
    """Rows [..., width] in any dtype as they are stored."""
    if fmt is None:
        return rows.float()
    if isinstance(fmt, KvFormat):
        return fmt.encode(rows)
    return fmt.encode(rows.float().reshape(-1, rows.shape[-1])).view(*rows.shape[:-1], -1)


def decode(stored: torch.Tensor, fmt: RowCodec) -> torch.Tensor:
    """Stored rows back as float32 [..., width]."""
    return stored if fmt is None else fmt.decode(stored, STATE_DTYPE)
