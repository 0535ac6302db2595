"""The native boundary with llama.cpp's ggml (butter/native/ggml_abi.h, ggml_mirror.h,
ggml_mirror_check.cpp; butter/backends/llama_cpp/layer_matmul.py).

C and Python read one list of numbers; the mirror of ggml's structures is checked against
ggml's own headers at build where they are given; and on a llama.cpp other than the one the
mirror was copied from butter touches nothing inside it: no buffer type registered, none
taken out, and a real server on a real model serves what llama.cpp alone computes, saying
why in its log and in /v1/server.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from types import ModuleType

import httpx
import llama_cpp
import pytest

import butter.backends.llama_cpp.loading as llama_loading
from butter.backends.kernels import TYPE_BITS, Isa, isa_number
from butter.backends.llama_cpp import ggml_abi, ggml_boundary, layer_matmul
from butter.backends.llama_cpp.layer_matmul import LayerMatmul
from butter.backends.native import Unavailable
from tests.conftest import ServerProcess

ROOT = Path(__file__).resolve().parent.parent
NATIVE = ROOT / "butter/native"
OTHER_COMMIT = "f" * 40  # a llama.cpp the mirror was not copied from


def _kernel_or_skip() -> LayerMatmul:
    llama_loading.init_llama_backend()
    try:
        return layer_matmul.registered()
    except Unavailable as exc:
        pytest.skip(f"butter's layer matmuls do not apply here: {exc}")


def _generator() -> ModuleType:
    """.ci/ggml-abi, the script that writes ggml_abi.py from the header."""
    loader = importlib.machinery.SourceFileLoader("ggml_abi_generator", str(ROOT / ".ci/ggml-abi"))
    spec = importlib.util.spec_from_loader(loader.name, loader)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


# ------------------------------------------------------------ one list for C and Python


def test_the_python_module_is_what_the_header_gives() -> None:
    generator = _generator()
    header = (NATIVE / "ggml_abi.h").read_text()
    assert (ROOT / "butter/backends/llama_cpp/ggml_abi.py").read_text() == generator.module(header)
    names = [name for name, _, _ in generator.constants(header)]
    assert len(names) == len(set(names)) == len(re.findall(r"^#define BUTTER_(?!GGML_ABI_H)",
                                                           header, re.MULTILINE))


def test_a_define_the_generator_cannot_read_is_refused() -> None:
    header = "#define BUTTER_GGML_ABI_H\n#define BUTTER_SHIFTED (1 << 3)\n"
    with pytest.raises(SystemExit, match="cannot read"):
        _generator().constants(header)


def test_the_built_library_reports_the_headers_numbers() -> None:
    lib = layer_matmul._library()  # (refused unless its ABI version is the header's)
    assert lib.butter_layer_matmul_ggml_commit().decode() == ggml_abi.GGML_COMMIT
    figures = ggml_boundary.mirror_figures(lib)
    assert len(figures) == ggml_abi.MIRRORED
    assert figures[ggml_abi.MIRROR_TYPE_Q8_0] == 8 and figures[ggml_abi.MIRROR_OP_MUL_MAT] == 29


def test_the_other_python_copies_agree_with_the_header() -> None:
    assert TYPE_BITS == {"q8_0": ggml_abi.TYPE_BIT_Q8_0, "q6_K": ggml_abi.TYPE_BIT_Q6_K,
                         "q5_K": ggml_abi.TYPE_BIT_Q5_K, "q4_1": ggml_abi.TYPE_BIT_Q4_1,
                         "q5_0": ggml_abi.TYPE_BIT_Q5_0, "q4_K": ggml_abi.TYPE_BIT_Q4_K}
    assert [isa_number(isa) for isa in (Isa.NONE, Isa.AVX2, Isa.AVX512_VNNI)] == [
        ggml_abi.ISA_NONE, ggml_abi.ISA_AVX2, ggml_abi.ISA_AVX512_VNNI]
    pins = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert f"llama-cpp-python=={ggml_abi.LLAMA_CPP_PYTHON_VERSION}" in pins


def test_the_loaded_ggml_is_the_one_the_mirror_was_copied_from() -> None:
    llama_loading.init_llama_backend()
    base, _ = ggml_boundary.ggml_libraries()
    commit, version = ggml_boundary.ggml_build(base)
    assert version == ggml_abi.GGML_VERSION
    assert ggml_boundary.ggml_differs(commit, version, llama_cpp.__version__) == ""


@pytest.mark.parametrize(("commit", "version", "package", "same"), [
    ("0c1e570", "0.25.3", "0.3.36", True),
    ("0c1e570-dirty", "0.25.3", "0.3.36", True),  # a build from the sdist
    ("0c1e57098bba43ac29e6e3b677cdceebdd22334f", "0.25.3", "0.3.36", True),
    ("unknown", "0.25.3", "0.3.36", True),  # built outside git: the release vouches
    ("unknown", "0.25.3", "0.3.37", False),
    ("0c1e570", "0.25.3", "0.3.37", True),  # another release vendoring the same llama.cpp
    ("1652066-dirty", "0.25.3", "0.3.36", False),  # another commit
    ("0c1e", "0.25.3", "0.3.36", False),  # too short to name one
    ("0c1e570", "0.26.0", "0.3.36", False),
    ("", "", "0.3.36", False),  # a ggml without ggml_commit()
])
def test_a_ggml_is_the_mirrors_only_at_its_commit_and_version(
    commit: str, version: str, package: str, same: bool,
) -> None:
    why = ggml_boundary.ggml_differs(commit, version, package)
    if same:
        assert why == ""
    else:
        found = f"ggml {version or '(no version)'} at commit {commit or '(none)'}"
        assert why == (f"not the llama.cpp butter's kernels mirror: {found} in llama-cpp-python "
                       f"{package} (they mirror ggml 0.25.3 at 0c1e570, llama-cpp-python 0.3.36)")


# ------------------------------------------------------------ the mirror against ggml's headers


def _ggml_source_or_skip() -> Path:
    source = os.environ.get("BUTTER_GGML_SOURCE")
    if not source or shutil.which("g++") is None:
        pytest.skip("ggml's headers (BUTTER_GGML_SOURCE) or g++ are not here")
    return Path(source)


def _compiles_against_ggml(mirror: str, folder: Path) -> subprocess.CompletedProcess[str]:
    """ggml_mirror_check.cpp compiled (syntax only) with this mirror and ggml's headers."""
    source = _ggml_source_or_skip()
    for name in ("ggml_mirror_check.cpp", "layer_matmul.h", "ggml_abi.h", "q8_0_tiles.h",
                 "q6_k_tiles.h", "q4_k_q5_k_tiles.h", "q4_1_q5_0_tiles.h"):
        shutil.copy(NATIVE / name, folder / name)
    (folder / "ggml_mirror.h").write_text(mirror)
    headers = [flag for sub in ("include", "src", "src/ggml-cpu")
               for flag in ("-isystem", str(source / sub))]
    return subprocess.run(["g++", "-std=c++17", "-fsyntax-only", "-DBUTTER_HAVE_GGML_HEADERS",
                           *headers, str(folder / "ggml_mirror_check.cpp")],
                          capture_output=True, text=True, timeout=120)


