"""Python call sites for GPU work: stack capture that keeps only the user's frames.

A *stack* is a tuple of frames ``(filename, lineno, function)``, outermost first, so its last frame
is the call site. Stacks are interned in a :class:`StackTable` and referred to by small integers,
which keeps millions of kernel records cheap.

:func:`capture_stack` walks the frames of the calling thread (CUPTI calls its callbacks in the
thread that made the CUDA call, so these are the frames of the code that launched or captured the
work) and drops the frames of torch, graphtree, cupti, cuda-python and the standard library: what is
left is the user's code. A module can mark itself internal with a global
``__graphtree_profile_internal__ = True``.

The graph-node -> stack map itself lives in :class:`graphtree.profile._nodes.GraphNodes` (fed by
``ProfileData.node_created`` / ``node_cloned`` from the CUPTI resource callbacks).

Example::

    >>> from graphtree.profile._attribution import StackTable, capture_stack
    >>> table = StackTable()
    >>> def user_code():
    ...     return capture_stack(table)
    >>> table.get(user_code())[-1][2]
    'user_code'
"""

from __future__ import annotations

import os
import sys
import sysconfig
from collections.abc import Sequence
from types import CodeType
from typing import Any

__all__ = [
    "DEFAULT_DEPTH",
    "Frame",
    "Stack",
    "StackTable",
    "add_internal_path",
    "capture_stack",
    "format_frame",
    "is_user_file",
]

Frame = tuple[str, int, str]  # (filename, lineno, function)
Stack = tuple[Frame, ...]

DEFAULT_DEPTH = 64  # frames walked at most (user frames kept are at most this many)
_INTERNAL_FLAG = "__graphtree_profile_internal__"

_keep_cache: dict[str, bool] = {}
_extra_internal: list[str] = []
# id(code) -> (code, keep): the code object is held, so its id is never reused while cached.
_code_keep: dict[int, tuple[CodeType, bool]] = {}
_line_cache: dict[tuple[int, int], int] = {}  # (id(code), lasti) -> line number


class StackTable:
    """Interns stacks as integers; id 0 is the empty stack (no Python frames, e.g. a C++ thread).

    Example::

        >>> t = StackTable()
        >>> t.intern((("a.py", 3, "f"),)) == t.intern((("a.py", 3, "f"),))
        True
        >>> t.get(0)
        ()
    """

    __slots__ = ("_ids", "_stacks", "_raw")

    def __init__(self) -> None:
        self._ids: dict[Stack, int] = {(): 0}
        self._stacks: list[Stack] = [()]
        self._raw: dict[tuple[int, ...], int] = {}

    def intern(self, frames: Stack) -> int:
        """The id of ``frames`` (a tuple of ``(filename, lineno, function)``), added if new."""
        sid = self._ids.get(frames)
        if sid is None:
            sid = self._ids.setdefault(frames, len(self._stacks))
            if sid == len(self._stacks):
                self._stacks.append(frames)
        return sid

    def intern_raw(self, key: tuple[int, ...]) -> int:
        """The id of a raw stack from :func:`capture_stack`: ``(id(code), lasti, ...)``, innermost
        first. Resolved to ``(filename, lineno, function)`` frames only the first time a key is seen,
        so a call site that launches a million times pays the resolution once."""
        sid = self._raw.get(key)
        if sid is None:
            sid = self._raw.setdefault(key, self.intern(_resolve_raw(key)))
        return sid

    def intern_list(self, frames: Sequence[Sequence[str | int]] | None) -> int:
        """Like :meth:`intern` for JSON-ish input (lists of ``[file, line, function]``)."""
        if not frames:
            return 0
        return self.intern(tuple((str(f[0]), int(f[1]), str(f[2])) for f in frames))

    def get(self, sid: int | None) -> Stack:
        """The stack with id ``sid`` (``None`` or unknown: the empty stack)."""
        if sid is None or sid < 0 or sid >= len(self._stacks):
            return ()
        return self._stacks[sid]

    def __len__(self) -> int:
        return len(self._stacks)


def add_internal_path(path: str) -> None:
    """Treat every file under ``path`` as internal (its frames are dropped from stacks).

    Example::

        add_internal_path("/opt/my_framework/")
    """
    p = os.path.abspath(path)
    if p not in _extra_internal:
        _extra_internal.append(p)
    _keep_cache.clear()
    _code_keep.clear()


def _package_dir(module_name: str) -> str | None:
    mod = sys.modules.get(module_name)
    f = getattr(mod, "__file__", None) if mod is not None else None
    if not f:
        return None
    return os.path.dirname(os.path.abspath(f)) + os.sep


def _stdlib_dirs() -> tuple[tuple[str, ...], tuple[str, ...]]:
    paths = sysconfig.get_paths()
    std = tuple({os.path.abspath(paths[k]) + os.sep for k in ("stdlib", "platstdlib") if k in paths})
    site = tuple({os.path.abspath(paths[k]) + os.sep for k in ("purelib", "platlib") if k in paths})
    return std, site


_STD, _SITE = _stdlib_dirs()

# graphtree's own machinery is never a call site; the demo
# (``demo/``: its model ``demo/gpt.py`` and the decode loop that drives it) and the command line
# are code like the user's, so their lines show.
_GT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_GRAPHTREE_MACHINERY = tuple(
    os.path.join(_GT_DIR, part)
    for part in (
        "tree" + os.sep,
        "profile" + os.sep,
        "bench" + os.sep,
        "debug" + os.sep,
        "_torch" + os.sep,  # (a package: gate, capture, ...)
        "_native" + os.sep,
        "_events.py",
        "__init__.py",
    )
)


