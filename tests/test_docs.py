"""Every Python example in docs/ runs as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

DOCS = Path(__file__).resolve().parents[1] / "docs"
BLOCK = re.compile(r"```python\n(.*?)```", re.S)
EXAMPLES = [
    pytest.param(code, id=f"{page.name}#{i}")
    for page in sorted(DOCS.rglob("*.md"))
    for i, code in enumerate(BLOCK.findall(page.read_text()))
]


@pytest.mark.parametrize("code", EXAMPLES)
def test_example_runs(code: str) -> None:
    exec(compile(code, "<docs>", "exec"), {"__name__": "docs_example"})
