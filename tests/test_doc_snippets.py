# Copyright Contributors to the numpyro-fed project.
# SPDX-License-Identifier: Apache-2.0
"""Every ```python block of README.md and docs/*.md runs as written: a page's blocks
run in order in one namespace, in a fresh interpreter on the CPU, as a reader who
pastes them would run them. Blocks not meant to run are fenced ```bash or ```text.
The tutorials (docs/tutorials/) are executed by the docs build instead."""

import os
from pathlib import Path
import re
import subprocess
import sys

import pytest

# Run by `make docs` (with the site build), not by the default test run.
pytestmark = pytest.mark.docs

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# An opening fence of three or more backticks with the info string "python" (MyST's
# "{code-cell}" pages are executed by the docs build and are not matched here).
FENCE = re.compile(
    r"^(?P<fence>`{3,})python[ \t]*\n(?P<body>.*?)^(?P=fence)[ \t]*$", re.M | re.S
)

# Runs in the child: each block is compiled under its page and line, so a failure names
# the block that failed.
RUNNER = """
import sys
namespace = {"__name__": "__main__"}
for name, source in BLOCKS:
    exec(compile(source, name, "exec"), namespace)
"""


def python_blocks(text: str) -> list[tuple[int, str]]:
    """(first line number, source) of each ```python block of a Markdown text."""
    return [
        (text.count("\n", 0, m.start("body")) + 1, m.group("body"))
        for m in FENCE.finditer(text)
    ]


def test_blocks_are_found():
    text = (
        "intro\n```python\nx = 1\n```\n\n```bash\nmake\n```\n````python\ny = 2\n````\n"
    )
    assert python_blocks(text) == [(3, "x = 1\n"), (10, "y = 2\n")]


def test_every_block_is_run_or_says_why_not():
    # A block fenced ```py or ```python3 would escape the check below: only these info
    # strings are allowed, and only "python" runs ("{code-cell}" only on a notebook
    # page, which the docs build executes).
    allowed = {"python", "text", "bash", "toml", "{toctree}"}
    for page in PAGES:
        text = page.read_text()
        opening = re.findall(r"^`{3,}(\S*)[^\n]*\n.*?^`{3,}[ \t]*$", text, re.M | re.S)
        notebook = (
            text.startswith("---\n") and "kernelspec:" in text.split("\n---\n")[0]
        )
        odd = sorted(set(opening) - allowed - ({"{code-cell}"} if notebook else set()))
        assert not odd, (
            f"{page.relative_to(ROOT)}: code fences {odd}; use one of {sorted(allowed)}"
        )


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_page_blocks_run(page: Path, tmp_path: Path):
    blocks = python_blocks(page.read_text())
    if not blocks:
        pytest.skip("no python blocks")
    rel = page.relative_to(ROOT)
    # Pad each block with blank lines so that tracebacks show the page's line numbers.
    named = [(f"{rel}", "\n" * (line - 1) + src) for line, src in blocks]
    script = tmp_path / "run_page.py"
    script.write_text(f"BLOCKS = {named!r}\n{RUNNER}")
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])
        ),
        "MPLBACKEND": "Agg",
    }
    # Each page runs where a reader would run it: the repository root.
    proc = subprocess.run(
        [sys.executable, str(script)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"{rel}: a python block failed\n{proc.stderr[-4000:]}"
