"""The house rules of src/megalm, kept by the suite so a later change cannot quietly undo them
(docs/ARCHITECTURE.md, "Layers"): import-linter's contracts in pyproject.toml (layers, a family's
parallelize module as the only door from models/ to parallel/, no import loop; imports inside functions
count), no source file over 500 lines, and every megalm import made inside a function saying why."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "megalm"
MAX_LINES = 500
INNER_IMPORT = re.compile(r"^\s+(from|import) megalm\b")


def _sources():
    return sorted(SRC.rglob("*.py"))


def test_the_import_contracts_hold():
    """lint-imports over the installed megalm, with the contracts of pyproject.toml."""
    done = subprocess.run([sys.executable, "-c", "from importlinter.cli import lint_imports_command; "
                           "lint_imports_command()", "--config", str(ROOT / "pyproject.toml"), "--no-cache"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-6000:] + done.stderr[-2000:]


def test_no_source_file_is_over_500_lines():
    long = {str(p.relative_to(ROOT)): n for p in _sources() if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert not long, f"split these by concept (docs/ARCHITECTURE.md): {long}"


def test_every_megalm_import_inside_a_function_says_why():
    """An import inside a function hides a dependency from a reader of the module's head, so each one
    carries its reason (`# lazy: ...`): on its own line, or in the comment right above the run of imports it
    belongs to. The usual reasons: a slow or optional package kept off a path that does not need it."""
    silent = []
    for path in _sources():
        lines = path.read_text().splitlines()
        for number, line in enumerate(lines, 1):
            if not INNER_IMPORT.match(line) or "#" in line:
                continue
            above = number - 2  # the line above, then up through the run of imports this one is in
            while above >= 0 and re.match(r"^\s+(from|import) ", lines[above]):
                above -= 1
            if above < 0 or not lines[above].strip().startswith("#"):
                silent.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not silent, "\n".join(silent)


def test_megalm_imports_inside_functions_are_fewer_than_half_of_212():
    """212 megalm imports were made inside functions before the layering was enforced, most to dodge an
    import loop; at most half stay, each for a reason of its own (the test above)."""
    inner = sum(bool(INNER_IMPORT.match(line)) for path in _sources() for line in path.read_text().splitlines())
    assert inner <= 106, inner
