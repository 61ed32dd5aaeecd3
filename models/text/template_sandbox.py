"""A Jinja2 sandbox that bounds the work of a chat template: its time, its output, and the size of every value it makes.

A chat template comes from a model file, so it is untrusted code. jinja2's ``ImmutableSandboxedEnvironment`` blocks
escapes (private attributes, mutation of lists and dicts, ``range`` over 100,000 items) but not work: nested loops run
for hours, ``'x' * 10**10`` or ``'%*d' % (2000000000, 1)`` allocate gigabytes before failing. This environment adds:

- **a wall-time limit** (:data:`TIME_LIMIT_S`), checked on every line the compiled template executes (a
  ``sys.settrace`` hook active only for frames of template code, during one render);
- **a size limit** on every string or list a template builds (:func:`Limits.size`): the operators ``*``, ``+``,
  ``%``, ``**`` and ``~``, the filters and string methods that grow their input (``center``, ``indent``, ``join``,
  ``replace``, ``format``, ``ljust``...), and the text collected by ``{% set %}`` blocks and macros are checked
  *before* the value is made;
- **an output limit**, checked as the template writes.

Every violation raises :class:`TemplateLimitError` (a ``jinja2.exceptions.SecurityError``), which
:func:`mlx_engine.models.text.chat_template.render_chat_template` turns into the engine's ``ChatTemplateError``.
"""

from __future__ import annotations

import re
import string
import sys
import threading
import time
from collections.abc import Iterable
from typing import Any

import jinja2
import jinja2.compiler
import jinja2.filters
from jinja2.sandbox import ImmutableSandboxedEnvironment

#: Wall time one rendering may take, seconds. Real chat templates render in milliseconds.
TIME_LIMIT_S = 1.0
#: Floor of the size limit (characters or items); the limit also grows with the size of the conversation.
MIN_SIZE = 1 << 20
#: The widest field a format (``%10d``, ``{:>10}``) or padding filter may ask for, characters.
MAX_WIDTH = 10_000
#: The largest integer power a template may compute, bits.
MAX_POWER_BITS = 4096

_TEMPLATE_FILE = "<template>"  # the file name jinja2 gives code compiled from a string


class TemplateLimitError(jinja2.exceptions.SecurityError):
    """A chat template went past one of this module's limits; the message names the limit."""


class Limits:
    """The limits of one rendering: a deadline and a size. Made by :meth:`BoundedEnvironment.render`."""

    def __init__(self, size: int, seconds: float):
        self.size = size
        self.seconds = seconds
        self.deadline = time.monotonic() + seconds

    def check_size(self, n: int, what: str) -> None:
        if n > self.size:
            raise TemplateLimitError(f"the chat template tried to make {what} of {n:,} characters or items; "
                                     f"the limit is {self.size:,}")

    def check_time(self) -> None:
        if time.monotonic() > self.deadline:
            raise TemplateLimitError(f"the chat template ran for more than {self.seconds:g} s (the limit)")


_PERCENT_FIELD = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?[a-zA-Z%]")
_NUMBER = re.compile(r"\d+")


def _check_percent_format(fmt: str) -> None:
    for width, precision in _PERCENT_FIELD.findall(fmt):
        for v in (width, precision):
            if v == "*":
                raise TemplateLimitError("chat templates cannot take a field width from an argument ('%*d')")
            if v and int(v) > MAX_WIDTH:
                raise TemplateLimitError(f"a format field of width {v} is over the limit of {MAX_WIDTH}")


def _check_brace_format(fmt: str) -> None:
    try:
        fields = list(string.Formatter().parse(fmt))
    except ValueError:
        return  # str.format raises the same error itself
    for _, _, spec, _ in fields:
        if not spec:
            continue
        if "{" in spec:
            raise TemplateLimitError("chat templates cannot take a format spec from an argument ('{:{}}')")
        for v in _NUMBER.findall(spec):
            if int(v) > MAX_WIDTH:
                raise TemplateLimitError(f"a format field of width {v} is over the limit of {MAX_WIDTH}")


def _length(x: Any) -> int:
    return len(x) if isinstance(x, (str, list, tuple, bytes, dict)) else 0


