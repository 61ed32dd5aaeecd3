"""The tokenizer: GGUF metadata or a Hugging Face folder -> a ``tokenizers.Tokenizer``, plus chat templates and a
streaming detokenizer.

From GGUF metadata (llama.cpp's keys, values as Python str/int/float/bool, lists or NumPy arrays), the tokenizer is
rebuilt the way transformers 5.x rebuilds it (``transformers/integrations/gguf/gguf_tokenizer_mapping.py``: its
``byte_level_tokenizer``, ``sentencepiece_tokenizer``, ``gemma_tokenizer``, ``add_gguf_special_tokens``,
``set_split_regex``, and the classes ``GPT2Tokenizer``, ``LlamaTokenizer``, ``GemmaTokenizer`` they hand to), with
our own code and three deliberate differences, each following llama.cpp (``src/llama-vocab.cpp``):

- ``tokenizer.ggml.model == "gpt2"`` (byte-level BPE): the pre-tokenizer regex follows ``tokenizer.ggml.pre`` for the
  pre-types llama.cpp gives a regex; transformers has no entry for the StarCoder family (``starcoder``, ``smollm``,
  ``refact``, ``codeshell``, ``command-r``, ``exaone``, ``minerva``), whose llama.cpp regexes first split every
  ``\\p{N}`` on its own. We add that split (``Digits(individual_digits=True)``, as SmolLM's own ``tokenizer.json``
  does). For SmolLM2 the ids are the same either way (its vocabulary holds no multi-digit token).
- Control and user-defined tokens (``token_type`` 3 and 4) are always kept whole (special and plain added tokens),
  with their spelling as stored; transformers drops a byte-level control token spelled outside the byte alphabet and
  a user-defined token whose stored spelling is not a vocabulary key.
- ``tokenizer.ggml.add_space_prefix == False`` is honoured for a SentencePiece vocabulary (no ``▁`` prepended);
  transformers ignores the key for non-Gemma models. Gemma never prepends, in both.

``decode`` and the streaming detokenizer turn each id into bytes by the tokenizer's own decoder rules (ByteLevel,
or Replace/ByteFallback/Fuse/Strip, or Metaspace), join them, and decode UTF-8 with U+FFFD for invalid bytes. On valid
text this equals ``tokenizers``' decode exactly; it differs only on invalid byte sequences inside a run of
byte-fallback tokens, where ``tokenizers`` writes one U+FFFD per byte of the whole run and we one per maximal invalid
subpart (as its ByteLevel decoder and Python do). Other decoders (WordPiece...) use ``tokenizers``' decode.
"""

from __future__ import annotations

import json
import numbers
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken
from tokenizers import Tokenizer as _HFTokenizer

from mlx_engine.errors import InvalidRequestError, UnsupportedError, WeightsError
from mlx_engine.models.text.chat_template import default_template, render_chat_template
from mlx_engine.models.text.detokenizer import DecodePlan, Detokenizer, WindowDetokenizer, decoder_spec
from mlx_engine.models.text.gguf_vocab import (BYTE_TO_CHAR, CONTROL, EOG_TOKEN_TEXTS, GEMMA_ARCHS, NORMAL,
                                          USER_DEFINED, build_byte_level, build_sentencepiece, build_unigram,
                                          build_wordpiece, bytes_to_unicode, meta)

__all__ = ["Tokenizer", "Detokenizer", "bytes_to_unicode"]

