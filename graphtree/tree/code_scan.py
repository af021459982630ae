"""The code a graphed callable runs, as far as graphtree follows it, and the names it reads.

graphtree keys what a call's code reads besides its arguments (:mod:`graphtree.tree.reach`,
:mod:`graphtree.tree.settings`). This module finds that code and what it names: the function
behind a callable (a module's forward, a bound method's, what a decorator wraps), the functions it
calls by global name and the methods of the user's classes it reaches (:func:`sources`,
:func:`user_methods`), the attribute names a library module's code reads (:func:`class_reads`),
and whether code is installed (torch, transformers: not walked) or the user's.

Example::

    for env, names, cells, strings in sources(fn, user_methods(fn, module)):
        ...   # env[name] for name in names: the globals the code may read
"""

from __future__ import annotations

import collections.abc
import dis
import functools
import inspect
import os
import sys
import sysconfig
import types
from collections.abc import Iterator, Sequence
from typing import Any

import torch

MAX_FUNCTIONS = 64  # functions walked per graphed callable (its own, those it calls by global name)
MAX_DEPTH = 3  # calls deep
MISSING = object()  # a global deleted since, or an empty closure cell


@functools.cache
def class_reads(cls: type) -> frozenset[str]:
    """The attribute names a library module's ``forward`` may read, and those of the methods of its
    class it calls (``Conv2d._conv_forward`` reading ``self.stride``): its plain attributes among
    them are its settings (``nn.Dropout``'s ``p``, ``nn.LayerNorm``'s ``eps``), which its graphs
    hold as constants; ``nn.Linear`` reads none. Also what the functions those methods call by
    global name read of the module they are passed, one call deep, strings given to ``getattr``
    included: an HF attention's ``attention_interface(self, ...)`` (any of the functions of
    ``ALL_ATTENTION_FUNCTIONS``) reads ``module.is_causal``."""
    names: set[str] = set()
    helpers: list[Any] = []  # functions (and tables of functions) the class's methods name globally
    for f, read in _methods(cls, getattr(cls, "forward", None), set(), user=False):
        names |= read
        helpers.extend(f.__globals__[n] for n in read if n in f.__globals__)
    for h in helpers:
        table = list(h.values()) if isinstance(h, collections.abc.Mapping) and len(h) <= MAX_TABLE else [h]
        for g in table:
            if isinstance(g, types.FunctionType):
                names |= code_names(g.__code__) | code_strings(g.__code__)
    return frozenset(names)


MAX_TABLE = 32  # (a global mapping of at most this many functions is a table the code picks from)


def code_strings(code: types.CodeType) -> set[str]:
    """The string constants of a code object and those nested in it that could name an attribute or
    a setting (``getattr(m, "is_causal")``, ``CONFIG["temperature"]``)."""
    out = {c for c in code.co_consts if isinstance(c, str) and c.isidentifier()}
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            out |= code_strings(c)
    return out


def user_module(m: types.ModuleType) -> bool:
    """A Python module of the user's (a ``config.py`` of settings), not an installed one."""
    file = getattr(m, "__file__", None)
    return file is not None and not installed(file)


def user_class(cls: type) -> bool:
    """Whether ``cls`` is defined in the user's code (a script, a notebook, a project's module)."""
    module = sys.modules.get(cls.__module__)
    file = getattr(module, "__file__", None)
    return file is None or not installed(file)


def content(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # (an empty cell)
        return MISSING


def function(fn: Any) -> types.FunctionType | None:
    """The Python function whose code ``fn`` runs (a module's forward, a method's, a partial's, the
    function a decorator such as ``torch.compile`` wraps)."""
    for _ in range(8):
        if isinstance(fn, types.FunctionType):
            wrapped = getattr(fn, "__wrapped__", None)  # (functools.wraps: torch.compile's, a decorator's)
            if wrapped is None:
                return fn
            fn = wrapped
        elif isinstance(fn, torch.nn.Module):
            fn = type(fn).forward
        elif inspect.ismethod(fn):
            fn = fn.__func__
        elif isinstance(fn, functools.partial):
            fn = fn.func
        elif callable_object(fn):
            fn = type(fn).__call__
        else:
            return None
    return None


def callable_object(fn: Any) -> bool:
    """An instance of a user's class with a ``__call__`` of its own (not a function, a method or a module)."""
    call = getattr(type(fn), "__call__", None)  # noqa: B004 - (the class's, as a call looks it up)
    return (
        isinstance(call, types.FunctionType)
        and not isinstance(fn, (type, torch.nn.Module, functools.partial))
        and user_class(type(fn))
    )


@functools.cache
def library_roots() -> tuple[str, ...]:
    """Where installed code lives (the standard library, site-packages) and graphtree itself."""
    paths = sysconfig.get_paths()
    roots = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if paths.get(k)}
    roots |= {os.path.dirname(os.path.dirname(os.path.abspath(__file__)))}  # (graphtree's package)
    return tuple(os.path.join(r, "") for r in roots)


def is_library(f: types.FunctionType) -> bool:
    """Whether ``f`` is installed code (torch, transformers, the standard library), not the user's:
    its globals are the library's, and its reads are not followed."""
    return installed(f.__code__.co_filename)


def installed(path: str) -> bool:
    """Whether the file at ``path`` is installed code (under :func:`library_roots`)."""
    return os.path.abspath(path).startswith(library_roots())


