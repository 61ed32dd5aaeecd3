"""What ``list`` and ``show`` tell about a model, read from its metadata: GGUF keys, or a Hugging Face folder's
``config.json``, safetensors headers, tokenizer config and README front matter."""

from __future__ import annotations

import contextlib
import html.parser
import json
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

from mlx_engine.store.format import format_bytes, format_count, printable


@dataclass
class ModelInfo:
    """What ``list`` and ``show`` print about a model.

    Attributes:
        name, path, source: as in :class:`ResolvedModel`.
        architecture: ``llama``, ``gemma3``, ``qwen3``... (GGUF ``general.architecture`` or config ``model_type``).
        parameters: the parameter count, or None when unknown.
        quantization: ``Q4_1``, ``Q4_K_M``, ``4-bit``, ``BF16``...
        size_bytes: bytes on disk.
        context_length: the trained context length in tokens.
        license: license name or text.
        license_text: the license files' full text (``show`` only), or None when the model has none.
        chat_template: the Jinja chat template, or None for a base model.
        damaged: the pulled files whose last check against the sha256 recorded at pull failed (they refuse to
            load until the model is pulled again).
    """

    name: str
    path: Path
    source: str
    architecture: str | None = None
    parameters: int | None = None
    quantization: str | None = None
    size_bytes: int = 0
    context_length: int | None = None
    license: str | None = None
    license_text: str | None = None
    chat_template: str | None = None
    description: str | None = None
    damaged: list[str] = field(default_factory=list)
    extra: dict = field(default_factory=dict)

    def __setattr__(self, name: str, value) -> None:
        # every text here comes from a model file: no terminal escapes reach the screen through list or show
        if isinstance(value, str) and name in _TEXT_FIELDS:
            value = printable(value)
        object.__setattr__(self, name, value)

    @property
    def parameters_str(self) -> str:
        return format_count(self.parameters)

    @property
    def size_str(self) -> str:
        return format_bytes(self.size_bytes)


_TEXT_FIELDS = frozenset({"name", "architecture", "quantization", "license", "license_text", "chat_template",
                          "description"})
_LICENSE_FILE = re.compile(r"licen[cs]e|notice|terms|copying", re.I)
_MAX_LICENSE_BYTES = 1 << 20


class _HTMLText(html.parser.HTMLParser):
    """The text of an HTML page (a licence saved as a web page): only its ``<article>`` (else ``<main>``, else the
    whole page), without scripts, styles, navigation and buttons, a line break at each block element."""

    _BLOCKS = {"p", "br", "div", "li", "h1", "h2", "h3", "h4", "h5", "h6", "tr", "section", "table", "ul", "ol"}
    _SKIP = {"script", "style", "head", "nav", "header", "footer", "aside", "button", "form", "svg", "template"}

    def __init__(self, page: str) -> None:
        super().__init__()
        self.parts: list[str] = []
        self._skip = 0
        self._scope = next((t for t in ("article", "main") if f"<{t}" in page), None)
        self._inside = 0 if self._scope else 1
        self.feed(page)
        self.close()

    def handle_starttag(self, tag, attrs) -> None:
        if tag == self._scope:
            self._inside += 1
        if self._inside and (tag in self._SKIP or tag.startswith("devsite-")):  # a site's widgets, not the text
            self._skip += 1
        elif tag in self._BLOCKS:
            self.parts.append("\n")

    def handle_endtag(self, tag) -> None:
        if self._inside and (tag in self._SKIP or tag.startswith("devsite-")):
            self._skip = max(0, self._skip - 1)
        if tag == self._scope:
            self._inside = max(0, self._inside - 1)
        elif tag in self._BLOCKS:
            self.parts.append("\n")

    def handle_data(self, data) -> None:
        if self._inside and not self._skip:
            self.parts.append(re.sub(r"\s+", " ", data))

    def text(self) -> str:
        lines = (line.strip() for line in "".join(self.parts).splitlines())
        return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()


def license_text(folder: Path, names: list[str] | None = None) -> str | None:
    """The full text of the licence files in a model's folder (``LICENSE``, ``NOTICE.md``, ``GEMMA_TERMS.html``,
    ollama's ``license.txt``...), HTML as plain text, joined by blank lines; None when there are none. ``names``
    limits the search to those files (a manifest's), else every file of ``folder`` whose name says licence, notice,
    terms or copying. Files over 1 MiB are skipped."""
    if names is None:
        with contextlib.suppress(OSError):
            names = sorted(p.name for p in folder.iterdir() if p.is_file())
    texts = []
    for name in names or []:
        path = folder / name
        if not _LICENSE_FILE.search(name) or path.suffix.lower() in (".gguf", ".safetensors", ".json"):
            continue
        with contextlib.suppress(OSError):
            if not path.is_file() or path.stat().st_size > _MAX_LICENSE_BYTES:
                continue
            text = path.read_text(encoding="utf-8", errors="replace")
            if path.suffix.lower() in (".html", ".htm"):
                text = _HTMLText(text).text()
            if text.strip():
                texts.append(text.strip())
    return "\n\n".join(texts) or None