def _bounded_items(value: Iterable[Any], separator: int, length, limits: Limits, what: str) -> list[Any]:
    """The items of a join, taken one by one: the joined size (``length`` of each item plus a ``separator``-long
    separator) and the deadline are checked as they come, so a long separator or a slow generator stops within
    bounds, not after the whole list is built."""
    items, total = [], 0
    for i, item in enumerate(value):
        items.append(item)
        total += length(item) + separator
        limits.check_size(total, what)
        if i % 1024 == 1023:
            limits.check_time()
    return items


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    """An ``ImmutableSandboxedEnvironment`` whose renderings are bounded (see the module docstring).

    Use :meth:`render` (not ``Template.render``): the limits hold only inside it.
    """

    intercepted_binops = frozenset({"*", "+", "%", "**", "//"})

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self.code_generator_class = _BoundedCodeGenerator
        self.concat = self._bounded_join
        # the limits of the rendering running in each thread: one environment (a model's template) may render
        # for two threads at once, and one's end must not clear the other's limits
        self._rendering = threading.local()
        for name, width_arg in (("center", "width"), ("indent", "width"), ("wordwrap", "width")):
            self.filters[name] = self._widened(self.filters[name], width_arg)
        self.filters["join"] = self._join_filter(self.filters["join"])
        self.filters["replace"] = self._replace_filter(self.filters["replace"])
        self.filters["format"] = self._format_filter

    # ---- one rendering -----------------------------------------------------------------------------------------
    def render(self, template: jinja2.Template, size: int, seconds: float = TIME_LIMIT_S, **variables: Any) -> str:
        """Render ``template`` with ``variables``; its text and every value it builds hold at most ``size``
        characters or items, and it runs at most ``seconds``.

        Raises:
            TemplateLimitError: a limit was reached. Anything the template itself raises passes through.
        """
        limits = self._rendering.limits = Limits(size, seconds)
        previous = sys.gettrace()

        def local(frame, event, arg):
            limits.check_time()
            return local

        def tracer(frame, event, arg):
            if frame.f_code.co_filename == _TEMPLATE_FILE:
                limits.check_time()
                return local
            return None

        sys.settrace(tracer)
        try:
            out, n = [], 0
            for piece in template.generate(**variables):
                n += len(piece)
                limits.check_size(n, "an output")
                out.append(piece)
            return "".join(out)
        finally:
            sys.settrace(previous)
            self._rendering.limits = None

    @property
    def limits(self) -> Limits:
        limits = getattr(self._rendering, "limits", None)
        if limits is None:  # a template rendered outside render(): no limit was set, refuse
            raise TemplateLimitError("chat templates are rendered only through BoundedEnvironment.render")
        return limits

    # ---- operators ---------------------------------------------------------------------------------------------
    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        limits = self.limits
        limits.check_time()
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if _length(seq) and isinstance(n, int):
                    limits.check_size(_length(seq) * n, "a repeated string or list")
        elif operator == "+":
            if _length(left) and _length(right):
                limits.check_size(_length(left) + _length(right), "a concatenation")
        elif operator == "%":
            if isinstance(left, str):
                _check_percent_format(left)
        elif operator == "**":
            if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
                if right * abs(left).bit_length() > MAX_POWER_BITS:
                    raise TemplateLimitError(f"the power {left}**{right} is over the limit of {MAX_POWER_BITS} bits")
        return super().call_binop(context, operator, left, right)

    def bounded_concat(self, parts: tuple) -> str:
        """``a ~ b ~ ...``: the joined length is checked first."""
        self.limits.check_size(sum(len(str(p)) for p in parts), "a concatenation ('~')")
        return "".join(str(p) for p in parts)

    def _bounded_join(self, parts: Iterable[str]) -> str:
        """The text of a ``{% set %}`` block, a macro or a call block."""
        parts = list(parts)
        self.limits.check_size(sum(len(p) for p in parts), "a block's text")
        return "".join(parts)

    # ---- calls: str.format and the string methods that grow ----------------------------------------------------
    _GROWING = frozenset({"center", "ljust", "rjust", "zfill", "expandtabs"})

    def call(self, __context, __obj, *args: Any, **kwargs: Any) -> Any:  # noqa: N807 -- jinja2's signature
        limits = self.limits
        limits.check_time()
        owner = getattr(__obj, "__self__", None)
        name = getattr(__obj, "__name__", "")
        if isinstance(owner, str):
            if name in self._GROWING:
                widths = [a for a in (*args, *kwargs.values()) if isinstance(a, int)]
                if name == "expandtabs":
                    widths = [w * (owner.count("\t") + 1) for w in widths]
                for w in widths:
                    limits.check_size(w, f"str.{name}()")
            elif name == "join" and args:
                args = (_bounded_items(args[0], len(owner), _length, limits, "str.join()"), *args[1:])
            elif name == "replace" and len(args) >= 2:
                self._check_replace(owner, *args[:2])
        return super().call(__context, __obj, *args, **kwargs)

    def wrap_str_format(self, value: Any):
        """``str.format`` and ``str.format_map`` (the sandbox wraps both): the widths are checked first."""
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None

        def checked(*args: Any, **kwargs: Any) -> str:
            _check_brace_format(str(value.__self__))
            return wrapped(*args, **kwargs)
        return checked

    def _check_replace(self, s: Any, old: Any, new: Any) -> None:
        if isinstance(s, str) and isinstance(old, str) and isinstance(new, str):
            count = s.count(old) if old else len(s) + 1
            self.limits.check_size(len(s) + count * max(0, len(new) - len(old)), "a replace()")

    # ---- filters -----------------------------------------------------------------------------------------------
    def _widened(self, f, width_arg: str):
        def bounded(*args: Any, **kwargs: Any):
            width = kwargs.get(width_arg, args[1] if len(args) > 1 else 0)
            if isinstance(width, int) and width > MAX_WIDTH:
                raise TemplateLimitError(f"the {f.__name__} filter's {width_arg} {width} is over the limit of "
                                         f"{MAX_WIDTH}")
            return f(*args, **kwargs)
        return bounded

    def _join_filter(self, f):
        @jinja2.pass_eval_context
        def join(eval_ctx, value, d: str = "", attribute=None):
            items = _bounded_items(value, len(str(d)), lambda i: len(str(i)), self.limits, "a join")
            return f(eval_ctx, items, d, attribute)
        return join

    def _replace_filter(self, f):
        @jinja2.pass_eval_context
        def replace(eval_ctx, s, old, new, count=None):
            self._check_replace(str(s), str(old), str(new))
            return f(eval_ctx, s, old, new, count)
        return replace

    def _format_filter(self, value: Any, *args: Any, **kwargs: Any) -> str:
        _check_percent_format(str(value))
        return jinja2.filters.do_format(value, *args, **kwargs)


class _BoundedCodeGenerator(jinja2.compiler.CodeGenerator):
    """Compiles ``a ~ b`` to ``environment.bounded_concat((a, b))`` so that its length is checked first."""

    def visit_Concat(self, node, frame) -> None:  # noqa: N802 -- jinja2's visitor naming
        self.write("environment.bounded_concat((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")

