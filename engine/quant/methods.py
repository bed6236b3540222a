"""The quantization methods dgpp serves, by name (the `quantization` knob's choices): apart from
`quant_schemes` so that the knobs, and so reading a deployment, need no torch."""

from __future__ import annotations

# Group-quantized linear layers (`quant_schemes`, `kernels.group_linear`).
GROUP_METHODS = ("gptq", "awq", "auto-round", "compressed-tensors", "fp8", "modelopt")
# mxfp4: gpt-oss's own export (experts only; `layers.mxfp4_experts`)
METHODS = ("gguf", *GROUP_METHODS, "mxfp4")