def folder_license(folder: Path) -> str | None:
    """The license named in a Hugging Face folder's README front matter, else the first line of LICENSE."""
    readme = folder / "README.md"
    with contextlib.suppress(OSError, UnicodeDecodeError):
        text = readme.read_text(encoding="utf-8")
        if text.startswith("---"):
            front = text.split("---", 2)[1]
            mo = re.search(r"^license:\s*(\S.*)$", front, re.M)
            if mo:
                return mo.group(1).strip().strip("'\"")
    for n in ("LICENSE", "LICENSE.txt", "LICENSE.md"):
        with contextlib.suppress(OSError, UnicodeDecodeError):
            first = (folder / n).read_text(encoding="utf-8").strip().splitlines()
            if first:
                return first[0].strip()
    return None


# GGUF general.file_type (llama.cpp's llama_ftype) -> name
_GGUF_FILE_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K", 11: "Q3_K_S",
    12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K",
    19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS", 23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL",
    26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S", 29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M", 32: "BF16",
    36: "TQ1_0", 37: "TQ2_0", 38: "MXFP4",
}


def fill_info(info: ModelInfo, path: Path, *, detailed: bool) -> None:
    """Fill architecture, parameters, quantization, context length and chat template from the weights' metadata
    (GGUF) or ``config.json`` (folders). Unreadable metadata leaves the fields as they are and notes why."""
    try:
        if path.is_dir():
            _fill_from_folder(info, path)
        else:
            _fill_from_gguf(info, path)
    except Exception as e:  # a broken file must not break `list`; show says why
        info.extra["metadata_error"] = f"{type(e).__name__}: {e}"


def _fill_from_gguf(info: ModelInfo, path: Path) -> None:
    from mlx_engine.weights import open_weights

    wf = open_weights(path)
    try:
        md = wf.metadata
        arch = md.get("general.architecture")
        if isinstance(arch, str):
            info.architecture = arch
        count = md.get("general.parameter_count")
        if isinstance(count, int) and not isinstance(count, bool) and count > 0:
            info.parameters = int(count)
        else:
            total = 0
            for n in wf.names():
                size = 1
                for d in wf.shape(n):
                    size *= int(d)
                total += size
            info.parameters = total or info.parameters
        ftype = md.get("general.file_type")
        if isinstance(ftype, int) and int(ftype) in _GGUF_FILE_TYPES:
            info.quantization = _GGUF_FILE_TYPES[int(ftype)]
        elif info.quantization is None:
            counts: dict[str, int] = {}
            for n in wf.names():
                size = 1
                for d in wf.shape(n):
                    size *= int(d)
                counts[wf.type_name(n)] = counts.get(wf.type_name(n), 0) + size
            if counts:
                info.quantization = max(counts, key=counts.get)
        if info.architecture:
            ctx = md.get(f"{info.architecture}.context_length")
            if isinstance(ctx, int):
                info.context_length = int(ctx)
        tmpl = md.get("tokenizer.chat_template")
        info.chat_template = tmpl if isinstance(tmpl, str) and tmpl.strip() else None
        lic = md.get("general.license")
        if info.license is None and isinstance(lic, str):
            info.license = lic
    finally:
        wf.close()


def _fill_from_folder(info: ModelInfo, folder: Path) -> None:
    cfg = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    text_cfg = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}
    info.architecture = cfg.get("model_type") or text_cfg.get("model_type") or info.architecture
    ctx = cfg.get("max_position_embeddings") or text_cfg.get("max_position_embeddings")
    info.context_length = int(ctx) if isinstance(ctx, int) else info.context_length
    quant = cfg.get("quantization") or cfg.get("quantization_config")
    bits = quant.get("bits") if isinstance(quant, dict) else None
    if bits:
        info.quantization = f"{bits}-bit"
    else:
        dtype = cfg.get("torch_dtype") or cfg.get("dtype") or text_cfg.get("torch_dtype")
        info.quantization = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}.get(str(dtype), dtype)
    # parameters from the safetensors headers (8-byte little-endian length, then JSON); packed words count
    # 32 / bits elements each, quantization scales and biases are not parameters
    total = 0
    for st in sorted(folder.glob("*.safetensors")):
        with open(st, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        for name, t in header.items():
            if name == "__metadata__":
                continue
            if bits and (name.endswith(".scales") or name.endswith(".biases")):
                continue
            size = 1
            for d in t["shape"]:
                size *= int(d)
            if bits and t.get("dtype") == "U32":
                size = size * 32 // int(bits)
            total += size
    info.parameters = total or info.parameters
    tmpl = None
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        tmpl = jinja.read_text(encoding="utf-8")
    else:
        for n in ("tokenizer_config.json", "chat_template.json"):
            with contextlib.suppress(OSError, ValueError):
                t = json.loads((folder / n).read_text(encoding="utf-8")).get("chat_template")
                if isinstance(t, list):  # [{"name": "default", "template": ...}, ...]
                    t = next((x.get("template") for x in t if x.get("name") == "default"), None)
                if isinstance(t, str) and t.strip():
                    tmpl = t
                    break
    info.chat_template = tmpl
