"""The knobs of a rank's device and memory (`DeviceKnobs`, a base of `EngineConfig`): how much of
the device a rank plans to use, CUDA graphs, locking memory, and the first start's guards on
GPUs nobody could test before (the kernel self-check's strictness, unified memory's floor).
Keyword-only, so `EngineConfig`'s `model` stays its first positional field."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from dgpp.engine.configuration.knobs import knob

KvCacheDtype = Literal["auto", "fp8_e4m3", "int8", "int4"]


@dataclass(frozen=True, kw_only=True)
class DeviceKnobs:
    memory_fraction: float | None = knob(
        None,
        "share of the device's memory (host RAM on CPU) this rank may use; sizes the KV pool "
        "from what the weights leave of it, instead of KV capacity",
        label="Memory fraction",
        group="memory",
        gt=0.0,
        le=1.0,
        when_unset="the pool is KV capacity",
    )
    cuda_graph_max_batch: int = knob(
        64,
        "decode steps of at most this many requests replay a CUDA graph captured at start "
        "(CUDA only; 0: always eager)",
        label="CUDA-graph batch",
        group="scheduling",
        advanced=True,
        unit="requests",
        ge=0,
        le=512,
    )
    mlock: bool = knob(
        False,
        "pin the weights and KV pool in RAM (needs LimitMEMLOCK=infinity or ulimit -l)",
    )
    kv_cache_dtype: KvCacheDtype = knob(
        "auto",
        "how the KV cache stores keys and values: auto (the model dtype), int8 (ggml's Q8_0 "
        "blocks: a float16 scale per 32), fp8_e4m3 (e4m3 codes, a scale per head) or int4 "
        "(Q4_0 blocks of Hadamard-rotated heads, as llama.cpp's q4_0); about twice the "
        "context per GiB at int8 or fp8 for a 16-bit model; "
        "MLA latents keep their rope key at the model dtype (1.7x), DSA indexer keys 8-bit",
        label="KV cache dtype",
        group="memory",
    )
    strict_kernels: bool = knob(
        False,
        "a Triton kernel that fails its start-up self-check against its PyTorch twin (or CUDA "
        "graphs whose logits differ from eager ones) stops the rank instead of falling back",
        label="Strict kernels",
        group="scheduling",
        advanced=True,
    )
    os_memory_floor_gib: float = knob(
        6.0,
        "on a GPU that shares the host's memory (DGX Spark), the memory plan leaves the OS at "
        "least this much; an out-of-memory there can hang the machine instead of failing",
        label="OS memory floor",
        group="memory",
        advanced=True,
        unit="GiB",
        ge=0.0,
    )
    drop_page_cache: bool = knob(
        False,
        "drop the kernel's clean page cache before the memory plan reads the free memory "
        "(needs root; useful where a GPU shares the host's memory)",
        label="Drop page cache",
        group="memory",
        advanced=True,
    )
