"""A bounded Jinja sandbox for chat templates, which come from the model file and so are untrusted code.

Jinja's own `ImmutableSandboxedEnvironment` keeps a template away from Python internals but bounds neither time
nor memory: `{{ 'a' * 2000000000 }}` allocates 2 GB in one C call and two nested loops over `range(100000)` run for
hours. `BoundedEnvironment` adds, per render:
- a size bound on every value the template makes (MAX_CHARS characters or items), checked *before* the operations
  that can multiply sizes in one C call (`*`, `**`, `%` and `format` widths, `replace`, `join`, padding and
  indentation widths, `str()` of containers) and after everything else that makes a value (operators, `~`, calls,
  filters, slices); and a budget on the total it makes (MAX_WORK), garbage included;
- a bound on the output (MAX_CHARS);
- a step budget (MAX_STEPS Python lines and calls, through `sys.settrace` on the rendering thread) and a wall-time
  limit (MAX_SECONDS), so that no loop, macro or Python-level filter runs on.
A template that crosses one raises `TemplateLimit` naming it; engine/text/chat.py reports that as a `tokenizer`
error (the model file's fault), and the model keeps serving everything else.
"""

from __future__ import annotations

import re
import string
import sys
import threading
import time
from collections.abc import ItemsView, KeysView, ValuesView
from typing import Any

from jinja2 import nodes
from jinja2.compiler import CodeGenerator
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

MAX_CHARS = 1 << 22  # characters of any one string, items of any one container, and of the output
MAX_WORK = 1 << 25  # characters and items made over one render, garbage included
MAX_STEPS = 1 << 21  # Python lines and calls executed over one render
MAX_SECONDS = 2.0  # wall time of one render (a 1,024-message Qwen3 chat renders in ~0.3 s)
MAX_SOURCE_CHARS = 1 << 16  # of the template itself (real ones have 1-20 K; 64 K compile in ~1 s)
MAX_INDENT = 64  # tojson's indent
MAX_INT_ARG = 1 << 16  # any integer argument of a call or filter: widths, counts, ranges, slices
MAX_PARTS = 1 << 15  # strings, numbers and containers inside one value written out as text


class TemplateLimit(BaseException):
    """The template crossed one of the limits above; the message names it. A BaseException, so that no
    `except Exception` inside Jinja's runtime or a filter can swallow it (raised from the trace hook, it also ends
    the tracing)."""


class _Budget:
    def __init__(self, steps: int, seconds: float):
        self.steps_left = steps
        self.work_left = MAX_WORK
        self.deadline = time.monotonic() + seconds
        self.max_steps = steps
        self.seconds = seconds

    def charge(self, n: int, what: str) -> None:
        if n > MAX_CHARS:
            raise TemplateLimit(f"{what} would make {n} characters or items (the limit, MAX_CHARS, is {MAX_CHARS})")
        self.work_left -= n
        if self.work_left < 0:
            raise TemplateLimit(f"it made more than {MAX_WORK} characters and items in all (MAX_WORK)")

    def trace(self, frame, event, arg):
        """sys.settrace hook, called at every Python call on the rendering thread: each is a step. Lines are steps
        too (loops run there: the template's, a filter's), except in Jinja's runtime and this module, whose
        functions do a bounded amount of work per call and are most of what a template calls."""
        self.steps_left -= 1
        if self.steps_left & 1023 == 0:
            self.check()
        return None if frame.f_code.co_filename in _UNTRACED else self.trace_lines

    def trace_lines(self, frame, event, arg):
        self.steps_left -= 1
        if self.steps_left & 1023 == 0:
            self.check()
        return self.trace_lines

    def check(self) -> None:
        if self.steps_left < 0:
            raise TemplateLimit(f"it ran more than {self.max_steps} steps (MAX_STEPS)")
        if time.monotonic() > self.deadline:
            raise TemplateLimit(f"it ran longer than {self.seconds} s (MAX_SECONDS)")


def _files(*names: str) -> frozenset[str]:
    import importlib

    return frozenset(importlib.import_module(n).__file__ for n in names)


# Jinja's runtime and compiler do bounded work per call (the compiler's is bounded by the template's length)
_UNTRACED = _files("jinja2.environment", "jinja2.runtime", "jinja2.sandbox", "jinja2.utils", "jinja2.lexer",
                   "jinja2.parser", "jinja2.compiler", "jinja2.nodes", "jinja2.visitor", "jinja2.idtracking",
                   "jinja2.optimizer", __name__)  # fmt: skip
