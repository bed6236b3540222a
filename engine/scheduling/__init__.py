"""Requests and the steps that serve them: the one record of a request in flight (`request`),
the scheduler that plans each step (`scheduler`: decode rows, prefill chunks, admission and
preemption) under the step policy and its model of step times (`step_policy`, `step_times`,
`layer_slices`), what a step's logits become (`step_sampling`, `output_processor`), and the
engine's counters (`stats`).

May import `planning` and everything below it; a speculative proposer only as an annotation
(the front hands the scheduler one). The map: docs/engine.md.
"""
