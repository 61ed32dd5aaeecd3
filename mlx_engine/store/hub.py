"""Pulling ``hf:org/repo[/file.gguf][@revision]`` from the Hugging Face hub with ``huggingface_hub``.

A repository's safetensors, configuration and tokenizer files (or one named GGUF file) are downloaded into the
model's store folder; the manifest is written last by the same rules as a catalog pull.
"""

from __future__ import annotations

import contextlib
import errno
import fnmatch
import json
import re
from dataclasses import dataclass
from pathlib import Path

from mlx_engine.errors import InvalidRequestError, ModelNotFoundError, PullError
from mlx_engine.store import space
from mlx_engine.store.integrity import sha256_file
from mlx_engine.store.manifest import MANIFEST, VERIFIED, check_name

_REPO_PART = re.compile(r"[\w.\-]{1,96}", re.ASCII)

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
        InvalidRequestError: a control character (a NUL byte...), a backslash, an absolute path, or a ``.`` or
            ``..`` piece anywhere in it, or an org or repository name that is not letters, digits, ``-``, ``_`` and
            ``.`` (the hub's own rule): refused before anything touches the disk or the network.
        ModelNotFoundError: not of that form, or a file that is not a ``.gguf``.
    """
    check_name(model)
    spec = model[len("hf:"):]
    revision = None
    if "@" in spec:
        spec, revision = spec.split("@", 1)
    if spec.startswith("/") or "\\" in model:
        raise InvalidRequestError(f"{model!r} is not a Hugging Face model name: no absolute paths or backslashes; "
                                  "write hf:org/repo or hf:org/repo/file.gguf")
    pieces = spec.strip("/").split("/")
    if any(p in (".", "..") for p in pieces + (revision or "").split("/")):
        raise InvalidRequestError(f"{model!r} is not a Hugging Face model name: '.' and '..' are not allowed in it; "
                                  "write hf:org/repo or hf:org/repo/file.gguf")
    if len(pieces) < 2 or not all(pieces):
        raise ModelNotFoundError(f"{model!r} is not a Hugging Face model: write hf:org/repo or hf:org/repo/file.gguf")
    if not all(_REPO_PART.fullmatch(p) for p in pieces[:2]):
        raise InvalidRequestError(f"{model!r} is not a Hugging Face model name: the org and the repository are 1 to "
                                  "96 letters, digits, '-', '_' or '.'")
    filename = "/".join(pieces[2:]) or None
    if filename is not None and not filename.endswith(".gguf"):
        raise ModelNotFoundError(f"{model!r}: a file in a Hugging Face repository must be a .gguf file")
    return HubRef("/".join(pieces[:2]), filename, revision)


def download(ref: HubRef, folder: Path) -> tuple[str | None, list[dict], str | None]:
    """Download ``ref`` into ``folder``, after checking that its files fit on the disk. Returns ``(model_file,
    files, architecture)``: the GGUF's path relative to the folder (None for a safetensors repository), the
    manifest's file records (name, size, sha256 of the bytes downloaded), and the config's ``model_type``.

    Raises:
        PullError: the download failed (network, authentication, no such repository), or a repository without a
            GGUF name has no ``config.json``.
        StoreError: the files do not fit on the disk, or it filled up during the download.
    """
    try:
        import huggingface_hub
    except ImportError as e:  # pragma: no cover - a dependency
        raise PullError("huggingface_hub is needed for hf: models: pip install huggingface_hub") from e
    with _hub_errors(ref):
        need = download_size(ref)
    space.require(folder, need, f"pulling {ref.origin}")
    with space.reported(folder, need, f"pulling {ref.origin}"), _hub_errors(ref):
        if ref.filename is not None:
            local = huggingface_hub.hf_hub_download(ref.repo_id, ref.filename, revision=ref.revision,
                                                    local_dir=str(folder))
            model_file = Path(local).relative_to(folder).as_posix()
        else:
            huggingface_hub.snapshot_download(ref.repo_id, revision=ref.revision, local_dir=str(folder),
                                              allow_patterns=ALLOW_PATTERNS)
            model_file = None
    files = []
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder)
        if p.is_file() and not rel.parts[0].startswith(".") and rel.as_posix() not in (MANIFEST, VERIFIED):
            files.append({"name": rel.as_posix(), "size": p.stat().st_size, "sha256": sha256_file(p)})
    if model_file is None and not (folder / "config.json").is_file():
        raise PullError(f"{ref.repo_id!r} on Hugging Face has no config.json; for a GGUF repository name the "
                        f"file: hf:{ref.repo_id}/<file>.gguf")
    architecture = None
    if model_file is None:
        with contextlib.suppress(OSError, ValueError):
            architecture = json.loads((folder / "config.json").read_text()).get("model_type")
    return model_file, files, architecture


def download_size(ref: HubRef) -> int:
    """Bytes that downloading ``ref`` brings: the GGUF file's size, or the sum over the repository's files that
    :data:`ALLOW_PATTERNS` select (the hub's file metadata). Raises what ``huggingface_hub`` raises."""
    import huggingface_hub

    if ref.filename is not None:
        url = huggingface_hub.hf_hub_url(ref.repo_id, ref.filename, revision=ref.revision)
        return huggingface_hub.get_hf_file_metadata(url).size or 0
    info = huggingface_hub.HfApi().model_info(ref.repo_id, revision=ref.revision, files_metadata=True)
    return sum(s.size or 0 for s in info.siblings or []
               if any(fnmatch.fnmatch(s.rfilename, p) for p in ALLOW_PATTERNS))


@contextlib.contextmanager
def _hub_errors(ref: HubRef):
    """What ``huggingface_hub`` raises, as a PullError that says what to check; a full disk passes through."""
    try:
        yield
    except Exception as e:  # network, auth, missing repo: all end the same way for the user
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            raise
        raise PullError(f"could not download {ref.repo_id!r} from Hugging Face: {type(e).__name__}: {e}. "
                        f"Check the name and your network (or HF_TOKEN for gated models).") from e