def test_the_mirror_compiles_against_ggml_and_a_moved_field_does_not(tmp_path: Path) -> None:
    mirror = (NATIVE / "ggml_mirror.h").read_text()
    assert _compiles_against_ggml(mirror, tmp_path).returncode == 0
    moved = mirror.replace("    size_t view_offs;\n    void *data;\n",
                           "    void *data;\n    size_t view_offs;\n")
    assert moved != mirror
    run = _compiles_against_ggml(moved, tmp_path)
    assert run.returncode != 0
    assert "ggml_tensor.data is not where the mirror has it" in run.stderr


def test_a_library_built_against_ggmls_headers_finds_the_vtable_slots_agree() -> None:
    lib = layer_matmul._library()
    found = lib.butter_layer_matmul_header_check()
    if found == ggml_abi.HEADERS_ABSENT:
        pytest.skip("the library was built without ggml's headers (BUTTER_GGML_SOURCE)")
    assert found == ggml_abi.HEADERS_AGREE


# ------------------------------------------------------------ what registration touches

_REGISTER = """
import json, logging, sys
from butter.backends.llama_cpp import ggml_abi, ggml_boundary, layer_matmul, loading
from butter.backends.native import Unavailable
logging.basicConfig(level=logging.WARNING, format="LOG %(message)s")
if sys.argv[1] != "same":
    ggml_abi.GGML_COMMIT = sys.argv[1]  # the commit butter expects: another one
# A type that is listed on every CPU stands in for AMX: taken out, it would be seen.
layer_matmul.CRASHING_BUFFER_TYPES = (b"CPU_REPACK",)
loading.init_llama_backend()
try:
    layer_matmul.registered()
    why = ""
except Unavailable as exc:
    why = str(exc)
listed = ggml_boundary.listed_buffer_type_names()
found = {"why": why, "dropped": layer_matmul.dropped_buffer_types,
         "tiles": "BUTTER_TILES" in listed, "repack": "CPU_REPACK" in listed}
if len(sys.argv) > 2:  # and a model loaded with weight repacking asked for
    from pathlib import Path
    from butter.backends.llama_cpp import LlamaCppBackend
    backend = LlamaCppBackend(Path(sys.argv[2]), n_cells=256, n_seq=1, n_batch=64, threads=2,
                              repack=True)
    found["weight_repacking"] = backend.diagnostics()["weight_repacking"]
    backend.close()
print(json.dumps(found))
"""


