"""Who may use the server: the Host and Origin rules, API keys, and the model catalog, as
pure decisions (the end-to-end probes against a real server are in test_security.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from butter.models import ModelCatalog, ModelNotAllowed
from butter.server.access import AccessPolicy, ApiKeys, host_name, is_loopback_name
from butter.testing.tiny_gguf import write_tiny_qwen3_gguf

LOOPBACK = AccessPolicy(bound_host="127.0.0.1")


@pytest.mark.parametrize("name", ["localhost", "LOCALHOST", "app.localhost", "127.0.0.1",
                                  "127.4.5.6", "::1", "localhost."])
def test_loopback_names(name: str) -> None:
    assert is_loopback_name(name)


@pytest.mark.parametrize("name", ["0.0.0.0", "evil.example", "localhost.evil.example",
                                  "192.168.1.5", "::", "127.0.0.1.nip.io", ""])
def test_names_that_are_not_loopback(name: str) -> None:
    assert not is_loopback_name(name)


@pytest.mark.parametrize(("authority", "name"), [
    ("example.com:8000", "example.com"), ("[::1]:8000", "::1"), ("::1", "::1"),
    ("LocalHost", "localhost"), ("127.0.0.1", "127.0.0.1"),
])
def test_host_name(authority: str, name: str) -> None:
    assert host_name(authority) == name


def test_a_loopback_listener_answers_only_to_loopback_names() -> None:
    for host in ("127.0.0.1:8000", "localhost:8000", "[::1]:8000", "localhost", None):
        assert LOOPBACK.host_allowed(host), host
    for host in ("evil.example:8000", "0.0.0.0:8000", "192.168.1.5:8000",
                 "localhost.evil.example"):
        assert not LOOPBACK.host_allowed(host), host


def test_allowed_hosts_add_names_and_domains() -> None:
    policy = AccessPolicy(bound_host="127.0.0.1", allowed_hosts=("box.lan", ".corp.example"))
    for host in ("box.lan:8000", "corp.example", "a.b.corp.example:1"):
        assert policy.host_allowed(host), host
    for host in ("other.lan", "evilcorp.example", "box.lan.evil.example"):
        assert not policy.host_allowed(host), host
    assert AccessPolicy(bound_host="127.0.0.1", allowed_hosts=("*",)).host_allowed("any.thing")


def test_a_lan_listener_checks_no_host() -> None:
    """Reached by whatever names the network gives it (an API key guards it instead)."""
    assert AccessPolicy(bound_host="0.0.0.0").host_allowed("box.lan:8000")
    assert AccessPolicy(bound_host="192.168.1.5").host_allowed("anything")


def test_origins() -> None:
    for origin in ("http://localhost:3000", "https://localhost", "http://127.0.0.1:8080",
                   "http://[::1]:5173", "http://app.localhost:3000"):
        assert LOOPBACK.origin_allowed(origin, "127.0.0.1:8000"), origin
    for origin in ("https://evil.example", "null", "file://", "http://0.0.0.0:8000",
                   "chrome-extension://abc", "http://localhost.evil.example"):
        assert not LOOPBACK.origin_allowed(origin, "127.0.0.1:8000"), origin


def test_the_servers_own_page_at_an_address_but_never_at_a_rebound_name() -> None:
    lan = AccessPolicy(bound_host="0.0.0.0")
    assert lan.origin_allowed("http://192.168.1.5:8000", "192.168.1.5:8000")
    assert not lan.origin_allowed("http://192.168.1.5:8000", "192.168.1.6:8000")
    # DNS rebinding: the page's origin and the Host header agree, on a name.
    assert not lan.origin_allowed("http://evil.example:8000", "evil.example:8000")
    named = AccessPolicy(bound_host="0.0.0.0", allowed_hosts=("box.lan",))
    assert named.origin_allowed("http://box.lan:8000", "box.lan:8000")


def test_cors_origins_list_and_any() -> None:
    listed = AccessPolicy(cors_origins=("https://chat.example", "HTTPS://UI.example:8443/"))
    assert listed.origin_allowed("https://chat.example", "127.0.0.1:8000")
    assert listed.origin_allowed("https://ui.example:8443", "127.0.0.1:8000")
    assert not listed.origin_allowed("http://chat.example", "127.0.0.1:8000")  # scheme
    assert AccessPolicy(cors_origins=("*",)).origin_allowed("null", None)


@given(st.text(max_size=60), st.one_of(st.none(), st.text(max_size=60)))
def test_no_header_value_breaks_the_rules(origin: str, host: str | None) -> None:
    """Whatever a client sends in Host and Origin, the rules answer (never raise)."""
    assert isinstance(LOOPBACK.host_allowed(host), bool)
    assert isinstance(LOOPBACK.origin_allowed(origin, host), bool)


def test_preflight_echoes_the_origin_and_what_it_asks_for() -> None:
    headers = LOOPBACK.preflight_headers("http://localhost:3000", "authorization,content-type",
                                         private_network=True)
    assert headers["Access-Control-Allow-Origin"] == "http://localhost:3000"
    assert headers["Access-Control-Allow-Headers"] == "authorization,content-type"
    assert "POST" in headers["Access-Control-Allow-Methods"]
    assert headers["Access-Control-Allow-Private-Network"] == "true"
    assert "Origin" in headers["Vary"]


def test_api_keys_from_a_flag_and_a_file(tmp_path: Path) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text("# team keys\nalpha\n\n  beta  \n")
    keys = ApiKeys(["flag-key"], key_file=str(key_file))
    assert keys.required and len(keys) == 3
    assert all(keys.accepts(key) for key in ("alpha", "beta", "flag-key"))
    assert not any(keys.accepts(key) for key in ("", "# team keys", "alph", "alpha "))
    key_file.write_text("gamma\n")
    keys.reload()
    assert keys.accepts("gamma") and keys.accepts("flag-key") and not keys.accepts("alpha")


def test_a_key_file_that_cannot_be_reread_keeps_the_keys(tmp_path: Path) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text("alpha\n")
    keys = ApiKeys(key_file=str(key_file))
    key_file.unlink()
    keys.reload()
    assert keys.accepts("alpha")


def test_an_emptied_key_file_locks_rather_than_opens(tmp_path: Path) -> None:
    key_file = tmp_path / "keys"
    key_file.write_text("alpha\n")
    keys = ApiKeys(key_file=str(key_file))
    key_file.write_text("")
    keys.reload()
    assert keys.required and not keys.accepts("") and not keys.accepts("alpha")


def test_no_keys_means_none_required() -> None:
    assert not ApiKeys().required
    assert not ApiKeys([""]).required


# ---------------------------------------------------------------- the model catalog

@pytest.fixture
def layout(tmp_path: Path, tiny_gguf: Path) -> dict[str, Path]:
    models = tmp_path / "models"
    models.mkdir()
    boot_dir = tmp_path / "boot"
    boot_dir.mkdir()
    (models / "qwen3-0.6b-q4_k_m.gguf").symlink_to(tiny_gguf)
    (models / "notes.gguf").write_text("not a model")
    mlx = models / "mlx-model"
    mlx.mkdir()
    (mlx / "config.json").write_text("{}")
    boot = write_tiny_qwen3_gguf(boot_dir / "boot.gguf")
    (boot_dir / "sibling.gguf").symlink_to(tiny_gguf)
    outside = write_tiny_qwen3_gguf(tmp_path / "elsewhere.gguf")  # a model, not listed
    return {"models": models, "boot": boot, "boot_dir": boot_dir, "outside": outside}


def catalog(layout: dict[str, Path], **kwargs: bool) -> ModelCatalog:
    return ModelCatalog(boot_id="boot-model", boot_path=layout["boot"],
                        models_dir=str(layout["models"]), **kwargs)


def test_the_catalog_lists_what_requests_may_name(layout: dict[str, Path],
                                                  monkeypatch: pytest.MonkeyPatch,
                                                  tmp_path: Path) -> None:
    hub = tmp_path / "hub"
    snapshot = hub / "models--org--tiny" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (snapshot / "tiny.gguf").symlink_to(layout["boot"])
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    ids = [entry.id for entry in catalog(layout).entries()]
    assert ids[0] == "boot-model"
    assert {"qwen3-0.6b-q4_k_m", "mlx-model", "sibling", "org/tiny"} <= set(ids)
    assert "notes" not in ids  # no GGUF magic: not a model
    assert "elsewhere" not in ids and "boot" not in ids  # (the boot model is `boot-model`)


def test_the_catalog_resolves_ids_prefixes_and_listed_paths(layout: dict[str, Path]) -> None:
    models = catalog(layout)
    assert models.resolve("boot-model") == layout["boot"]
    assert models.resolve("qwen3-0.6b") == layout["models"] / "qwen3-0.6b-q4_k_m.gguf"
    assert models.resolve("sibling") == layout["boot_dir"] / "sibling.gguf"
    assert models.resolve(str(layout["boot"])) == layout["boot"]
    assert models.resolve(str(layout["models"] / "mlx-model")) == layout["models"] / "mlx-model"


def test_anything_else_gets_one_answer_that_names_no_file(layout: dict[str, Path]) -> None:
    models = catalog(layout)
    answers = set()
    for model_id in ("/etc/passwd", "/no/such/file.gguf", str(layout["outside"]), "notes",
                     "../boot/../elsewhere.gguf", "~/.bashrc", "/proc/self/environ"):
        with pytest.raises(ModelNotAllowed) as refused:
            models.resolve(model_id)
        answers.add(str(refused.value).replace(repr(model_id), "ID"))
    assert len(answers) == 1, answers


def test_allow_paths_opens_the_whole_disk(layout: dict[str, Path]) -> None:
    models = catalog(layout, allow_paths=True)
    assert models.resolve(str(layout["outside"])) == layout["outside"]
    with pytest.raises(ModelNotAllowed):
        models.resolve("/no/such/file.gguf")
