"""mkdocs hooks (mkdocs.yml `hooks:`): the CLI reference is generated from the argparse definitions at build
time (docs/cli.md holds a marker), so it cannot drift from the flags the commands take."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

MARKER = "<!-- cli-reference -->"
ROOT = Path(__file__).resolve().parent.parent


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def cli_reference() -> str:
    """A section per `specwire` command: what it does, its usage line and a table of its flags."""
    # NOTE: the flags' defaults read SPECWIRE_* variables; the reference shows the built-in ones
    saved = {k: v for k, v in os.environ.items() if k.startswith("SPECWIRE_")}
    for key in saved:
        del os.environ[key]
    sys.path.insert(0, str(ROOT))
    try:
        from specwire.cli import build_parser

        parser = build_parser()
    finally:
        sys.path.remove(str(ROOT))
        os.environ.update(saved)
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    helps = {choice.dest: choice.help for choice in sub._choices_actions}
    out = []
    for name, command in sub.choices.items():
        command.prog = f"specwire {name}"
        summary = helps.get(name, "")
        out += [f"## specwire {name}", "", f"{summary[:1].upper()}{summary[1:]}.", ""]
        out += ["```text", command.format_usage().strip(), "```", ""]
        out += ["| flag | what it sets |", "|---|---|"]
        for action in command._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            flags = ", ".join(f"`{s}`" for s in action.option_strings) or f"`{action.dest}` (positional)"
            if action.choices:
                flags += " " + "/".join(f"`{c}`" for c in action.choices)
            out.append(f"| {flags} | {_cell(action.help or '')} |")
        out.append("")
    return "\n".join(out)


def on_page_markdown(markdown: str, page, config, files) -> str:
    if MARKER in markdown:
        return markdown.replace(MARKER, cli_reference())
    return markdown
