"""Speculative decoding: drafts from n-grams of a request's own history (`ngram`), or from the
checkpoint's own MTP layers (`mtp_drafter` builds the draft passes on rank 0, `mtp_runner` runs
the layers on every rank: the runner's `Drafting`), and how deep a draft pays
(`spec_depth`); one forward verifies, output unchanged.

May import `execution` and everything below it. The map: docs/engine.md.
"""
