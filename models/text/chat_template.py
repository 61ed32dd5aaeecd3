"""Chat templates: Jinja2 rendering as transformers does it, and the standard turn formats for models without one.

The environment reproduces ``transformers.utils.chat_template_utils._cached_compile_jinja_template`` (transformers
5.x): an ``ImmutableSandboxedEnvironment`` with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols``
extension, a ``{% generation %}`` block tag (rendered as its body), a ``tojson`` filter that does not escape HTML
(``json.dumps(x, ensure_ascii=False, ...)``), and the globals ``raise_exception``, ``strftime_now``, ``dict`` and a
``namespace`` that refuses underscore-prefixed attributes. The variables given to a template are ``messages``,
``tools``, ``documents``, ``add_generation_prompt``, the special tokens (``bos_token``, ``eos_token``, ``unk_token``,
``pad_token`` where the model has them) and any extra keyword arguments (which override the special tokens).

Messages are passed through as transformers does: keys whose value is ``None`` are dropped, and a reasoning field
(``reasoning_content``, ``thinking`` or ``reasoning``) is copied to both ``thinking`` and ``reasoning_content``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes

from mlx_engine.errors import ChatTemplateError, InvalidRequestError
from mlx_engine.models.text import template_sandbox
from mlx_engine.models.text.template_sandbox import MIN_SIZE, BoundedEnvironment, TemplateLimitError

# ---- standard turn formats (used only when a model ships no template) ---------------------------------------------

#: ChatML (``<|im_start|>role\n...<|im_end|>\n``), the format of SmolLM, Qwen and many fine-tunes.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['content'] is string %}{% set content = message['content'] %}"
    "{% else %}{% set content = message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text')"
    " | join('') %}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + content + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

#: Llama 3's header format (``<|start_header_id|>role<|end_header_id|>\n\n...<|eot_id|>``), as in Meta's template.
LLAMA3_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['content'] is string %}{% set content = message['content'] %}"
    "{% else %}{% set content = message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text')"
    " | join('') %}{% endif %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + (content | trim) + '<|eot_id|>' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

#: Gemma's turn format, as Gemma 3's own template writes it: BOS, a system message folded into the first user turn,
#: ``assistant`` spelled ``model``, ``<start_of_turn>role\n...<end_of_turn>\n``.
GEMMA_TEMPLATE = (
    "{{ bos_token }}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set first_user_prefix = messages[0]['content'] + '\n\n' %}{% set loop_messages = messages[1:] %}"
    "{% else %}{% set first_user_prefix = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if message['role'] == 'assistant' %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}"
    "{% if message['content'] is string %}{% set content = message['content'] %}"
    "{% else %}{% set content = message['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text')"
    " | join('') %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') + (content | trim)"
    " + '<end_of_turn>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)


def default_template(architecture: str | None, vocab: "Mapping[str, int] | Sequence[str] | set[str]") -> str:
    """The standard turn format for a model that ships no template.

    Gemma architectures (``gemma``, ``gemma2``, ``gemma3``...) or a vocabulary with ``<start_of_turn>``: Gemma's.
    A vocabulary with ``<|start_header_id|>``: Llama 3's. Anything else: ChatML.
    """
    arch = (architecture or "").lower()
    if arch.startswith("gemma") or "<start_of_turn>" in vocab:
        return GEMMA_TEMPLATE
    if "<|start_header_id|>" in vocab:
        return LLAMA3_TEMPLATE
    return CHATML_TEMPLATE


# ---- the environment ----------------------------------------------------------------------------------------------

class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: transformers marks assistant text with it; we render the body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """``dict(...)`` inside templates, without exposing the ``dict`` type itself."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """``namespace(...)`` that refuses underscore-prefixed attributes (no reaching CPython internals)."""

    def __init__(*args, **kwargs):  # noqa: N805 -- same signature trick as jinja2.utils.Namespace
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set the attribute {name!r} on a namespace")


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """Compile a chat template (cached by its text) in a :class:`BoundedEnvironment` of its own.

    Raises:
        ChatTemplateError: a syntax error, or a template the compiler cannot handle (nesting too deep...).
    """
    if not isinstance(source, str):
        raise ChatTemplateError(f"a chat template must be text, got {type(source).__name__}")
    env = BoundedEnvironment(trim_blocks=True, lstrip_blocks=True,
                             extensions=[_GenerationBlock, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    try:
        return env.from_string(source)
    except (jinja2.exceptions.TemplateError, RecursionError, MemoryError, ValueError, TypeError) as e:
        raise ChatTemplateError(f"the chat template does not compile: {e}") from e


_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _prepare_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for m in messages:
        if not isinstance(m, Mapping):
            raise InvalidRequestError(f"each chat message must be a dict, got {m!r}")
        m = {k: v for k, v in m.items() if v is not None}
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def render_chat_template(source: str, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
                         special_tokens: Mapping[str, str] | None = None, tools: list | None = None,
                         documents: list | None = None, **kwargs: Any) -> str:
    """Render ``source`` for ``messages`` (a list of ``{"role": ..., "content": ...}`` dicts).

    The rendering is bounded (:mod:`mlx_engine.models.text.template_sandbox`): at most ``TIME_LIMIT_S`` seconds, and its
    text and every value it builds at most 1 Mi characters or 8 times the size of the conversation, whichever is
    larger.

    Raises:
        InvalidRequestError: no messages, or a message that is not a dict.
        ChatTemplateError: a template that does not compile, that rejects the conversation (``raise_exception``),
            that fails in any other way while rendering, or that goes past a limit (the message names it).
    """
    if not messages:
        raise InvalidRequestError("the conversation is empty; give at least one message")
    template = compile_template(source)
    variables = {**(special_tokens or {}), **kwargs}
    prepared = _prepare_messages(messages)
    size = max(MIN_SIZE, 8 * (len(repr(prepared)) + len(repr(tools)) + len(repr(documents))))
    try:
        return template.environment.render(template, size, template_sandbox.TIME_LIMIT_S, messages=prepared,
                                           tools=tools, documents=documents,
                                           add_generation_prompt=add_generation_prompt, **variables)
    except TemplateLimitError as e:
        message = str(e) if str(e).startswith("the chat template") else f"the chat template was stopped: {e}"
        raise ChatTemplateError(message) from e
    except jinja2.exceptions.SecurityError as e:
        raise ChatTemplateError(f"the chat template was stopped: {e}") from e
    except jinja2.exceptions.TemplateError as e:
        raise ChatTemplateError(f"the chat template rejected the conversation: {e}") from e
    except RecursionError as e:
        raise ChatTemplateError("the chat template recursed too deeply (a macro that calls itself without end?)") from e
    except MemoryError as e:
        raise ChatTemplateError("the chat template ran out of memory") from e
    except Exception as e:  # anything else a template's own code raises: the template is at fault, not the caller
        raise ChatTemplateError(f"the chat template failed: {type(e).__name__}: {e}") from e
