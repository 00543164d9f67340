"""JSON-lines files of examples (SFT, classification, evaluation tasks), read one way."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any, Iterator, Tuple, Union

from megalm.errors import DataError


def json_lines(path: Union[str, Path]) -> Iterator[Tuple[str, Any]]:
    """("file:line", record) of each non-blank line of a JSON-lines file (gzipped when it ends in
    .gz); a line that is not JSON is a DataError naming its file and line."""
    path = Path(path)
    with (gzip.open(path, "rt", encoding="utf-8") if path.name.endswith(".gz") else open(path, encoding="utf-8")) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield f"{path}:{n}", json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{n}: not JSON ({e.msg})") from None
