"""Compute kernels: the PyTorch paged-attention reference (`paged_attention_torch`, the twin
every faster kernel is tested against) and oneDNN-prepacked linears for CPUs (`linear`)."""
