"""The documentation: the site builds in strict mode with no warning (a broken link, anchor or mkdocstrings
reference fails it), the CLI reference lists every flag the commands take, and the README stays short."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    mkdocs = Path(sys.executable).parent / "mkdocs"
    if not mkdocs.exists() and shutil.which("mkdocs") is None:
        pytest.fail("mkdocs is not installed: `pip install -e '.[docs]'` (make install does)")
    out = tmp_path_factory.mktemp("site")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECWIRE_")}
    env["NO_MKDOCS_2_WARNING"] = "1"  # mkdocs-material's notice about its successor, not a warning of this build
    done = subprocess.run([str(mkdocs) if mkdocs.exists() else "mkdocs", "build", "--strict", "--site-dir", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-5000:]
    assert "WARNING" not in done.stderr and "ERROR" not in done.stderr, done.stderr[-5000:]
    return out


def test_the_site_builds_strictly_with_every_page(site):
    for page in ("index", "install", "quickstart", "two-hosts", "troubleshooting", "sdk", "cli", "benchmarks",
                 "internals", "wire-modes", "load", "gpus", "deployment", "openai-api", "models", "testing"):
        assert (site / page / "index.html").exists() or (site / f"{page}.html").exists() or page == "index", page
    assert (site / "index.html").exists()


def test_the_cli_reference_lists_every_flag_of_every_command(site):
    from specwire.cli import build_parser

    html = (site / "cli" / "index.html").read_text()
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name, command in sub.choices.items():
        assert f"specwire {name}" in html
        for action in command._actions:
            for flag in action.option_strings:
                if flag not in ("-h", "--help"):
                    assert f"<code>{flag}</code>" in html, (name, flag)


def test_the_sdk_reference_has_the_docstrings(site):
    html = (site / "sdk" / "index.html").read_text()
    for text in ("Blocking client of a draft service", "asyncio client of a draft service", "UnauthenticatedError",
                 "LocalStack", "acceptance_pair", "What one verification round added"):
        assert text in html, text


def test_the_readme_is_short():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300


def test_no_list_renders_as_a_paragraph(site):
    """Python-Markdown wants a blank line before a list and four spaces before a nested item (GitHub does not):
    a list written otherwise renders as one paragraph of dashes, which strict mode cannot see."""
    import re

    flat = []
    for page in site.rglob("index.html"):
        for paragraph in re.findall(r"<p>(.*?)</p>", page.read_text(), re.S):
            if re.search(r"(^|\n)\s*(- |\d+\. )\S", paragraph):
                flat.append(f"{page.parent.name}: {paragraph[:80]!r}")
    assert not flat, flat
