"""docs/flags.md, written from the argparse parsers themselves, so the flag reference is
never typed twice (tests/test_cli.py keeps the file in sync).

    python -m butter.flags_doc > docs/flags.md
"""

from __future__ import annotations

import argparse
import re
import sys

from butter.cli import build_parser

# Defaults read off the machine or the environment: the doc says how, not this machine's.
MACHINE_DEFAULTS = {
    "threads": "usable cores",
    "cache_ram": "a quarter of RAM, at most 8192",
    "max_connections": "open-file limit − 128, at most 4096",
    "api_key": "$BUTTER_API_KEY",
}
HEADER = """# Flags

Every flag of `butter serve` and `butter serve-bench`, from the parsers themselves
(`butter serve --help` says the same). Regenerate with
`python -m butter.flags_doc > docs/flags.md`; a test fails when it is out of date.
"""


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _default(action: argparse.Action) -> str:
    if action.dest in MACHINE_DEFAULTS:
        return MACHINE_DEFAULTS[action.dest]
    if isinstance(action, argparse.BooleanOptionalAction | argparse._StoreTrueAction):
        return "on" if action.default else "off"
    if action.required:
        return "required"
    unset = action.default is None or action.default is argparse.SUPPRESS
    if unset or action.default is False or action.default == []:
        return "—"
    return f"`{action.default}`"


# The help's own "(default ...)": the table has a column for it.
_SAYS_DEFAULT = re.compile(r"\s*\((?:default|default:)[^()]*(?:\([^()]*\)[^()]*)*\)\s*$")


def _help(action: argparse.Action) -> str:
    text = action.help or ""
    if _default(action) != "—":  # else the help's own words are the default's only say
        text = _SAYS_DEFAULT.sub("", text)
    text = text.replace("%(default)s", _default(action).strip("`"))
    text = text.replace("%(default)r", repr(action.default))
    return text.replace("|", "\\|").replace("\n", " ")


def _row(action: argparse.Action) -> str:
    names = " / ".join(f"`{name}`" for name in action.option_strings if name.startswith("--"))
    return f"| {names} | {_default(action)} | {_help(action)} |"


def flags_markdown() -> str:
    parts = [HEADER]
    for name, command in _subcommands(build_parser()).items():
        parts += [f"\n## `butter {name}`\n", "| flag | default | meaning |", "|---|---|---|"]
        parts += [_row(action) for action in command._actions
                  if action.option_strings and action.dest != "help"]
    return "\n".join(parts) + "\n"


if __name__ == "__main__":
    sys.stdout.write(flags_markdown())
