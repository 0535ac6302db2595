"""Each `butter serve` flag is declared once, with its ServeSettings field
(butter/settings.py): the parser and the args → settings mapping are the fields' own."""

from __future__ import annotations

import argparse
from typing import Any

import attrs
import pytest

from butter import cpu
from butter.cli import build_parser, settings_from_args
from butter.settings import API_KEY_ENV, FLAG, ServeSettings, serve_flags

# The serve flags that set no field: they act before any settings exist.
NOT_SETTINGS = {"help", "verbose"}


@pytest.fixture(autouse=True)
def _no_api_key_in_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(API_KEY_ENV, raising=False)  # the parser's --api-key default


def _serve_parser() -> argparse.ArgumentParser:
    for action in build_parser()._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices["serve"]
    raise AssertionError("no serve command")


def _settings(*flags: str) -> ServeSettings:
    return settings_from_args(build_parser().parse_args(["serve", "--model", "m", *flags]))


def _field_default(field: attrs.Attribute[Any]) -> Any:
    default = field.default
    return default.factory() if isinstance(default, attrs.Factory) else default


def test_the_parser_has_each_fields_flag_with_its_names_help_group_and_default() -> None:
    serve = _serve_parser()
    actions = {action.dest: action for action in serve._actions}
    group_of = {action.dest: group.title for group in serve._action_groups
                for action in group._group_actions}
    fields = {field.name: field for field in attrs.fields(ServeSettings)}
    for name, spec in serve_flags():
        action = actions[spec.dest]
        assert set(spec.names) <= set(action.option_strings), name
        assert action.help == spec.help and group_of[spec.dest] == spec.group, name
        # What the parser holds by default is the field's default, once read back.
        if fields[name].default is attrs.NOTHING:
            assert action.required, name
        else:
            assert spec.setting(action.default) == _field_default(fields[name]), name


def test_no_serve_flag_is_written_by_hand_but_help_and_verbose() -> None:
    flags = {action.dest for action in _serve_parser()._actions}
    from_fields = {spec.dest for _, spec in serve_flags()}
    assert flags - from_fields == NOT_SETTINGS
    assert from_fields <= flags
    # ... and every field is a flag: a setting no command line can change would be missed.
    assert all(FLAG in field.metadata for field in attrs.fields(ServeSettings))


def test_no_flags_give_the_fields_defaults() -> None:
    assert _settings() == ServeSettings(model="m")


@pytest.mark.parametrize(("flags", "field", "value"), [
    (["--no-fit-threads"], "fit_threads", False),  # on/off, on by default
    (["--deterministic"], "deterministic", True),  # on/off, off by default
    (["--enable-thinking"], "enable_thinking", True),  # on/off, unsaid by default
    (["--no-enable-thinking"], "enable_thinking", False),
    (["--allow-model-paths"], "allow_model_paths", True),  # on only
    (["--port", "1234"], "port", 1234),  # int
    (["--parallel", "3"], "parallel", 3),  # int, at least 1
    (["--body-timeout", "2.5"], "body_timeout", 2.5),  # float
    (["--alias", "friendly"], "alias", "friendly"),  # str
    (["--kv-cache", "affine8"], "kv_cache", "affine8"),
    (["--reasoning-effort", "high"], "reasoning_effort", "high"),  # choices
    (["--cors-origins", "https://a, https://b", "--cors-origins", "https://c"],
     "cors_origins", ("https://a", "https://b", "https://c")),  # repeated lists
    (["--cache-ram", "512"], "cache_ram_mib", 512),  # a flag named unlike its field
    (["--cache-ram", "-5"], "cache_ram_mib", 0),  # negative: off
    (["--stream-flush-ms", "250"], "stream_flush", 0.25),  # milliseconds to seconds
    (["--stream-flush-ms", "-1"], "stream_flush", 0.0),
    (["--write-timeout", "-3"], "write_timeout", 0.0),
    (["--decode-stall", "0.5"], "decode_stall", 0.5),
    (["--draft-max", "-1"], "draft_max", 0),
    (["--api-key", ""], "api_key", None),  # an empty key is no key
    (["--api-key", "sekrit"], "api_key", "sekrit"),
])
def test_a_flag_sets_its_own_field_and_no_other(flags: list[str], field: str,
                                                 value: object) -> None:
    settings = _settings(*flags)
    assert getattr(settings, field) == value
    assert type(getattr(settings, field)) is type(value)
    default = getattr(ServeSettings(model="m"), field)
    assert attrs.evolve(settings, **{field: default}) == ServeSettings(model="m")


def test_every_on_off_flag_turns_its_own_field_on_and_off() -> None:
    switches = [(name, spec) for name, spec in serve_flags()
                if spec.options.get("action") is argparse.BooleanOptionalAction]
    assert len(switches) >= 8
    for name, spec in switches:
        assert getattr(_settings(spec.names[0]), name) is True
        assert getattr(_settings("--no-" + spec.names[0].removeprefix("--")), name) is False


@pytest.mark.parametrize("flags", [
    ["--parallel", "0"], ["--reasoning-effort", "extreme"], ["--port", "http"],
])
def test_a_bad_value_is_the_parsers_error(flags: list[str],
                                          capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        _settings(*flags)
    assert exited.value.code == 2
    assert flags[0] in capsys.readouterr().err


def test_flag_combinations_are_still_checked() -> None:
    with pytest.raises(ValueError, match="requires --kv-window-size"):
        _settings("--kv-window-keep", "4")
    assert _settings("--kv-window-size", "64", "--kv-window-keep", "4").kv_window_keep == 4


def test_the_model_is_required_by_the_parser_and_the_settings() -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve"])
    with pytest.raises(TypeError):
        ServeSettings()


def test_machine_and_environment_defaults_are_read_when_the_parser_is_built(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu, "usable_cores", lambda: 3)
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    settings = _settings()
    assert (settings.threads, settings.api_key) == (3, "from-env")
    assert "CPU quota, 3)" in _serve_parser().format_help()
    # The environment is the parser's default only: ServeSettings itself reads none.
    assert ServeSettings(model="m").api_key is None
    assert ServeSettings(model="m").threads == 3


def test_help_lists_the_groups_in_the_order_the_fields_name_them() -> None:
    text = _serve_parser().format_help()
    titles = [*dict.fromkeys(spec.group for _, spec in serve_flags()), "Logging"]
    where = [text.index(f"\n{title}:\n") for title in titles]
    assert where == sorted(where) and len(titles) >= 5
    assert text.index("--verbose") > where[-1]
