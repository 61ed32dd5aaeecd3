"""Structured output: a grammar engine masks the logits at every step, so that the text generated is in the language
the caller asked for (any JSON object, a JSON Schema, a regular expression, a Lark or GBNF grammar).

The grammar engine is llguidance (Microsoft's, also in vLLM, SGLang and llama.cpp): an Earley parser over a lexer
that computes the set of allowed tokens for the whole vocabulary per step. Chosen over xgrammar and outlines-core
for coverage and cost: its JSON Schema support is the widest of the three (``$ref`` and ``$defs``, ``anyOf`` /
``oneOf`` / ``allOf``, ``pattern``, ``format``, numeric and length bounds, ``additionalProperties``; it reports what it
does not support instead of ignoring it), it takes Lark and llama.cpp's GBNF grammars as well as regular
expressions, it needs neither torch (xgrammar's masks do) nor a precompiled index per schema (outlines-core builds
a finite automaton per schema up front), and its mask is computed per token as it is needed.

:func:`parse_response_format` turns what a caller gives (OpenAI's ``response_format``, ollama's ``format``, the
Python API's ``json_schema=`` / ``regex=`` / ``grammar=``) into a :class:`ResponseFormat`, checked by the grammar
engine (an invalid or unsupported schema is an ``InvalidRequestError`` naming the problem). A runner makes one
:class:`Constraint` per request from it; each step, :meth:`Constraint.allowed` gives the mask ``[1, V]`` and
:meth:`Constraint.advance` feeds it the sampled token.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from mlx_engine.errors import InvalidRequestError
from mlx_engine.ml import Context, Tensor

__all__ = ["ResponseFormat", "parse_response_format", "GrammarTokenizer", "Constraint"]

#: JSON Schema keys that make a bare dict a schema (ollama's ``format`` takes the schema itself)
_SCHEMA_KEYS = {"type", "properties", "$schema", "$ref", "$defs", "anyOf", "oneOf", "allOf", "enum", "const", "items",
                "required", "definitions"}
#: JSON is generated without optional whitespace: small models given the choice can indent for ever
_JSON_OPTIONS = {"whitespace_flexible": False}


def _llg():
    import llguidance

    return llguidance


@dataclass(frozen=True)
class ResponseFormat:
    """What the output must match.

    Attributes:
        kind: ``json`` (any JSON object), ``json_schema``, ``regex`` or ``grammar`` (Lark, or GBNF as llama.cpp
            writes it).
        source: the schema (a dict), the regular expression or the grammar's text; None for ``json``.
        name: the schema's name (OpenAI's ``json_schema.name``), for messages.
    """

    kind: str
    source: Any = None
    name: str | None = None

    @property
    def is_json(self) -> bool:
        return self.kind in ("json", "json_schema")

    def grammar(self) -> str:
        """The llguidance grammar (a JSON string) of this format."""
        m = _llg().LLMatcher
        if self.kind == "json":
            return m.grammar_from_json_schema({"type": "object"}, overrides=_JSON_OPTIONS)
        if self.kind == "json_schema":
            return m.grammar_from_json_schema(self.source, overrides=_JSON_OPTIONS)
        if self.kind == "regex":
            return m.grammar_from_regex(self.source)
        return _llg().grammar_from("grammar", self.source)

    def describe(self) -> str:
        return {"json": "JSON", "json_schema": f"the JSON schema{f' {self.name!r}' if self.name else ''}",
                "regex": "the regular expression", "grammar": "the grammar"}[self.kind]


def _bad(what: str, why: str) -> InvalidRequestError:
    return InvalidRequestError(f"{what}: {why}")


def parse_response_format(value: Any) -> ResponseFormat | None:
    """A :class:`ResponseFormat` from what a caller gives, checked by the grammar engine; None for plain text.

    Accepts: None, ``"text"`` or ``{"type": "text"}`` (no constraint); ``"json"`` or ``{"type": "json_object"}``
    (any JSON object); OpenAI's ``{"type": "json_schema", "json_schema": {"name": ..., "schema": {...},
    "strict": ...}}``; a JSON Schema itself (ollama's ``format``); ``{"type": "regex", "pattern": "..."}``;
    ``{"type": "grammar", "grammar": "..."}`` (Lark or GBNF); a :class:`ResponseFormat`.

    Raises:
        InvalidRequestError: an unknown form, a schema that is not a JSON object, an invalid regular expression or
            grammar, or a schema feature the grammar engine does not support (the message names it).
    """
    if value is None or isinstance(value, ResponseFormat):
        fmt = value
    elif isinstance(value, str):
        low = value.strip().lower()
        if low in ("", "text"):
            return None
        if low in ("json", "json_object"):
            fmt = ResponseFormat("json")
        else:
            try:  # a schema given as JSON text (a file's content, a CLI argument)
                return parse_response_format(json.loads(value))
            except (ValueError, RecursionError):
                raise _bad("format", f"{value[:80]!r} is neither 'json', 'text' nor a JSON schema") from None
    elif isinstance(value, dict):
        fmt = _from_dict(value)
    else:
        raise _bad("format", f"expected a string or an object, not {type(value).__name__}")
    if fmt is None:
        return None
    _check(fmt)
    return fmt


def _from_dict(d: dict) -> ResponseFormat | None:
    kind = d.get("type")
    if kind == "text" and set(d) <= {"type"}:
        return None
    if kind == "json_object":
        return ResponseFormat("json")
    if kind == "json_schema" and ("json_schema" in d or "schema" in d):
        spec = d.get("json_schema", d)
        if not isinstance(spec, dict):
            raise _bad("response_format.json_schema", "must be an object with a 'schema'")
        schema = spec.get("schema")
        if not isinstance(schema, dict):
            raise _bad("response_format.json_schema.schema", "must be a JSON Schema object")
        name = spec.get("name")
        return ResponseFormat("json_schema", schema, name if isinstance(name, str) else None)
    if kind == "regex":
        pattern = d.get("pattern", d.get("regex"))
        if not isinstance(pattern, str) or not pattern:
            raise _bad("response_format", "a regex format needs a non-empty 'pattern' string")
        return ResponseFormat("regex", pattern)
    if kind in ("grammar", "lark", "gbnf", "ebnf"):
        text = d.get("grammar", d.get(kind))
        if not isinstance(text, str) or not text.strip():
            raise _bad("response_format", "a grammar format needs a non-empty 'grammar' string (Lark or GBNF)")
        return ResponseFormat("grammar", text)
    if _SCHEMA_KEYS & set(d):
        return ResponseFormat("json_schema", d)
    raise _bad("format", f"unknown response format {json.dumps(d)[:120]}; use 'json', a JSON schema, "
                         "{'type': 'json_schema', 'json_schema': {'schema': ...}}, {'type': 'regex', 'pattern': ...} "
                         "or {'type': 'grammar', 'grammar': ...}")


def _check(fmt: ResponseFormat) -> None:
    try:
        grammar = fmt.grammar()
    except (ValueError, TypeError, RecursionError) as e:
        raise _bad(fmt.describe(), f"not valid: {e}") from None
    error = _llg().LLMatcher.validate_grammar(grammar)
    if error:
        detail = "; ".join(line.strip() for line in error.strip().splitlines() if line.strip())
        raise _bad(fmt.describe(), f"invalid, or not supported by the grammar engine: {detail[:400]}")


class GrammarTokenizer:
    """The grammar engine's view of a model's vocabulary (built once per model: it reads the whole vocabulary).

    Args:
        backend_json: the model's ``tokenizers.Tokenizer`` serialized (``to_str()``).
        vocab_size: ids the tokenizer knows; ``eos_ids``: the ids that end generation (all of them are allowed
            where the grammar may end).
    """

    def __init__(self, backend_json: str, vocab_size: int, eos_ids):
        self.vocab_size = int(vocab_size)
        self.eos_ids = sorted(int(i) for i in eos_ids)
        self.ll = _llg().LLTokenizer(backend_json, n_vocab=self.vocab_size, eos_token=self.eos_ids or None)


class Constraint:
    """One request's grammar state: the tokens allowed next, fed each sampled token.

    Args:
        tokenizer: the model's :class:`GrammarTokenizer`.
        fmt: what the output must match.
        max_tokens: the request's token limit: a grammar whose forced beginning alone is longer fails here.

    Raises:
        InvalidRequestError: the grammar cannot be compiled for this vocabulary, or it needs more than
            ``max_tokens`` tokens (a lower bound: the tokens it forces before any choice).
    """

    def __init__(self, tokenizer: GrammarTokenizer, fmt: ResponseFormat, max_tokens: int | None = None):
        llg = _llg()
        self.format = fmt
        self.tokenizer = tokenizer
        self.matcher = llg.LLMatcher(tokenizer.ll, fmt.grammar(), log_level=0)
        if self.matcher.is_error():
            raise _bad(fmt.describe(), f"cannot be used: {self.matcher.get_error()}")
        if max_tokens is not None:
            forced = self.matcher.compute_ff_tokens()
            if len(forced) > max_tokens:
                raise _bad(fmt.describe(), f"the output it allows needs at least {len(forced)} tokens but max_tokens "
                                           f"is {max_tokens}; raise max_tokens")

    @property
    def accepting(self) -> bool:
        """True when the text so far is complete (the grammar may end here)."""
        return self.matcher.is_accepting()

    @property
    def stopped(self) -> bool:
        """True when no token may follow (the grammar ended, or an end-of-sequence id was fed)."""
        return self.matcher.is_stopped()

    def allowed_numpy(self, width: int) -> np.ndarray:
        """BOOL ``[width]``: the ids allowed next (ids beyond the tokenizer's vocabulary never are)."""
        bits = np.unpackbits(np.frombuffer(self.matcher.compute_bitmask(), np.uint8), bitorder="little")
        out = np.zeros(width, bool)
        n = min(width, self.tokenizer.vocab_size, bits.size)
        out[:n] = bits[:n].astype(bool)
        return out

    def allowed(self, ctx: Context, width: int) -> Tensor:
        """BOOL ``[1, width]`` on the device: the mask :meth:`Sampler.sample` applies to the logits."""
        return ctx.from_numpy(self.allowed_numpy(width)[None])

    def advance(self, token: int) -> None:
        """Feed the sampled token.

        Raises:
            InvalidRequestError: the token is not allowed (a defect: the mask allowed it) or the grammar engine
                failed (its message).
        """
        if not self.matcher.consume_token(int(token)) or self.matcher.is_error():
            raise InvalidRequestError(f"structured output failed at token {int(token)}: "
                                      f"{self.matcher.get_error() or 'the token is not allowed'}")
