"""Writes the knob table of docs/engine.md from the knobs' declarations
(dgpp.engine.configuration.knobs).

.venv/bin/python scripts/knob_table.py          # rewrite the table
.venv/bin/python scripts/knob_table.py --check  # exit 1 when the file's table is stale
"""

from __future__ import annotations

import sys
from pathlib import Path

from dgpp.engine.configuration.engine_config import EngineConfig
from dgpp.engine.configuration.knobs import knob_table
from dgpp.engine.distributed.world_spec import WorldTimeouts
from dgpp.engine.server.core.config import ServerConfig

DOC = Path(__file__).resolve().parents[1] / "docs" / "engine.md"
BEGIN = "<!-- knob table: written by scripts/knob_table.py from the knobs' declarations -->\n"
END = "<!-- end of the knob table -->\n"
CLASSES = (EngineConfig, ServerConfig, WorldTimeouts)


def rendered(text: str) -> str:
    """`text` with the table between the markers as the declarations say."""
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    parts = []
    for cls in CLASSES:
        parts.append(f"`{cls.__name__}`:\n\n{knob_table(cls)}")
    return head + BEGIN + "\n".join(parts) + END + tail


def main(argv: list[str]) -> int:
    text = DOC.read_text()
    new = rendered(text)
    if "--check" in argv:
        if new != text:
            print(f"{DOC} is stale: run scripts/knob_table.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(new)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