_local = threading.local()


def _budget() -> _Budget:
    budget = getattr(_local, "budget", None)
    if budget is None:  # outside `render` (a template object used directly): one fresh budget per use
        budget = _Budget(MAX_STEPS, MAX_SECONDS)
    return budget


_SIZED = (str, bytes, bytearray, list, tuple, dict, set, frozenset, KeysView, ValuesView, ItemsView)


def size(value: Any, limit: int = MAX_CHARS) -> int:
    """An upper estimate of len(str(value)), computed without building it; past `limit` characters or MAX_PARTS
    parts it stops and returns a number over the limit. Shared references count each time they appear, as str()
    writes them each time (a list holding itself twice, 40 deep, is small in memory and 2^40 long as text)."""
    total, stack, parts = 0, [value], 0
    while stack:
        v = stack.pop()
        parts += 1
        if total > limit or parts > MAX_PARTS:
            return limit + 1
        if isinstance(v, str):
            total += len(v)
        elif isinstance(v, (bytes, bytearray)):  # b'...', up to four characters a byte
            total += 3 + 4 * len(v)
        elif isinstance(v, int) and not isinstance(v, bool):
            total += v.bit_length() // 3 + 2  # decimal digits, sign
        elif isinstance(v, dict):
            total += 2 + 4 * len(v)
            stack.extend(v.keys())
            stack.extend(v.values())
        elif isinstance(v, _SIZED):  # the other containers (str, bytes and dict are above)
            total += 2 + 2 * len(v)
            stack.extend(v)
        elif isinstance(v, Namespace):  # written as <Namespace {attributes}>
            total += 12
            stack.append(getattr(v, "_Namespace__attrs", {}))
        else:  # floats, None, bools, Undefined, loops, macros and the like: short reprs
            total += 32
    return total


def _shallow(value: Any) -> int:
    return len(value) if isinstance(value, _SIZED) else 1


_PERCENT = re.compile(r"%(?:\([^)]*\))?[-#0 +]*(\*|\d+)?(?:\.(\*|\d+))?")
_DIGITS = re.compile(r"\d+")


def _percent_size(fmt: str, args: Any) -> int:
    """Bound of `fmt % args`: the format, its widths and precisions, and the arguments as text."""
    widths = 0
    for width, precision in _PERCENT.findall(fmt):
        if "*" in (width, precision):
            raise TemplateLimit("a '*' width in a %-format (widths must be written out)")
        widths += int(width or 0) + int(precision or 0)
    return len(fmt) + widths + size(args)


def _format_size(fmt: str, args: Any) -> int:
    """Bound of `fmt.format(*args)`: the format, the numbers in its format specs, the arguments as text."""
    widths = 0
    for _, _, spec, _ in string.Formatter().parse(fmt):
        if spec:
            if "{" in spec:
                raise TemplateLimit("a nested '{}' in a format spec")
            widths += sum(int(d) for d in _DIGITS.findall(spec))
    return len(fmt) + widths + size(args)


def _replace_size(s: str, old: str, new: str) -> int:
    return len(s) + (s.count(old) if old else len(s) + 1) * max(0, len(new) - len(old))


def _join_size(sep: str, items: Any) -> int:
    if not isinstance(items, (list, tuple, str)):
        return 0  # a generator: its parts were charged when they were made, the result is checked after
    return len(sep) * len(items) + size(list(items) if isinstance(items, str) else items)


def _check_ints(args: Any, kwargs: dict, what: str) -> None:
    """Padding and indentation widths, slice and batch counts, ...: an integer argument that large is a bomb."""
    for a in (*args, *kwargs.values()):
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) > MAX_INT_ARG:
            raise TemplateLimit(f"{what} was given the number {a}, over MAX_INT_ARG ({MAX_INT_ARG})")


