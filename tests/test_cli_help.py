"""`eagle-fast COMMAND --help`: every flag in a named group, each flag's help on one line at
COLUMNS=120 (the details live in docs/), -v documented."""

from __future__ import annotations

import re

import pytest
from _pipeline import run_main

from eagle_fast.cli_args import CHAT, ENGINE, HELP_COLUMN, INPUT, OUTPUT, SUPERVISION
from eagle_fast.cli_loop import SAMPLING

MAX_HELP = 72  # characters of one flag's help
SERVE_CHAT = "chat rendering (none here: set the template in the trainer's dataset)"
GROUPS = {
    "extract": [INPUT, ENGINE, SUPERVISION, OUTPUT, CHAT],
    "vocab": [INPUT, "output", CHAT],
    "verify": [INPUT, "checks"],
    "inspect": [INPUT, "output", CHAT],
    "merge": [INPUT, OUTPUT],
    "serve": [INPUT, ENGINE, SUPERVISION, "server", SERVE_CHAT],
    "regenerate": [INPUT, "turns", SAMPLING, ENGINE, OUTPUT, CHAT],
    "accept": [INPUT, SAMPLING, ENGINE, "output", CHAT],
    "demo": [ENGINE, "output"],
}


@pytest.fixture(autouse=True)
def columns(monkeypatch):
    monkeypatch.setenv("COLUMNS", "120")


def help_text(capsys, *argv) -> str:
    code, out, _ = run_main(capsys, *argv, "--help")
    assert code == 0
    return out


def sections(text: str) -> dict[str, list[str]]:
    """Each `title:` section of a help text, with its lines."""
    out, title = {}, None
    for line in text.splitlines():
        if line and not line[0].isspace() and line.endswith(":"):
            title = line[:-1]
            out[title] = []
        elif title is not None and line.strip():
            out[title].append(line)
    return out


@pytest.mark.parametrize("command", GROUPS)
def test_flags_sit_in_named_groups(capsys, command):
    found = sections(help_text(capsys, command))
    assert [t for t in found if t not in ("options", "positional arguments")] == GROUPS[command]
    # only -h and -v are left outside the groups
    flags = [line.split()[0].rstrip(",") for line in found["options"] if line.startswith("  -")]
    assert flags == ["-h", "-v"], found["options"]


@pytest.mark.parametrize("command", ["", *GROUPS])
def test_each_flags_help_is_one_short_line(capsys, command):
    text = help_text(capsys, *([command] if command else []))
    assert max(len(line) for line in text.splitlines()) <= 120
    for title, lines in sections(text).items():
        if title == "examples":
            continue
        for i, line in enumerate(lines):
            if line.startswith(" " * HELP_COLUMN):
                # a help line of its own: only right under an entry too long to hold its help
                entry = lines[i - 1]
                assert i > 0 and not entry.startswith(" " * HELP_COLUMN), f"{title}: wrapped help:\n{entry}\n{line}"
                assert not re.search(r"\S {2,}\S", entry.strip()), f"{title}: wrapped help:\n{entry}\n{line}"
                help_part = line.strip()
            else:
                help_part = " ".join(re.split(r" {2,}", line.strip())[1:])
            assert len(help_part) <= MAX_HELP, f"{title}: help over {MAX_HELP} characters (details go to docs/):\n{line}"


def test_verbose_is_documented(capsys):
    text = help_text(capsys)
    assert "-v, --verbose" in text and "-v (before or after the command)" in text
    assert "-v, --verbose" in help_text(capsys, "extract")