class Tokenizer:
    """Text <-> token ids for one model, its end-of-sequence ids, and its chat template.

    Build one with :meth:`from_gguf` or :meth:`from_folder`; the constructor takes an assembled
    ``tokenizers.Tokenizer`` and the facts around it.

    Attributes:
        bos_id: the beginning-of-sequence id, or None.
        eos_ids: every id that ends generation (see :meth:`from_gguf`, :meth:`from_folder`).
        add_bos: whether :meth:`encode` adds ``bos_id`` by default.
        architecture: the model architecture (``general.architecture`` or ``config.json``'s ``model_type``); picks
            the standard turn format when the model has no chat template.
    """

    def __init__(self, backend: _HFTokenizer, *, bos_id: int | None = None, eos_ids: Iterable[int] = (),
                 add_bos: bool = False, chat_template: str | None = None, architecture: str | None = None,
                 special_tokens: Mapping[str, str] | None = None, token_texts: Sequence[str] | None = None):
        self._hf = backend
        self.bos_id = bos_id
        self.eos_ids: set[int] = _without_harmony_end({int(i) for i in eos_ids}, backend.id_to_token)
        self.add_bos = bool(add_bos)
        self.architecture = architecture
        self._chat_template = chat_template or None
        self._fallback_template: str | None = None  # default_template's choice, made on first use
        self._special_re: "re.Pattern[str] | bool | None" = None  # see encode_chat
        self._plain: _HFTokenizer | None = None
        self._special_tokens = {k: v for k, v in (special_tokens or {}).items() if v}
        self._texts = token_texts
        self._vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self._special_ids = frozenset(i for i, t in backend.get_added_tokens_decoder().items() if t.special)
        self._plan = DecodePlan.parse(decoder_spec(backend))
        self._pieces: dict[tuple[int, bool], bytes] = {}

    # ---- construction ------------------------------------------------------------------------------------------
    def save_hf(self, folder: "str | Path") -> None:
        """Write ``tokenizer.json`` and ``tokenizer_config.json`` (special tokens, ``add_bos_token``, the chat
        template) so that transformers' ``AutoTokenizer`` reads the same vocabulary (used to run peers such as
        ``mlx_lm.server`` on a GGUF file's tokenizer)."""
        folder = Path(folder)
        self._hf.save(str(folder / "tokenizer.json"))
        config = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": self.add_bos,
                  "chat_template": self._chat_template, **self._special_tokens}
        (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=1))

    @classmethod
    def from_gguf(cls, metadata: Mapping[str, Any], architecture: str | None = None) -> "Tokenizer":
        """From GGUF metadata (``tokenizer.ggml.*`` keys; values as Python or NumPy values).

        ``eos_ids``: ``tokenizer.ggml.eos_token_id``, ``eot_token_id``, ``eom_token_id``, and every control token whose
        text is in llama.cpp's end-of-generation list (``<|im_end|>``, ``<|eot_id|>``, ``<end_of_turn>``,
        ``<|endoftext|>``...). ``add_bos``: ``tokenizer.ggml.add_bos_token``, else true for SentencePiece vocabularies
        and false for byte-level ones (transformers' defaults).

        Raises:
            WeightsError: the tokenizer keys are missing or inconsistent.
            UnsupportedError: a ``tokenizer.ggml.model`` other than ``gpt2``, ``llama``, ``gemma4``, ``bert`` and
                ``t5``.
        """
        try:
            return cls._from_gguf(metadata, architecture)
        except (WeightsError, UnsupportedError):
            raise
        except Exception as e:  # the tokenizers library's own errors (a merge of unknown tokens...) are the file's
            raise WeightsError(f"the GGUF tokenizer metadata is invalid: {type(e).__name__}: {e}") from e

    @classmethod
    def _from_gguf(cls, metadata: Mapping[str, Any], architecture: str | None) -> "Tokenizer":
        md = metadata
        kind = meta(md, "tokenizer.ggml.model")
        tokens = meta(md, "tokenizer.ggml.tokens")
        if kind is None or tokens is None:
            raise WeightsError("the GGUF metadata has no tokenizer (tokenizer.ggml.model / tokenizer.ggml.tokens)")
        tokens = [str(t) for t in tokens]
        types = meta(md, "tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
        if len(types) != len(tokens):
            raise WeightsError(f"tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
        arch = architecture or meta(md, "general.architecture")
        if kind == "gpt2":
            tk, vocab = build_byte_level(tokens, types, md)
            default_add_bos = False
        elif kind in ("llama", "gemma4"):
            tk, vocab = build_sentencepiece(tokens, types, md, gemma=kind == "gemma4" or str(arch) in GEMMA_ARCHS)
            default_add_bos = True
        elif kind == "bert":
            tk, vocab = build_wordpiece(tokens, types, md)
            default_add_bos = False  # its post-processor adds [CLS] and [SEP] (models/embedding/embedder.py)
        elif kind == "t5":
            tk, vocab = build_unigram(tokens, types, md)
            default_add_bos = False  # llama.cpp's UGM default (XLM-RoBERTa files say true)
        else:
            raise UnsupportedError(f"GGUF tokenizer model {kind!r} is not supported (only 'gpt2', 'llama', "
                                   "'gemma4', 'bert' and 't5')")

        control = [AddedToken(t, normalized=False, special=True) for t, ty in zip(tokens, types) if ty == CONTROL]
        user = [AddedToken(t, normalized=False, special=False) for t, ty in zip(tokens, types)
                if ty == USER_DEFINED and t in vocab]
        if control:
            tk.add_special_tokens(control)
        if user:
            tk.add_tokens(user)

        def text_of(key: str) -> str | None:
            i = meta(md, f"tokenizer.ggml.{key}")
            return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

        special = {"bos_token": text_of("bos_token_id"), "eos_token": text_of("eos_token_id"),
                   "unk_token": text_of("unknown_token_id"), "pad_token": text_of("padding_token_id")}
        if kind in ("llama", "gemma4") and str(arch) in GEMMA_ARCHS and "<mask>" in vocab:
            special["mask_token"] = "<mask>"
        # Named special tokens not yet kept whole become special added tokens (TokenizersBackend.__init__ does so).
        added = {t.content for t in tk.get_added_tokens_decoder().values()}
        missing = [AddedToken(t, normalized=False, special=True) for t in special.values() if t and t not in added]
        if missing:
            tk.add_special_tokens(missing)

        bos = meta(md, "tokenizer.ggml.bos_token_id")
        eos = {int(meta(md, f"tokenizer.ggml.{k}")) for k in ("eos_token_id", "eot_token_id", "eom_token_id")
               if meta(md, f"tokenizer.ggml.{k}") is not None}
        eos |= {i for i, (t, ty) in enumerate(zip(tokens, types)) if ty == CONTROL and t in EOG_TOKEN_TEXTS}
        add_bos = meta(md, "tokenizer.ggml.add_bos_token", default_add_bos)
        template = meta(md, "tokenizer.chat_template")
        if template is not None and not isinstance(template, str):
            raise WeightsError(f"the GGUF key tokenizer.chat_template holds a {type(template).__name__}, not text: "
                               "the file is damaged or was written by a faulty converter; convert it again")
        return cls(tk, bos_id=None if bos is None else int(bos), eos_ids=eos, add_bos=bool(add_bos),
                   chat_template=template, architecture=arch, special_tokens=special, token_texts=tokens)

    @classmethod
    def from_folder(cls, path: "str | Path", architecture: str | None = None) -> "Tokenizer":
        """From a Hugging Face folder: ``tokenizer.json``, ``tokenizer_config.json`` (special tokens,
        ``add_bos_token``, ``chat_template``), ``chat_template.jinja``, ``generation_config.json`` and ``config.json``
        (``eos_token_id`` lists, ``model_type``).

        ``eos_ids``: the ``eos_token`` of ``tokenizer_config.json``, the ``eos_token_id`` of ``generation_config.json``
        and ``config.json`` (an int or a list), and every special token whose text is in llama.cpp's
        end-of-generation list. ``add_bos``: ``add_bos_token`` when given, else whether ``tokenizer.json``'s
        post-processor puts the BOS token first.

        Raises:
            WeightsError: no ``tokenizer.json`` in the folder (the message names the folder), or an unreadable one.
        """
        folder = Path(path)
        tj = folder / "tokenizer.json"
        if not tj.is_file():
            hint = " (it has only a SentencePiece tokenizer.model, which we do not read)" \
                if (folder / "tokenizer.model").is_file() else ""
            raise WeightsError(f"{folder}: no tokenizer.json{hint}")
        try:
            tk = _HFTokenizer.from_file(str(tj))
        except Exception as e:  # tokenizers raises a plain Exception on bad JSON
            raise WeightsError(f"{tj}: cannot read the tokenizer: {e}") from e
        config = _read_json(folder / "tokenizer_config.json")
        generation = _read_json(folder / "generation_config.json")
        model_config = _read_json(folder / "config.json")

        def token_text(v: Any) -> str | None:
            if isinstance(v, Mapping):
                v = v.get("content")
            return v if isinstance(v, str) and v else None

        special = {k: token_text(config.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
        bos_id = tk.token_to_id(special["bos_token"]) if special["bos_token"] else None
        if bos_id is None and isinstance(model_config.get("bos_token_id"), int):
            bos_id = model_config["bos_token_id"]
            special["bos_token"] = tk.id_to_token(bos_id)
        eos: set[int] = set()
        if special["eos_token"] and tk.token_to_id(special["eos_token"]) is not None:
            eos.add(tk.token_to_id(special["eos_token"]))
        for src in (generation, model_config):
            v = src.get("eos_token_id")
            eos.update(int(i) for i in (v if isinstance(v, list) else [v]) if isinstance(i, int))
        for i, t in tk.get_added_tokens_decoder().items():
            if t.special and t.content in EOG_TOKEN_TEXTS:
                eos.add(i)
        if not special["eos_token"] and eos:
            special["eos_token"] = tk.id_to_token(min(eos))
        if "add_bos_token" in config and config["add_bos_token"] is not None:
            add_bos = bool(config["add_bos_token"])
        else:
            add_bos = bos_id is not None and _post_processor_adds(tk, bos_id)
        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": ..., "template": ...}]: the default one
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, Mapping)}
            template = named.get("default") or next(iter(named.values()), None)
        if not template and (folder / "chat_template.jinja").is_file():
            template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
        if not template and (folder / "chat_template.json").is_file():
            template = _read_json(folder / "chat_template.json").get("chat_template")
        arch = architecture or model_config.get("model_type")
        return cls(tk, bos_id=bos_id, eos_ids=eos, add_bos=add_bos, chat_template=template or None,
                   architecture=arch, special_tokens=special)

    # ---- text <-> ids ------------------------------------------------------------------------------------------
    def encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of ``text``. Special tokens written in the text (``<|im_start|>``, ``<start_of_turn>``...) become
        their ids.

        Args:
            add_bos: put ``bos_id`` first; None: as the model says (:attr:`add_bos`). BOS is never doubled: when the
                text already starts with the BOS token, it is not added again.

        Raises:
            InvalidRequestError: ``text`` is not a string.
        """
        if not isinstance(text, str):
            raise InvalidRequestError(f"text to tokenize must be a string, got {type(text).__name__}")
        ids = self._hf.encode(text, add_special_tokens=False).ids
        want = self.add_bos if add_bos is None else add_bos
        if want and self.bos_id is not None and not (ids and ids[0] == self.bos_id):
            ids.insert(0, self.bos_id)
        return ids

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    expand: "Callable[[str], str] | None" = None, **kwargs: Any) -> list[int]:
        """Token ids of a conversation with the chat template applied: the template's own special tokens become
        their ids, but a special token's text inside a message (``<|im_start|>system`` typed by a user) stays plain
        text, as transformers' and llama.cpp's tokenizers treat text that is not the template's. BOS is added as
        :meth:`encode` does (never doubled when the template writes it).

        How: before rendering, every special token's text in a message's content is marked with U+FFFF (a
        noncharacter; any U+FFFF already in a message is dropped); after rendering, the text is cut at the unmarked
        special tokens, and the pieces between them are encoded with special-token parsing off.

        ``expand`` rewrites the rendered text before it is encoded (an image marker to the image's placeholder
        tokens, which stay special tokens).

        Raises:
            InvalidRequestError / ChatTemplateError: as :meth:`apply_chat_template`.
        """
        pattern = self._special_pattern()
        if pattern is not None:
            messages = [_mark_specials(m, pattern) for m in messages]
        text = self.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **kwargs)
        if expand is not None:  # the template's markers (an image's) to what the model reads there
            text = expand(text)
        bos = self.bos_token
        add_bos = False if bos and text.startswith(bos) else None
        if pattern is None or _USER_MARK not in text:
            return self.encode(text, add_bos=add_bos)
        ids: list[int] = []
        start = 0
        plain = self._plain_tokenizer()
        for m in pattern.finditer(text):
            if m.start() > 0 and text[m.start() - 1] == _USER_MARK:
                continue  # a message's: stays text
            if m.start() > start:
                ids += plain.encode(text[start:m.start()].replace(_USER_MARK, ""), add_special_tokens=False).ids
            ids.append(self._hf.token_to_id(m.group(0)))
            start = m.end()
        if start < len(text):
            ids += plain.encode(text[start:].replace(_USER_MARK, ""), add_special_tokens=False).ids
        want = self.add_bos if add_bos is None else add_bos
        if want and self.bos_id is not None and not (ids and ids[0] == self.bos_id):
            ids.insert(0, self.bos_id)
        return ids

    def _special_pattern(self) -> "re.Pattern[str] | None":
        """A regex of every special token's text, longest first (leftmost-longest, as the tokenizer matches)."""
        if self._special_re is None:
            texts = sorted({t.content for t in self._hf.get_added_tokens_decoder().values() if t.special and t.content},
                           key=len, reverse=True)
            self._special_re = re.compile("|".join(map(re.escape, texts))) if texts else False
        return self._special_re or None

    def _plain_tokenizer(self) -> _HFTokenizer:
        """A copy of the tokenizer that does not parse special tokens (made once, on first use)."""
        if self._plain is None:
            plain = _HFTokenizer.from_str(self._hf.to_str())
            plain.encode_special_tokens = True
            self._plain = plain
        return self._plain

    def decode(self, ids: "Iterable[int] | int", skip_special: bool = False) -> str:
        """The text of ``ids`` (special tokens written out unless ``skip_special``). Invalid UTF-8 becomes U+FFFD."""
        if isinstance(ids, numbers.Integral):
            ids = [int(ids)]
        plan = self._plan
        if plan is None:
            return self._hf.decode([int(i) for i in ids], skip_special_tokens=skip_special)
        skip = self._special_ids if skip_special else ()
        parts = []
        first = True
        for i in ids:
            i = int(i)
            if i in skip:
                continue
            parts.append(self._piece(i, first))
            first = False
        text = b"".join(parts).decode("utf-8", "replace")
        if plan.strip and text:
            content, count = plan.strip
            n = 0
            while n < count and n < len(text) and text[n] == content:
                n += 1
            text = text[n:]
        return text

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (part of a UTF-8 character, for a byte-level token; a special token's
        text), as OpenAI's ``logprobs[].bytes`` gives them."""
        if self._plan is None:
            return self._hf.decode([int(token_id)], skip_special_tokens=False).encode("utf-8")
        return self._piece(int(token_id))

    def detokenizer(self, skip_special: bool = False) -> "Detokenizer":
        """A new streaming detokenizer (see :class:`Detokenizer`)."""
        if self._plan is None:
            return WindowDetokenizer(self._hf.decode, skip_special)  # type: ignore[return-value]
        return Detokenizer(self._piece, self._plan, self._special_ids, skip_special)

    def _piece(self, token_id: int, first: bool = False) -> bytes:
        first = first and self._plan.metaspace_first
        key = (token_id, first)
        b = self._pieces.get(key)
        if b is None:
            text = self._hf.id_to_token(token_id)
            if text is None:
                text = self._texts[token_id] if self._texts is not None and 0 <= token_id < len(self._texts) else ""
                if text and self._plan.byte_level and token_id not in self._special_ids:
                    text = "".join(BYTE_TO_CHAR[x] for x in text.encode("utf-8"))
            b = self._pieces[key] = self._plan.piece(text, first)
        return b

    # ---- vocabulary --------------------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """The number of ids (added tokens included)."""
        return self._vocab_size

    def is_special(self, token_id: int) -> bool:
        """True for a special (control) token: BOS, EOS, ``<|im_start|>``, ``<start_of_turn>``..."""
        return int(token_id) in self._special_ids

    def token_to_id(self, token: str) -> int | None:
        return self._hf.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._hf.id_to_token(int(token_id))

    @property
    def bos_token(self) -> str | None:
        """The BOS token's text, or None."""
        return self._special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        """The main EOS token's text (``tokenizer.ggml.eos_token_id`` / ``eos_token``), or None."""
        return self._special_tokens.get("eos_token")

    @property
    def special_tokens(self) -> dict[str, str]:
        """``bos_token``, ``eos_token``, ``unk_token``, ``pad_token`` (those the model has): what templates see."""
        return dict(self._special_tokens)

    @property
    def backend(self) -> _HFTokenizer:
        """The underlying ``tokenizers.Tokenizer``."""
        return self._hf

    # ---- chat --------------------------------------------------------------------------------------------------
    @property
    def chat_template(self) -> str | None:
        """The model's own chat template (Jinja2 source), or None."""
        return self._chat_template

    @property
    def has_chat_template(self) -> bool:
        """True when the model ships a chat template (an instruction-tuned model)."""
        return self._chat_template is not None

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """Render ``messages`` (``{"role": ..., "content": ...}`` dicts) with the model's template, or, for a model
        without one, with its architecture's standard turn format (Gemma's, Llama 3's, else ChatML; see
        :func:`mlx_engine.models.text.chat_template.default_template`). Extra keyword arguments (``tools``, ``documents``,
        ``enable_thinking``...) reach the template. Returns the prompt text (BOS included when the template writes it:
        encode it with ``add_bos=None``, which does not double it).

        Raises:
            InvalidRequestError: an empty conversation, or one the template rejects.
        """
        template = self._chat_template
        if template is None:  # chosen once: it reads the whole vocabulary
            if self._fallback_template is None:
                self._fallback_template = default_template(self.architecture, self._hf.get_vocab())
            template = self._fallback_template
        return render_chat_template(template, messages, add_generation_prompt=add_generation_prompt,
                                    special_tokens=self._special_tokens, **kwargs)

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, bos_id={self.bos_id}, eos_ids={sorted(self.eos_ids)}, "
                f"architecture={self.architecture!r}, chat_template={'yes' if self.has_chat_template else 'no'})")


#: Marks a special token's text that came from a message, not from the chat template (see Tokenizer.encode_chat).
_USER_MARK = "\uffff"


def _mark_specials(message: Any, pattern: "re.Pattern[str]") -> Any:
    """``message`` with U+FFFF before each special token's text in its content (and any U+FFFF already there
    dropped). Anything that is not a message dict is left for the template's own checks."""
    if not isinstance(message, Mapping):
        return message

    def mark(text: Any) -> Any:
        if not isinstance(text, str):
            return text
        return pattern.sub(lambda m: _USER_MARK + m.group(0), text.replace(_USER_MARK, ""))

    content = message.get("content")
    if isinstance(content, list):
        content = [{**p, "text": mark(p["text"])} if isinstance(p, Mapping) and "text" in p else p for p in content]
    return {**message, "content": mark(content)}


def _post_processor_adds(tk: _HFTokenizer, bos_id: int) -> bool:
    """Whether the post-processor of a ``tokenizer.json`` puts ``bos_id`` first in a single sequence."""
    pp = tk.post_processor
    if pp is None:
        return False
    spec = json.loads(pp.__getstate__())
    procs = spec.get("processors", [spec]) if spec.get("type") == "Sequence" else [spec]
    for p in procs:
        if p.get("type") == "TemplateProcessing":
            single = p.get("single") or []
            if single and "SpecialToken" in single[0]:
                name = single[0]["SpecialToken"]["id"]
                ids = p.get("special_tokens", {}).get(name, {}).get("ids") or []
                return bool(ids) and ids[0] == bos_id
            return False
        if p.get("type") in ("BertProcessing", "RobertaProcessing"):
            cls_tok = p.get("cls")
            return bool(cls_tok) and cls_tok[1] == bos_id
    return False


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise WeightsError(f"{path}: not valid JSON: {e}") from e
    return data if isinstance(data, dict) else {}


def _without_harmony_end(eos: set[int], text_of: Callable[[int], "str | None"]) -> set[int]:
    """``eos`` less ``<|end|>`` where ``<|return|>`` and ``<|call|>`` are end tokens too: harmony's ``<|end|>`` closes
    a message (the analysis before the answer or a call), not the turn (llama.cpp's workaround in
    ``llama_vocab::impl::load``, for the same vocabulary)."""
    by_text = {text_of(i): i for i in eos}
    if {"<|return|>", "<|call|>", "<|end|>"} <= by_text.keys():
        return eos - {by_text["<|end|>"]}
    return eos
