"""Generation options in one shape, from the command line to the runner, validated in one place.

The CLI collects its flags into a dict, the Python API takes keywords, the chat's ``/set`` changes one value; all
three become a :class:`GenerationOptions` through :meth:`GenerationOptions.parse`, the only validator, and the runner's
:class:`~mlx_engine.models.generation.runner.Request` is made from it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from mlx_engine.errors import InvalidOptionError, InvalidRequestError
from mlx_engine.models.text.constraint import ResponseFormat, parse_response_format
from mlx_engine.models.vision.images import PromptImage
from mlx_engine.models.text.reasoning import parse_think
from mlx_engine.models.generation.runner import Request
from mlx_engine.models.generation.sampler import SamplerOptions
from mlx_engine.models.generation.speculative import SPECULATIVE_MODES

SAMPLER_FIELDS = tuple(f.name for f in fields(SamplerOptions))
#: every option name :meth:`GenerationOptions.parse` takes
#: structured output: ``response_format`` (or ollama's name ``format``) takes any form
#: :func:`~mlx_engine.models.text.constraint.parse_response_format` reads; ``json_schema``, ``regex`` and ``grammar`` are
#: shorthands for a schema (a dict or JSON text), a regular expression and a Lark / GBNF grammar
FORMAT_OPTIONS = ("response_format", "format", "json_schema", "regex", "grammar")
#: ``think``: a reasoning model thinks (True), answers at once (False), or thinks at a level (``low``, ``medium``,
#: ``high``); None leaves it to the chat template
#: ``speculative``: ``off``, ``lookup`` (prompt lookup drafts), ``draft`` (the draft model's drafts) or ``mtp`` (the
#: model's multi-token-prediction layer's drafts);
#: ``draft_tokens``: the most draft tokens a verification step checks
OPTION_NAMES = (*SAMPLER_FIELDS, "max_tokens", "stop", "system", "raw", *FORMAT_OPTIONS, "think", "speculative",
                "draft_tokens")
DEFAULT_MAX_TOKENS = 256
DEFAULT_DRAFT_TOKENS = 8


@dataclass(frozen=True)
class GenerationOptions:
    """What a caller sets for one generation.

    Attributes:
        sampler: how tokens are picked (:class:`~mlx_engine.models.generation.sampler.SamplerOptions`, validated).
        max_tokens: the most tokens to generate (>= 1, default 256).
        stop: stop strings; generation ends before the first one.
        system: a system prompt (for one-shot prompts), or None.
        raw: True for plain completion without the chat template; None lets the model decide (base models are raw).
        response_format: what the output must match (structured output), or None for free text.
        images: the prompt's images at their places (set by whoever made the prompt, never parsed from options).
        think: whether a reasoning model thinks: True, False, a level (``low``, ``medium``, ``high``), or None for
            the chat template's default (it reaches the template through ``Model.template_vars``).
        speculative: ``off``, ``lookup`` (prompt lookup drafts), ``draft`` (a draft model's drafts) or ``mtp`` (the
            model's multi-token-prediction layer's drafts: DeepSeek V3, GLM-4.5): speculative
            decoding (:mod:`~mlx_engine.models.generation.speculative`), the same output, faster where the drafts are right;
            None (default): ``draft`` for a model loaded with a draft model, else ``off``.
        draft_tokens: the most draft tokens one verification step checks (>= 1, default 8).
    """

    sampler: SamplerOptions = field(default_factory=SamplerOptions)
    max_tokens: int = DEFAULT_MAX_TOKENS
    stop: tuple[str, ...] = ()
    system: str | None = None
    raw: bool | None = None
    response_format: ResponseFormat | None = None
    images: tuple[PromptImage, ...] = ()
    think: bool | str | None = None
    speculative: str | None = None
    draft_tokens: int = DEFAULT_DRAFT_TOKENS

    @classmethod
    def parse(cls, options: Mapping[str, Any]) -> "GenerationOptions":
        """Options from a mapping of names (:data:`OPTION_NAMES`) to values; None means the default.

        Raises:
            InvalidRequestError: an unknown name (the message lists the valid ones). InvalidOptionError (an
                InvalidRequestError): an invalid value; it names the option, the value and the accepted range.
        """
        unknown = set(options) - set(OPTION_NAMES)
        if unknown:
            raise InvalidRequestError(f"unknown option(s) {', '.join(sorted(unknown))}; valid options: "
                                      f"{', '.join(sorted(OPTION_NAMES))}")
        given = {k: v for k, v in options.items() if v is not None}
        sampler = SamplerOptions(**{k: v for k, v in given.items() if k in SAMPLER_FIELDS}).validate()
        max_tokens = given.get("max_tokens", DEFAULT_MAX_TOKENS)
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
            raise InvalidOptionError("max_tokens", max_tokens, "must be an integer >= 1")
        stop = given.get("stop", ())
        stop = (stop,) if isinstance(stop, str) else stop
        if not isinstance(stop, Sequence) or not all(isinstance(s, str) for s in stop):
            raise InvalidOptionError("stop", options.get("stop"), "must be a string or a list of strings")
        system = given.get("system")
        if system is not None and not isinstance(system, str):
            raise InvalidOptionError("system", system, "must be a string")
        raw = given.get("raw")
        if raw is not None and not isinstance(raw, bool):
            raise InvalidOptionError("raw", raw, "must be true or false")
        speculative = given.get("speculative")
        if speculative is not None and speculative not in SPECULATIVE_MODES:
            raise InvalidOptionError("speculative", speculative, f"must be one of {', '.join(SPECULATIVE_MODES)}")
        draft_tokens = given.get("draft_tokens", DEFAULT_DRAFT_TOKENS)
        if isinstance(draft_tokens, bool) or not isinstance(draft_tokens, int) or not 1 <= draft_tokens <= 64:
            raise InvalidOptionError("draft_tokens", draft_tokens, "must be an integer from 1 to 64")
        return cls(sampler, max_tokens, tuple(stop), system, raw, _response_format(given),
                   think=parse_think(given.get("think")), speculative=speculative, draft_tokens=draft_tokens)

    def request(self, tokens: Sequence[int], sequence: int = 0, images: Sequence[PromptImage] = ()) -> Request:
        """The runner's request for ``tokens`` (with ``images``, else :attr:`images`, at their places) on cache
        sequence ``sequence``; a raw request's text is left raw (a thinking span is not parsed out of it)."""
        return Request(list(tokens), self.sampler, self.max_tokens, list(self.stop), sequence, self.response_format,
                       list(images or self.images), reasoning=not self.raw, speculative=self.speculative,
                       draft_tokens=self.draft_tokens)


def _response_format(given: Mapping[str, Any]) -> ResponseFormat | None:
    named = [k for k in FORMAT_OPTIONS if k in given]
    if len(named) > 1:
        raise InvalidRequestError(f"give one of {', '.join(named)}, not several: each sets the output's format")
    if not named:
        return None
    key, value = named[0], given[named[0]]
    if key == "json_schema" and isinstance(value, dict):
        value = {"type": "json_schema", "json_schema": {"schema": value}}
    elif key == "regex":
        if not isinstance(value, str):
            raise InvalidOptionError("regex", value, "must be a string (a regular expression)")
        value = {"type": "regex", "pattern": value}
    elif key == "grammar":
        if not isinstance(value, str):
            raise InvalidOptionError("grammar", value, "must be a string (a Lark or GBNF grammar)")
        value = {"type": "grammar", "grammar": value}
    return parse_response_format(value)
