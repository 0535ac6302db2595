"""docs/flags.md, written from the argparse parsers themselves, so the flag reference is
never typed twice (tests/test_cli.py keeps the file in sync).

    python -m butter.flags_doc > docs/flags.md
"""

from __future__ import annotations

import argparse
import re
import sys

from butter.cli import build_parser
from butter.settings import serve_flags

HEADER = """# Flags

Every flag of `butter serve` and `butter serve-bench`, from the parsers themselves
(`butter serve --help` says the same). Regenerate with
`python -m butter.flags_doc > docs/flags.md`; a test fails when it is out of date.
"""


def _machine_defaults(command: str) -> dict[str, str]:
    """Defaults read off the machine or the environment, by dest: the doc says how (each
    flag's doc_default, butter/settings.py), not this machine's value."""
    if command != "serve":
        return {}
    return {spec.dest: spec.doc_default for _, spec in serve_flags() if spec.doc_default}


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _default(action: argparse.Action, machine: dict[str, str]) -> str:
    if action.dest in machine:
        return machine[action.dest]
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


def _help(action: argparse.Action, default: str) -> str:
    text = action.help or ""
    if default != "—":  # else the help's own words are the default's only say
        text = _SAYS_DEFAULT.sub("", text)
    text = text.replace("%(default)s", default.strip("`"))
    text = text.replace("%(default)r", repr(action.default))
    return text.replace("|", "\\|").replace("\n", " ")


def _row(action: argparse.Action, machine: dict[str, str]) -> str:
    names = " / ".join(f"`{name}`" for name in action.option_strings if name.startswith("--"))
    default = _default(action, machine)
    return f"| {names} | {default} | {_help(action, default)} |"


def _groups(command: argparse.ArgumentParser) -> list[tuple[str, list[argparse.Action]]]:
    """(title, flags) of each argument group with flags, --help left out."""
    groups = [(group.title or "", [action for action in group._group_actions
                                   if action.option_strings and action.dest != "help"])
              for group in command._action_groups]
    return [(title, actions) for title, actions in groups if actions]


def _command_section(name: str, command: argparse.ArgumentParser) -> list[str]:
    parts = [f"\n## `butter {name}`"]
    machine = _machine_defaults(name)
    groups = _groups(command)
    for title, actions in groups:
        # A command whose flags are all in one group needs no sub-heading.
        parts.append(f"\n### {title}\n" if len(groups) > 1 else "")
        parts += ["| flag | default | meaning |", "|---|---|---|"]
        parts += [_row(action, machine) for action in actions]
    return parts


def flags_markdown() -> str:
    parts = [HEADER]
    for name, command in _subcommands(build_parser()).items():
        parts += _command_section(name, command)
    return "\n".join(parts) + "\n"


if __name__ == "__main__":
    sys.stdout.write(flags_markdown())