def is_user_file(filename: str) -> bool:
    """Whether frames of ``filename`` belong to the user (not torch, graphtree's machinery,
    cupti or the standard library).

    Example::

        >>> is_user_file("/home/me/train.py")
        True
        >>> import json; is_user_file(json.__file__)
        False
    """
    if not filename or filename.startswith("<frozen"):
        return False
    if filename.startswith("<"):  # <string>, <stdin>: code the user typed
        return True
    path = os.path.abspath(filename)
    if path.startswith(_GRAPHTREE_MACHINERY):
        return False
    for name in ("torch", "cupti", "cuda.bindings", "cuda.core", "triton"):
        d = _package_dir(name)
        if d is not None and path.startswith(d):
            return False
    for d in _extra_internal:
        if path.startswith(d):
            return False
    if "site-packages" + os.sep in path or "dist-packages" + os.sep in path:
        return True
    if any(path.startswith(s) for s in _SITE):
        return True
    return not any(path.startswith(s) for s in _STD)


def _keep(frame: object, filename: str) -> bool:
    keep = _keep_cache.get(filename)
    if keep is None:
        g = getattr(frame, "f_globals", {})
        keep = (not g.get(_INTERNAL_FLAG, False)) and is_user_file(filename)
        _keep_cache[filename] = keep
    return keep


def _code_entry(frame: Any, code: CodeType) -> tuple[CodeType, bool]:
    fn = code.co_filename
    keep = _keep_cache.get(fn)
    if keep is None:
        keep = _keep(frame, fn)
    entry = _code_keep[id(code)] = (code, keep)
    return entry


def _line_of(code: CodeType, lasti: int) -> int:
    """The source line of the instruction at byte offset ``lasti`` of ``code`` (what ``f_lineno``
    reports for a frame suspended there), cached."""
    k = (id(code), lasti)
    line = _line_cache.get(k)
    if line is None:
        line = code.co_firstlineno
        try:
            for start, end, ln in code.co_lines():
                if start <= lasti < end:
                    if ln is not None:
                        line = ln
                    break
        except AttributeError:  # pragma: no cover - Python < 3.10
            pass
        if len(_line_cache) > 1_000_000:
            _line_cache.clear()
        _line_cache[k] = line
    return line


def _resolve_raw(key: tuple[int, ...]) -> Stack:
    out: list[Frame] = []
    for i in range(len(key) - 2, -1, -2):  # innermost first in the key, outermost first out
        code = _code_keep[key[i]][0]
        out.append((code.co_filename, _line_of(code, key[i + 1]), code.co_name))
    return tuple(out)


def capture_stack(table: StackTable, depth: int = DEFAULT_DEPTH) -> int:
    """Intern the user frames of the calling thread's Python stack; returns the stack id.

    Frames of torch, graphtree, cupti, cuda-python, the standard library and modules flagged
    ``__graphtree_profile_internal__`` are skipped. At most ``depth`` frames are walked.

    This runs inside CUPTI's launch callbacks, once per launch, so it is kept cheap: per frame it
    reads the code object and the instruction offset (``f_lasti``) and looks the code up in a cache
    of keep/drop decisions; the key ``(id(code), lasti, ...)`` of the kept frames is interned as
    is. File names, line numbers (``f_lineno`` scans the line table) and function names are
    resolved only when a key is new (:meth:`StackTable.intern_raw`).

    Example::

        sid = capture_stack(table)
        print(table.get(sid)[-1])    # ('train.py', 42, 'forward')
    """
    f: Any = sys._getframe(1)
    key: list[int] = []
    n = 0
    cache = _code_keep
    while f is not None and n < depth:
        code = f.f_code
        entry = cache.get(id(code))
        if entry is None:
            entry = _code_entry(f, code)
        if entry[1]:
            key.append(id(code))
            key.append(f.f_lasti)
        f = f.f_back
        n += 1
    if not key:
        return 0
    return table.intern_raw(tuple(key))


def capture_stack_slow(table: StackTable, depth: int = DEFAULT_DEPTH) -> int:
    """Reference implementation of :func:`capture_stack` (``f_lineno`` per frame); for tests."""
    f: Any = sys._getframe(1)
    out: list[Frame] = []
    n = 0
    while f is not None and n < depth:
        code = f.f_code
        if _code_entry(f, code)[1]:
            out.append((code.co_filename, f.f_lineno, code.co_name))
        f = f.f_back
        n += 1
    out.reverse()
    return table.intern(tuple(out)) if out else 0


def format_frame(frame: Frame | None, base: str | None = None) -> str:
    """``"file.py:12 function"`` with the file shown relative to ``base`` (default: the cwd).

    Example::

        >>> format_frame(("/x/train.py", 12, "step"), base="/x")
        'train.py:12 step'
    """
    if not frame:
        return "<no Python frames>"
    filename, lineno, function = frame
    base = os.getcwd() if base is None else base
    shown = filename
    if not filename.startswith("<"):
        try:
            rel = os.path.relpath(filename, base)
            shown = rel if not rel.startswith(".." + os.sep) else filename
        except ValueError:
            shown = filename
    return f"{shown}:{lineno} {function}"