def _register_in_a_fresh_process(commit: str, *model: str, **env: str,
                                 ) -> tuple[dict[str, object], str]:
    """Registration is once per process: in a fresh one, why butter's kernels did not
    register, what was taken out, whether butter's and the stand-in's types are listed (and
    whether a model's load then repacked weights); and its log."""
    run = subprocess.run([sys.executable, "-c", _REGISTER, commit, *model], capture_output=True,
                         text=True, timeout=300, cwd=ROOT, env={**os.environ, **env})
    assert run.returncode == 0, run.stderr[-4000:]
    return json.loads(run.stdout.strip().splitlines()[-1]), run.stderr


def test_on_the_pinned_ggml_the_kernels_register_and_the_crashing_type_goes() -> None:
    """The other tests' control: the stand-in for AMX is seen taken out."""
    _kernel_or_skip()
    found, _ = _register_in_a_fresh_process("same")
    assert found == {"why": "", "dropped": ["CPU_REPACK"], "tiles": True, "repack": False}


def test_on_another_ggml_nothing_is_registered_or_taken_out_and_the_log_says_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _kernel_or_skip()
    found, log = _register_in_a_fresh_process(OTHER_COMMIT)
    monkeypatch.setattr(ggml_abi, "GGML_COMMIT", OTHER_COMMIT)
    running = ggml_boundary.ggml_build(ggml_boundary.ggml_libraries()[0])
    assert found["why"] == ggml_boundary.ggml_differs(*running, llama_cpp.__version__) != ""
    assert found["dropped"] == [] and found["repack"] and not found["tiles"]
    assert re.search(r"^LOG butter's layer kernels and attention are off, llama\.cpp computes "
                     r"them: not the llama\.cpp butter's kernels mirror", log, re.MULTILINE)


def test_with_the_kernels_off_as_asked_the_list_is_left_alone_and_repacking_goes_off(
    tiny_gguf: Path,
) -> None:
    """BUTTER_KERNEL_ISA=none on the pinned ggml: no surgery either, and the crashing type,
    still listed, turns llama.cpp's weight repacking off at load (loading.py): slower, never
    a crash (layer_matmul.CRASHING_BUFFER_TYPES says why)."""
    _kernel_or_skip()
    found, log = _register_in_a_fresh_process("same", str(tiny_gguf), BUTTER_KERNEL_ISA="none")
    assert found == {"why": "BUTTER_KERNEL_ISA=none: butter's kernels are off, as asked",
                     "dropped": [], "tiles": False, "repack": True, "weight_repacking": False}
    assert "CPU_REPACK buffer type crashes at this llama.cpp version" in log


def test_the_escape_hatch_lets_the_structure_checks_decide_on_another_ggml() -> None:
    _kernel_or_skip()
    found, log = _register_in_a_fresh_process(OTHER_COMMIT, BUTTER_GGML_COMMIT_OK="1")
    assert found == {"why": "", "dropped": ["CPU_REPACK"], "tiles": True, "repack": False}
    assert "BUTTER_GGML_COMMIT_OK=1: butter's structure checks and self-checks decide" in log


