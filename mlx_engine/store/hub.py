"""Pulling ``hf:org/repo[/file.gguf][@revision]`` from the Hugging Face hub with ``huggingface_hub``.

A repository's safetensors, configuration and tokenizer files (or one named GGUF file) are downloaded into the
model's store folder; the manifest is written last by the same rules as a catalog pull.
"""

from __future__ import annotations

import contextlib
import json
from dataclasses import dataclass
from pathlib import Path

from mlx_engine.errors import ModelNotFoundError, PullError
from mlx_engine.store.manifest import MANIFEST

#: what a snapshot of a Hugging Face model repository brings (weights, configs, tokenizers, templates)
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]


@dataclass(frozen=True)
class HubRef:
    """A parsed ``hf:`` name: ``repo_id`` (``org/repo``), ``filename`` (a ``.gguf`` path in it, or None for the
    whole repository) and ``revision`` (None: the default branch)."""

    repo_id: str
    filename: str | None
    revision: str | None

    @property
    def origin(self) -> str:
        return f"hf:{self.repo_id}" + (f"@{self.revision}" if self.revision else "")


def parse_hf_name(model: str) -> HubRef:
    """Parse ``hf:org/repo[/file.gguf][@revision]``.

    Raises:
        ModelNotFoundError: not of that form, or a file that is not a ``.gguf``.
    """
    spec = model[len("hf:"):]
    revision = None
    if "@" in spec:
        spec, revision = spec.split("@", 1)
    pieces = spec.strip("/").split("/")
    if len(pieces) < 2 or not all(pieces):
        raise ModelNotFoundError(f"{model!r} is not a Hugging Face model: write hf:org/repo or hf:org/repo/file.gguf")
    filename = "/".join(pieces[2:]) or None
    if filename is not None and not filename.endswith(".gguf"):
        raise ModelNotFoundError(f"{model!r}: a file in a Hugging Face repository must be a .gguf file")
    return HubRef("/".join(pieces[:2]), filename, revision)


def download(ref: HubRef, folder: Path) -> tuple[str | None, list[dict], str | None]:
    """Download ``ref`` into ``folder``. Returns ``(model_file, files, architecture)``: the GGUF's path relative to
    the folder (None for a safetensors repository), the manifest's file records, and the config's ``model_type``.

    Raises:
        PullError: the download failed (network, authentication, no such repository), or a repository without a
            GGUF name has no ``config.json``.
    """
    try:
        import huggingface_hub
    except ImportError as e:  # pragma: no cover - a dependency
        raise PullError("huggingface_hub is needed for hf: models: pip install huggingface_hub") from e
    try:
        if ref.filename is not None:
            local = huggingface_hub.hf_hub_download(ref.repo_id, ref.filename, revision=ref.revision,
                                                    local_dir=str(folder))
            model_file = Path(local).relative_to(folder).as_posix()
        else:
            huggingface_hub.snapshot_download(ref.repo_id, revision=ref.revision, local_dir=str(folder),
                                              allow_patterns=ALLOW_PATTERNS)
            model_file = None
    except Exception as e:  # network, auth, missing repo: all end the same way for the user
        raise PullError(f"could not download {ref.repo_id!r} from Hugging Face: {type(e).__name__}: {e}. "
                        f"Check the name and your network (or HF_TOKEN for gated models).") from e
    files = []
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder)
        if p.is_file() and not rel.parts[0].startswith(".") and p.name != MANIFEST:
            files.append({"name": rel.as_posix(), "size": p.stat().st_size})
    if model_file is None and not (folder / "config.json").is_file():
        raise PullError(f"{ref.repo_id!r} on Hugging Face has no config.json; for a GGUF repository name the "
                        f"file: hf:{ref.repo_id}/<file>.gguf")
    architecture = None
    if model_file is None:
        with contextlib.suppress(OSError, ValueError):
            architecture = json.loads((folder / "config.json").read_text()).get("model_type")
    return model_file, files, architecture
