"""A step on a rank: the message every rank receives for it (`step_message`), the model runner
that turns the message into tensors and runs the forward (`model_runner`), CUDA decode graphs
and the CPU's fused decode step (`decode_graphs`, `native_decode`), weights packed in the
background (`background_packing`), the prefix cache's tiers opened on a rank (`tier_setup`),
and what the runner hands a drafter that runs layers beside the model (`drafting`).

May import `scheduling` (the plans) and everything below it; never a drafter (the front hands
the runner one). The map: docs/engine.md.
"""