def user_methods(fn: Any, module: torch.nn.Module | None) -> list[types.FunctionType]:
    """The methods of the user's classes a call of ``fn`` runs besides ``fn`` itself: the forwards of
    ``module``'s submodules of the user's classes, and for those and for ``fn`` bound to an object
    of the user's class, the methods and property getters their code names through ``self``
    (``self._norm(x)``, ``self.temperature`` as a property): the globals they read are settings too
    (``USE_GELU`` in a block's forward)."""
    starts: list[tuple[type, Any]] = []
    if module is not None:
        classes = dict.fromkeys(type(m) for m in module.modules())
        starts += [(cls, cls.forward) for cls in classes if user_class(cls)]
    owner = fn.__self__ if inspect.ismethod(fn) else None
    if owner is not None and not isinstance(owner, torch.nn.Module) and user_class(type(owner)):
        starts.append((type(owner), fn))
    seen: set[int] = set()
    return [f for cls, start in starts for f, _ in _methods(cls, start, seen, user=True)]


def _methods(cls: type, start: Any, seen: set[int], user: bool) -> Iterator[tuple[types.FunctionType, set[str]]]:
    """``start``'s function and the methods of ``cls`` its code names (through ``self``),
    transitively, each once with the names its code reads (``seen``: the ids of the functions
    walked, kept across calls; at most :data:`MAX_FUNCTIONS`). With ``user`` (the user's classes):
    static and class methods and property getters too, and installed code left out."""
    todo = [start]
    while todo and len(seen) < MAX_FUNCTIONS:
        f = function(todo.pop())
        if f is None or id(f) in seen or (user and is_library(f)):
            continue
        seen.add(id(f))
        read = code_names(f.__code__)
        yield f, read
        for n in sorted(read):
            a = inspect.getattr_static(cls, n, None)
            if isinstance(a, types.FunctionType) or (user and isinstance(a, (staticmethod, classmethod))):
                todo.append(getattr(cls, n))
            elif user and isinstance(a, property) and a.fget is not None:
                todo.append(a.fget)


@functools.cache
def probed_names(cls: type) -> frozenset[str]:
    """The attribute names the methods of the user's class ``cls`` (and of its user's bases) probe on
    ``self`` with a default, ``hasattr(self, "scale")`` or ``getattr(self, "scale", 1.0)``: absent at
    the first call, such an attribute set later changes what the code does (cached per class; a
    class's code is fixed)."""
    out: set[str] = set()
    for klass in cls.__mro__:
        if klass is object or not user_class(klass):
            continue
        for v in vars(klass).values():
            f = v.fget if isinstance(v, property) else v.__func__ if isinstance(v, (staticmethod, classmethod)) else v
            if isinstance(f, types.FunctionType):
                out |= _probes(f.__code__)
    return frozenset(out)


def _probes(code: types.CodeType, me: str | None = None) -> set[str]:
    """``"x"`` of each ``getattr(self, "x", ...)`` and ``hasattr(self, "x")`` in ``code`` (``self``:
    its first argument), and in the code nested in it that reads ``self`` from its closure."""
    if me is None:
        if not code.co_argcount:
            return set()
        me = code.co_varnames[0]
    out: set[str] = set()
    ins = [i for i in dis.get_instructions(code) if i.opname not in ("CACHE", "PUSH_NULL", "PRECALL")]
    for a, b, c in zip(ins, ins[1:], ins[2:]):
        probe = a.opname == "LOAD_GLOBAL" and a.argval in ("getattr", "hasattr") and b.argval == me
        if probe and c.opname == "LOAD_CONST" and isinstance(c.argval, str):
            out.add(c.argval)
    for const in code.co_consts:
        if isinstance(const, types.CodeType) and me in const.co_freevars:
            out |= _probes(const, me)
    return out


def code_names(code: types.CodeType) -> set[str]:
    """The global names a code object and those nested in it (lambdas, comprehensions) may read."""
    names = set(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            names |= code_names(c)
    return names


def sources(
    fn: Any, methods: Sequence[types.FunctionType] = ()
) -> list[tuple[dict[str, Any], set[str], list[tuple[Any, str]], set[str]]]:
    """For ``fn``'s function, the ``methods`` of the user's classes it reaches, and the functions
    their code calls by global name (not libraries', nor parts marked ``graphtree.eager``; at most
    :data:`MAX_DEPTH` calls deep and :data:`MAX_FUNCTIONS` in all): its globals, the names its
    code reads, its closure's cells and the strings its code holds (``CONFIG["temperature"]``)."""
    out: list[tuple[dict[str, Any], set[str], list[tuple[Any, str]], set[str]]] = []
    first = function(fn)
    todo = [(first, 0)] if first is not None and not is_library(first) else []
    todo += [(m, 0) for m in reversed(methods)]  # (walked after fn's own: popped from the end)
    walked: set[int] = set()
    while todo and len(walked) < MAX_FUNCTIONS:
        f, depth = todo.pop()
        if id(f) in walked:
            continue
        walked.add(id(f))
        names = code_names(f.__code__)
        cells = list(zip(f.__closure__ or (), f.__code__.co_freevars))
        out.append((f.__globals__, names, [(c, n) for c, n in cells], code_strings(f.__code__)))
        if depth < MAX_DEPTH:
            for v in [f.__globals__.get(n) for n in names] + [content(c) for c, _ in cells]:
                if getattr(v, "__graphtree_eager__", False):
                    continue  # a part marked graphtree.eager runs on every replay: what it reads is read live
                g = function(v) if isinstance(v, types.FunctionType) else None
                if g is not None and not is_library(g):
                    todo.append((g, depth + 1))
    return out
