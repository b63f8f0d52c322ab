"""Every Python example in docs/ runs as written."""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
BLOCK = re.compile(r"```python\n(.*?)```", re.S)
EXAMPLES = [
    pytest.param(code, id=f"{page.name}#{i}")
    for page in sorted(DOCS.rglob("*.md"))
    for i, code in enumerate(BLOCK.findall(page.read_text()))
]


# Examples that start a child process (a ProcessSink) only work as a guarded script: a user
# copies them into a file, so they are run as one.
STARTS_PROCESSES = ('if __name__ == "__main__":', "ProcessSink", '"child_process": True')


PRINTED_DICT = re.compile(r"print\(.*\)\s+# (\{.*)")


def _dict_claims(code: str) -> list[str]:
    """The ``{...}`` a ``print(...)  # {...}`` line says it prints (up to its closing brace)."""
    claims = []
    for match in PRINTED_DICT.finditer(code):
        text, depth = match.group(1), 0
        for end, char in enumerate(text):
            depth += {"{": 1, "}": -1}.get(char, 0)
            if depth == 0:
                claims.append(text[: end + 1])
                break
    return claims


def _check_dict_claims(code: str, stdout: str) -> None:
    """Each printed dict claim matches a printed line, ``...`` standing for anything."""
    lines = stdout.splitlines()
    for claim in _dict_claims(code):
        pattern = re.compile(".*?".join(re.escape(part) for part in claim.split("...")))
        assert any(pattern.fullmatch(line) for line in lines), (claim, stdout[-2000:])


PRINTED = re.compile(r"print\(.*\)\s+# (.*)")
# A comment that shows output (a tensor, a list, a number, an error message), not one that
# describes it in words ("the int64 per-class counts behind them").
SHOWN = re.compile(r"tensor\(|torch\.Size|ReduceOp|True\b|False\b|\[|'|-?\d|\w+: expected|sink ")
# Where a shown output ends and its explanation starts: "tensor(0.4444, ...): F1 per class".
EXPLAINED = re.compile(r"(?=, |: |; )")


def _printed_claims(code: str) -> list[str]:
    """The outputs that ``print(...)  # ...`` lines show (dicts are ``_dict_claims``')."""
    return [
        claim for claim in PRINTED.findall(code) if not claim.startswith("{") and SHOWN.match(claim)
    ]


def _check_printed_claims(code: str, stdout: str) -> None:
    """Each shown output (or its part before an explanation) is a printed line, ``...`` any text."""
    import torch  # here: the docs session checks the nav without torch installed

    lines = stdout.splitlines()
    for claim in _printed_claims(code):
        if "device='cuda" in claim and not torch.cuda.is_available():
            continue  # the block's CUDA part prints nothing here
        readings = [claim] + [claim[: cut.start()] for cut in EXPLAINED.finditer(claim)]
        patterns = [
            re.compile(".*?".join(re.escape(part) for part in reading.split("...")))
            for reading in readings
        ]
        assert any(p.fullmatch(line) for p in patterns for line in lines), (claim, stdout[-2000:])


def test_printed_claims_are_checked() -> None:
    code = "print(x)  # tensor(0.5000, dtype=torch.float64): the mean\nprint(y)  # the counts\n"
    assert _printed_claims(code) == ["tensor(0.5000, dtype=torch.float64): the mean"]
    _check_printed_claims(code, "tensor(0.5000, dtype=torch.float64)\n")
    with pytest.raises(AssertionError):
        _check_printed_claims(code, "tensor(0.2500, dtype=torch.float64)\n")


@pytest.mark.parametrize("code", EXAMPLES)
def test_example_runs(code: str, tmp_path: Path) -> None:
    if not any(marker in code for marker in STARTS_PROCESSES):
        printed = io.StringIO()
        with contextlib.redirect_stdout(printed):
            exec(compile(code, "<docs>", "exec"), {"__name__": "docs_example"})
        _check_dict_claims(code, printed.getvalue())
        _check_printed_claims(code, printed.getvalue())
        return
    # A script that starts processes: run it as one, so its functions can be pickled.
    script = tmp_path / "example.py"
    script.write_text(code)
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    _check_dict_claims(code, done.stdout)
    _check_printed_claims(code, done.stdout)


# The nav, read without a YAML parser (the tests session does not install mkdocs): every
# ``*.md`` path between ``nav:`` and the next top-level key.
NAV_PAGE = re.compile(r"[\w./-]+\.md")


def _nav_pages() -> list[str]:
    config = (ROOT / "mkdocs.yml").read_text()
    nav = re.split(r"\n(?=\S)", config.split("\nnav:\n", 1)[1], maxsplit=1)[0]
    return NAV_PAGE.findall(nav)


def test_nav_lists_every_page_once() -> None:
    pages = _nav_pages()
    on_disk = sorted(page.relative_to(DOCS).as_posix() for page in DOCS.rglob("*.md"))
    assert sorted(pages) == on_disk, "mkdocs.yml nav and docs/*.md differ"


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built site: ``$SIDESTREAM_SITE_DIR`` (``nox -s docs`` builds it), else built here."""
    if built := os.environ.get("SIDESTREAM_SITE_DIR"):
        return Path(built).resolve()
    for module in ("mkdocs", "material", "mkdocstrings"):
        pytest.importorskip(module)
    out = tmp_path_factory.mktemp("site")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=ROOT,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return out


@pytest.mark.parametrize("page", _nav_pages())
def test_nav_page_is_built_and_reachable(page: str, site: Path) -> None:
    url = "" if page == "index.md" else page.removesuffix(".md") + "/"
    html = (site / url / "index.html").read_text()
    # Reachable: the home page's navigation links to it (material renders the whole nav).
    if url:
        assert f'href="{url}"' in (site / "index.html").read_text(), f"{page}: not in the nav"
    # Every local image it shows was copied into the site.
    for source in re.findall(r'<img[^>]* src="([^"]+)"', html):
        if not source.startswith(("http:", "https:", "data:")):
            assert (site / url / source).resolve().is_file(), f"{page}: missing image {source}"


def test_benchmark_page_has_its_plots(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from benchmarks import plots

    page = (DOCS / "benchmarks.md").read_text()
    redrawn = plots.add_plots(page, tmp_path)
    assert redrawn == page  # the committed page already links every plot, once
    for plot in plots.PLOTS:
        link = f"(figures/bench-{plot.slug}.svg)"
        assert page.count(link) == 1, link
        assert (tmp_path / "figures" / f"bench-{plot.slug}.svg").read_text().startswith("<?xml")
        assert (DOCS / "figures" / f"bench-{plot.slug}.svg").is_file()