def _method_size(fn: Any, args: tuple, kwargs: dict) -> int:
    """Bound of the result of the str methods that can multiply sizes (0: no bound known before the call)."""
    owner, name = getattr(fn, "__self__", None), getattr(fn, "__name__", "")
    if not isinstance(owner, str):
        return 0
    if name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        return _replace_size(owner, args[0], args[1])
    if name == "join" and args:
        return _join_size(owner, args[0])
    if name == "expandtabs":
        tab = args[0] if args else kwargs.get("tabsize", 8)
        return len(owner) + owner.count("\t") * max(0, int(tab))
    return 0


def _check_filter(name: str, value: Any, args: tuple, kwargs: dict) -> None:
    """The size a filter can produce, before it runs (the result's own size is checked after)."""
    _check_ints(args, kwargs, f"the filter '{name}'")
    if name == "replace" and len(args) >= 2:
        n = _replace_size(str(value) if isinstance(value, str) else "", str(args[0]), str(args[1]))
    elif name == "join":
        n = _join_size(str(args[0]) if args else str(kwargs.get("d", "")), value)
    elif name == "indent":
        width = args[0] if args else kwargs.get("width", 4)
        n = size(value) * 2 + (size(value) + 1) * (width if isinstance(width, int) else size(width))
    elif name == "wordwrap":
        width = args[0] if args else kwargs.get("width", 79)
        wrap = (args[2] if len(args) > 2 else kwargs.get("wrapstring")) or "\n"
        n = size(value) * (1 + len(str(wrap)) // max(1, int(width) if isinstance(width, int) else 1))
    elif name == "format" and isinstance(value, str):
        n = _percent_size(value, (args, kwargs))
    elif name == "sum" and isinstance(kwargs.get("start", args[1] if len(args) > 1 else 0), (list, tuple, str)):
        raise TemplateLimit("the filter 'sum' over sequences (quadratic copying)")
    elif name == "tojson" and _indent(args, kwargs) > MAX_INDENT:
        raise TemplateLimit(f"tojson with an indent over {MAX_INDENT}")
    else:
        n = size(value) if name in _STRINGIFYING else 0
    if n:
        _budget().charge(n, f"the filter '{name}'")


def _indent(args: tuple, kwargs: dict) -> int:
    indent = kwargs.get("indent", args[1] if len(args) > 1 else None)  # tojson(value, ensure_ascii, indent)
    return indent if isinstance(indent, int) else 0


_STRINGIFYING = frozenset({"string", "tojson", "pprint", "center", "truncate", "urlencode", "xmlattr", "escape", "e",
                           "forceescape", "safe", "striptags", "title", "upper", "lower", "capitalize", "trim",
                           "urlize", "wordcount", "filesizeformat"})  # fmt: skip


def _bounded_filter(name: str, fn: Any) -> Any:
    passes_context = getattr(fn, "jinja_pass_arg", None) is not None

    def bounded(*args: Any, **kwargs: Any) -> Any:
        value, rest = (args[1], args[2:]) if passes_context else (args[0], args[1:])
        _check_filter(name, value, rest, kwargs)
        out = fn(*args, **kwargs)
        _budget().charge(_shallow(out), f"the filter '{name}'")
        return out

    for attr in ("jinja_pass_arg", "__name__", "__doc__"):
        if hasattr(fn, attr):
            setattr(bounded, attr, getattr(fn, attr))
    return bounded


class _Generator(CodeGenerator):
    """Jinja's code generator, but `a ~ b` and `x[i:j]` go through the environment (they are a plain join and a
    native slice otherwise), so that their results are charged like every other value's."""

    def visit_Getitem(self, node, frame) -> None:
        if not isinstance(node.arg, nodes.Slice):
            return super().visit_Getitem(node, frame)
        self.write("environment.getitem(")
        self.visit(node.node, frame)
        self.write(", slice(")
        for part in (node.arg.start, node.arg.stop, node.arg.step):
            if part is None:
                self.write("None")
            else:
                self.visit(part, frame)
            self.write(", ")
        self.write("))")
        return None

    def visit_Concat(self, node, frame) -> None:
        self.write("environment.concat_parts((")
        for arg in node.nodes:
            self.visit(arg, frame)
            self.write(", ")
        self.write("))")


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    code_generator_class = _Generator
    intercepted_binops = frozenset({"+", "-", "*", "/", "//", "%", "**"})

    def __init__(self, **kwargs: Any):
        super().__init__(finalize=self._finalize, **kwargs)
        del self.globals["lipsum"]  # lipsum(n) writes n paragraphs: nothing a chat template needs
        self.filters = {name: _bounded_filter(name, fn) for name, fn in self.filters.items()}

    def add_filter(self, name: str, fn: Any) -> None:
        self.filters[name] = _bounded_filter(name, fn)

    # -- what makes values --------------------------------------------------------------------------------

    def call_binop(self, context, op: str, left: Any, right: Any) -> Any:
        if op == "*":
            seq, n = (left, right) if isinstance(right, int) else (right, left)
            if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
                _budget().charge(len(seq) * max(0, n), "'*'")
        elif op == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
            if left.bit_length() * right > 1 << 16:
                raise TemplateLimit(f"'**' would make a {left.bit_length() * right}-bit number")
        elif op == "%" and isinstance(left, str):
            _budget().charge(_percent_size(left, right), "'%'")
        out = self.binop_table[op](left, right)
        _budget().charge(_shallow(out), f"'{op}'")
        return out

    def concat_parts(self, parts: tuple) -> str:
        _budget().charge(sum(size(p) for p in parts), "'~'")
        return "".join(p if isinstance(p, str) else str(p) for p in parts)

    def concat(self, chunks: Any) -> str:  # type: ignore[override]  # block captures, macros and `caller()`
        out, n = [], 0
        for chunk in chunks:
            n += len(chunk)
            if n > MAX_CHARS:
                raise TemplateLimit(f"a block made more than {MAX_CHARS} characters (MAX_CHARS)")
            out.append(chunk)
        _budget().charge(n, "a block")
        return "".join(out)

    def call(__self, __context, __obj, *args: Any, **kwargs: Any) -> Any:
        _check_ints(args, kwargs, getattr(__obj, "__name__", "a call"))
        n = _method_size(__obj, args, kwargs)
        if n:
            _budget().charge(n, f"'{__obj.__name__}'")
        out = super().call(__context, __obj, *args, **kwargs)
        _budget().charge(_shallow(out), getattr(__obj, "__name__", "a call"))
        return out

    def getitem(self, obj: Any, argument: Any) -> Any:
        out = super().getitem(obj, argument)
        if isinstance(argument, slice):  # a slice copies; an index does not
            _budget().charge(_shallow(out), "a slice")
        return out

    def wrap_str_format(self, value: Any) -> Any:
        wrapped = super().wrap_str_format(value)
        if wrapped is None:
            return None
        fmt = value.__self__

        def bounded(*args: Any, **kwargs: Any) -> str:
            _budget().charge(_format_size(fmt, (args, kwargs)), "'format'")
            return wrapped(*args, **kwargs)

        return bounded

    @staticmethod
    def _finalize(value: Any) -> Any:
        """Every `{{ ... }}` passes here before str(): a container is sized before it is written out."""
        if not isinstance(value, str):
            _budget().charge(size(value), "'{{ }}'")
        return value


class _Bounded:
    """`with _Bounded(): ...` runs the block under a fresh budget, traced, on this thread."""

    def __enter__(self) -> _Budget:
        self.budget = _Budget(MAX_STEPS, MAX_SECONDS)
        self.saved = getattr(_local, "budget", None), sys.gettrace()
        _local.budget = self.budget
        sys.settrace(self.budget.trace)
        return self.budget

    def __exit__(self, *exc) -> None:
        sys.settrace(self.saved[1])
        _local.budget = self.saved[0]


def compile_template(env: BoundedEnvironment, source: str):
    """env.from_string(source) under the limits (Jinja folds constant expressions, filters included, here)."""
    if len(source) > MAX_SOURCE_CHARS:
        raise TemplateLimit(f"its source has {len(source)} characters, over MAX_SOURCE_CHARS ({MAX_SOURCE_CHARS})")
    with _Bounded() as budget:
        compiled = env.from_string(source)
        budget.check()  # the last stretch (Python's own compile() of the generated code) runs untraced
        return compiled


def render(template, variables: dict) -> str:
    """template.render(**variables) under the limits; raises TemplateLimit naming the limit crossed."""
    out, n = [], 0
    with _Bounded():
        for chunk in template.generate(**variables):
            n += len(chunk)
            if n > MAX_CHARS:
                raise TemplateLimit(f"its output is over {MAX_CHARS} characters (MAX_CHARS)")
            out.append(chunk)
    return "".join(out)
