"""Token log-probabilities in each API's shape, from the scheduler's ``(token, logprob, top)`` entries
(:attr:`mlx_engine.models.generation.core.SequenceState.logprob`: natural logs of the distribution the token was drawn
from, ``top`` most likely first).

- OpenAI Chat Completions: ``choices[].logprobs.content[]`` of ``{token, logprob, bytes, top_logprobs}``;
- OpenAI legacy Completions: ``choices[].logprobs`` of ``{tokens, token_logprobs, top_logprobs, text_offset}``;
- ollama: ``logprobs[]`` of ``{token, logprob, top_logprobs}`` (the ``ollama`` client's ``Logprob``).

A token's text is its bytes decoded as UTF-8 with U+FFFD for a partial character (``bytes`` has them exact). A token
the filters removed (``-inf``) is given OpenAI's floor, -9999.0, since JSON has no infinity.
"""

from __future__ import annotations

import math
from typing import Any

Entry = tuple[int, float, list[tuple[int, float]]]
FLOOR = -9999.0


def _lp(value: float) -> float:
    return value if math.isfinite(value) else FLOOR


def _text(tokenizer: Any, token: int) -> tuple[str, bytes]:
    raw = tokenizer.token_bytes(token)
    return raw.decode("utf-8", "replace"), raw


def openai_content(tokenizer: Any, entries: list[Entry]) -> list[dict[str, Any]]:
    """Chat Completions' ``logprobs.content`` list."""
    out = []
    for token, lp, top in entries:
        text, raw = _text(tokenizer, token)
        alts = []
        for t, v in top:
            at, ab = _text(tokenizer, t)
            alts.append({"token": at, "logprob": _lp(v), "bytes": list(ab)})
        out.append({"token": text, "logprob": _lp(lp), "bytes": list(raw), "top_logprobs": alts})
    return out


def legacy(tokenizer: Any, entries: list[Entry], offset: int = 0) -> dict[str, Any]:
    """Completions' ``logprobs`` object; ``offset``: the characters of the answer before these tokens (for
    ``text_offset``)."""
    tokens, lps, tops, offsets = [], [], [], []
    for token, lp, top in entries:
        text, _ = _text(tokenizer, token)
        tokens.append(text)
        lps.append(_lp(lp))
        tops.append({_text(tokenizer, t)[0]: _lp(v) for t, v in top})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def ollama(tokenizer: Any, entries: list[Entry], top: bool) -> list[dict[str, Any]]:
    """ollama's ``logprobs`` list (``top``: with each token's ``top_logprobs``)."""
    out = []
    for token, lp, alts in entries:
        item: dict[str, Any] = {"token": _text(tokenizer, token)[0], "logprob": _lp(lp)}
        if top:
            item["top_logprobs"] = [{"token": _text(tokenizer, t)[0], "logprob": _lp(v)} for t, v in alts]
        out.append(item)
    return out
