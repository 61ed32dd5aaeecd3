"""Token ids back to text, streamed: the bytes of each token as the tokenizer's decoder makes them
(:class:`DecodePlan`), assembled into complete UTF-8 text (:class:`Detokenizer`), or, for decoders we do not
reproduce, a window of recent tokens decoded again by ``tokenizers`` (:class:`WindowDetokenizer`)."""

from __future__ import annotations

import codecs
import json
from collections.abc import Callable
from typing import Any

from tokenizers import Tokenizer as _HFTokenizer

from mlx_engine.models.text.gguf_vocab import CHAR_TO_BYTE

__all__ = ["DecodePlan", "Detokenizer", "WindowDetokenizer", "decoder_spec"]


class DecodePlan:
    """How one token id becomes bytes, read from a ``tokenizers`` decoder's JSON. ``None`` from :meth:`parse` when the
    decoder is not one we reproduce (then ``tokenizers``' own decode is used)."""

    __slots__ = ("byte_level", "replacements", "byte_fallback", "metaspace", "metaspace_first", "strip")

    def __init__(self):
        self.byte_level = False
        self.replacements: list[tuple[str, str]] = []
        self.byte_fallback = False
        self.metaspace: str | None = None  # the replacement character
        self.metaspace_first = False  # drop the replacement characters of the first token (prepend scheme)
        self.strip: tuple[str, int] | None = None  # (content, count) stripped from the start of the whole text

    @classmethod
    def parse(cls, spec: Any) -> "DecodePlan | None":
        if not spec:
            return None
        steps = spec["decoders"] if spec.get("type") == "Sequence" else [spec]
        plan = cls()
        stage = 0  # 0: string transforms; 1: bytes made (ByteFallback/ByteLevel); 2: fused into one string
        for st in steps:
            kind = st.get("type")
            if kind == "Replace" and stage == 0 and "String" in st.get("pattern", {}):
                plan.replacements.append((st["pattern"]["String"], st["content"]))
            elif kind == "Metaspace" and stage == 0 and plan.metaspace is None:
                plan.metaspace = st.get("replacement", "\u2581")
                scheme = st.get("prepend_scheme")
                plan.metaspace_first = (scheme != "never") if scheme is not None else bool(st.get("add_prefix_space",
                                                                                                  True))
            elif kind == "ByteFallback" and stage == 0 and plan.metaspace is None:
                plan.byte_fallback = True
                stage = 1
            elif kind == "ByteLevel" and stage == 0 and not plan.replacements and plan.metaspace is None:
                plan.byte_level = True
                stage = 2  # ByteLevel returns one fused string
            elif kind == "Fuse":
                stage = 2
            elif kind == "Strip" and stage == 2 and plan.strip is None and not st.get("stop", 0):
                plan.strip = (st["content"], int(st.get("start", 0)))
            else:
                return None
        return plan

    def piece(self, token: str, first: bool) -> bytes:
        """The bytes of one token (``first``: it is the first token of the text being decoded)."""
        if self.byte_level:
            try:
                return bytes([CHAR_TO_BYTE[c] for c in token])
            except KeyError:
                return token.encode("utf-8")
        for pattern, content in self.replacements:
            token = token.replace(pattern, content)
        if self.metaspace is not None:
            token = token.replace(self.metaspace, "" if first and self.metaspace_first else " ")
        if self.byte_fallback and len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
            try:
                return bytes([int(token[3:5], 16)])
            except ValueError:
                pass
        return token.encode("utf-8")


class Detokenizer:
    """Streaming detokenizer: ``add(token_id)`` returns the text completed by that token, ``flush()`` the rest.

    Never returns part of a UTF-8 character: bytes of a character split across tokens (byte-fallback tokens,
    byte-level pieces) are held until the character is complete. ``"".join(all outputs) == tokenizer.decode(ids,
    skip_special)``. Each ``add`` costs O(length of the token) (an incremental UTF-8 decoder over the token's bytes).
    """

    def __init__(self, piece: Callable[[int, bool], bytes], plan: DecodePlan, special_ids: frozenset[int],
                 skip_special: bool = False):
        """``piece(token_id, first)``: a token's bytes (``first``: it starts the text); ``plan``: the tokenizer's
        decoder; ``special_ids``: the ids ``skip_special`` leaves out."""
        self._piece = piece
        self._skip = special_ids if skip_special else frozenset()
        self._plan = plan
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self._first = True
        self._strip = plan.strip[1] if plan.strip else 0

    def add(self, token_id: int) -> str:
        """Feed one token id; returns the newly completed text (possibly empty)."""
        token_id = int(token_id)
        if token_id in self._skip:
            return ""
        piece = self._piece(token_id, self._first)
        self._first = False
        return self._stripped(self._utf8.decode(piece))

    def flush(self) -> str:
        """The text still held (an incomplete character at the end becomes U+FFFD); the detokenizer is then reset."""
        text = self._stripped(self._utf8.decode(b"", final=True))
        self._utf8.reset()
        self._first = True
        self._strip = self._plan.strip[1] if self._plan.strip else 0
        return text

    def _stripped(self, text: str) -> str:
        if self._strip and text:
            content = self._plan.strip[0]
            while self._strip and text:
                if text[0] == content:
                    text = text[1:]
                    self._strip -= 1
                else:
                    self._strip = 0
        return text


class WindowDetokenizer:
    """Streaming detokenizer for decoders we do not reproduce byte by byte: decodes the window from the previous
    emitted boundary (Hugging Face text-generation-inference's prefix/read offsets) and holds text that ends in
    U+FFFD. At most ``_MAX_HOLD`` tokens are held, so a run of invalid bytes cannot make it quadratic."""

    _MAX_HOLD = 16

    def __init__(self, decode: Callable[..., str], skip_special: bool = False):
        """``decode(ids, skip_special_tokens=...)``: the ``tokenizers`` decode."""
        self._decode = decode
        self._skip = skip_special
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0

    def add(self, token_id: int) -> str:
        self._ids.append(int(token_id))
        prev = self._decode(self._ids[self._prefix:self._read], skip_special_tokens=self._skip)
        text = self._decode(self._ids[self._prefix:], skip_special_tokens=self._skip)
        held = len(self._ids) - self._read
        if len(text) > len(prev) and (not text.endswith("\ufffd") or held > self._MAX_HOLD):
            self._prefix, self._read = self._read, len(self._ids)
            return text[len(prev):]
        return ""

    def flush(self) -> str:
        prev = self._decode(self._ids[self._prefix:self._read], skip_special_tokens=self._skip)
        text = self._decode(self._ids[self._prefix:], skip_special_tokens=self._skip)
        self._ids, self._prefix, self._read = [], 0, 0
        return text[len(prev):]


# ---- the tokenizer -----------------------------------------------------------------------------------------------


def decoder_spec(tk: _HFTokenizer) -> Any:
    """The ``tokenizers`` decoder's JSON spec (None: no decoder)."""
    dec = tk.decoder
    if dec is None:
        return None
    return json.loads(dec.__getstate__())
