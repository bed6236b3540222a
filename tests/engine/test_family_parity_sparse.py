"""The parity harness (`family_parity`) over the sparse families with few indexer heads,
whose budgets' cuts fall among tied scores (issue 62: chunking, decode and prefix hits chose
other tied keys than one chunk)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine.family_cases import TIED
from tests.engine.family_parity import Family
from tests.engine.test_family_parity import check_text_family


@pytest.mark.parametrize("family", TIED, ids=lambda family: family.name)
def test_tied_family_matches_transformers(
    tmp_path: Path, tokenizer_dir: Path, family: Family
) -> None:
    check_text_family(tmp_path, tokenizer_dir, family)
