"""Prompt files: JSON Lines, gzipped when the name ends in .gz."""

import gzip
import json
from collections.abc import Iterator


def read_rows(path) -> Iterator[tuple[str, object]]:
    """(file:line, row) for each non-blank line; a line that is not JSON raises ValueError naming
    it."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{number}: not valid JSON ({e.msg})") from None
            yield f"{path}:{number}", row