_UNCHECKED = """
import ctypes, json
from butter.backends.llama_cpp import ggml_boundary, layer_matmul, loading
layer_matmul.register = lambda: None  # no check runs
loading.init_llama_backend()
lib = layer_matmul._library()
device = ggml_boundary.cpu_device(*ggml_boundary.ggml_libraries())
print(json.dumps({"drop": lib.butter_layer_matmul_drop_buffer_type(b"CPU_REPACK"),
                  "register": lib.butter_layer_matmul_register(device, 1, 1),
                  "listed": ggml_boundary.listed_buffer_type_names()}))
"""


def test_the_library_changes_nothing_inside_llama_cpp_before_its_mirror_check() -> None:
    """The C side's own guard: a library no check has passed refuses both changes to
    llama.cpp's list of buffer types."""
    run = subprocess.run([sys.executable, "-c", _UNCHECKED], capture_output=True, text=True,
                         timeout=300, cwd=ROOT, check=True)
    found = json.loads(run.stdout.strip().splitlines()[-1])
    assert found["drop"] == found["register"] == ggml_abi.E_STATE
    assert "CPU_REPACK" in found["listed"] and "BUTTER_TILES" not in found["listed"]


# ------------------------------------------------------------ a real server on another ggml

# Imported by Python at start-up from PYTHONPATH: the server then expects another ggml commit.
_OTHER_LLAMA_CPP = f"""
import butter.backends.llama_cpp.ggml_abi as ggml_abi
ggml_abi.GGML_COMMIT = {OTHER_COMMIT!r}
"""


def _greedy_text(server: ServerProcess) -> tuple[str, str]:
    """A greedy completion and a greedy chat reply, 12 tokens each."""
    completion = httpx.post(f"{server.api}/completions", timeout=60, json={
        "model": "tiny", "prompt": "The capital of France is", "max_tokens": 12,
        "temperature": 0})
    chat = httpx.post(f"{server.api}/chat/completions", timeout=60, json={
        "model": "tiny", "messages": [{"role": "user", "content": "Name a boat."}],
        "max_tokens": 12, "temperature": 0})
    assert completion.status_code == chat.status_code == 200, (completion.text, chat.text)
    assert completion.json()["usage"]["completion_tokens"] > 0
    return (completion.json()["choices"][0]["text"],
            chat.json()["choices"][0]["message"]["content"])


def test_a_server_on_another_llama_cpp_serves_llama_cpps_results_and_says_why(
    tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The same requests get the same greedy text as from a server with butter's kernels
    turned off (BUTTER_KERNEL_ISA=none): llama.cpp's own kernels and attention. Both leave
    the logits to llama.cpp too, so that the two compute alike bit for bit."""
    _kernel_or_skip()  # (where they apply, their absence is the commit's doing)
    (tmp_path / "sitecustomize.py").write_text(_OTHER_LLAMA_CPP)
    args = ["--model", str(tiny_gguf), "--alias", "tiny", "--no-fast-lm-head"]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])]))
    other = ServerProcess(args)
    monkeypatch.undo()
    try:
        monkeypatch.setenv("BUTTER_KERNEL_ISA", "none")
        reference = ServerProcess(args)
        try:
            assert _greedy_text(other) == _greedy_text(reference)
        finally:
            reference.stop()
        meta = httpx.get(f"{other.api}/server", timeout=10).json()["model"]["meta"]
    finally:
        other.stop()
    why = "not the llama.cpp butter's kernels mirror: ggml 0.25.3 at commit "
    assert meta["layer_matmuls"].startswith(f"llama.cpp ({why}")
    assert f"(they mirror ggml 0.25.3 at {OTHER_COMMIT[:7]}," in meta["layer_matmuls"]
    assert meta["decode_attention"].startswith(f"llama.cpp (butter's kernels are off: {why}")
    assert meta["dropped_buffer_types"] == []
    assert all("butter" not in who for who in meta["kernels"]["layers"].values())
    assert any("butter's layer kernels and attention are off" in line for line in other.output)
