"""Plain values a call writes into its object arguments, written again on each replay.

A replay runs the recorded kernels, not the Python that launched them. When the function also
changes plain values (ints, floats, bools, strings, ...) inside an object it was given — a cache
that counts its length in a Python int (transformers' ``StaticSlidingWindowLayer.cumulative_length_int``),
a step counter on ``self`` — a bare replay would leave them as they were, and the next call
would read stale values: silently wrong. Those values are part of the call's key (see
``object_state.read_object``), so a replay only ever happens from the same values the recording
started from, and the recording's values after the call are the right ones to write: the
recorder notes them (:func:`changes`), the node writes them on each replay (:func:`apply`).

What cannot be repeated that way — an attribute or item added, deleted or rebound to another
kind of object, a tuple element changed, a plain attribute of a module changed (modules are keyed
by identity and ``training``, not by their Python values) — makes the recording fail with the path
named, and the call runs eagerly (its reason in ``stats()``).

Example::

    before = values(call.leaves)
    out = fn(*args)                      # captured
    writes = changes(before, values(call.leaves), "step")
    ...
    apply(leaves, writes)                # after each replay
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from typing import Any

import torch

from graphtree.tree.object_state import object_attributes
from graphtree.tree.readable import PLAIN_TYPES

__all__ = ["Unrepeatable", "apply", "changes", "module_changes", "module_values", "restore", "values"]

Path = tuple[Any, ...]  # leaf index, then ("a", name) / ("i", index) / ("k", key) / ("t", index) / ("len", None)
Writes = tuple[tuple[Path, Any], ...]
_NOT_PLAIN = object()  # marks a non-plain value in a snapshot, compared by identity: ``(_NOT_PLAIN, value)``
_MISSING = object()


class Unrepeatable(Exception):
    """A call changed its arguments in a way a replay cannot repeat (the message says where)."""


def values(leaves: Sequence[Any], max_items: int = 100_000) -> dict[Path, Any]:
    """Every plain value inside the object arguments among ``leaves``, by path; other values by
    identity (an object rebound to another is a change, its insides are walked)."""
    out: dict[Path, Any] = {}
    seen: set[int] = set()
    for i, x in enumerate(leaves):
        if not isinstance(x, torch.Tensor) and type(x) not in PLAIN_TYPES and not isinstance(x, torch.nn.Module):
            _walk(x, (i,), out, seen, max_items)
    return out


def _walk(x: Any, path: Path, out: dict[Path, Any], seen: set[int], max_items: int) -> None:
    if len(out) > max_items or id(x) in seen:
        return
    seen.add(id(x))
    if isinstance(x, (list, tuple)):
        step = "i" if isinstance(x, list) else "t"
        items: list[tuple[tuple[str, Any], Any]] = [((step, n), v) for n, v in enumerate(x)]
        size: Path = (*path, ("len", None))
        out[size] = len(x)
    elif isinstance(x, dict):
        items = [(("k", k), v) for k, v in x.items()]
        size = (*path, ("len", None))
        out[size] = len(x)
    else:
        found = object_attributes(x)
        if found is None:
            return
        items = [(("a", name), v) for name, v in found]
    for step_key, v in items:
        where = (*path, step_key)
        if _plain(v):
            out[where] = v
        else:
            out[where] = (_NOT_PLAIN, v)  # held (not its id, which a new object could reuse)
            if not (isinstance(v, (torch.Tensor, torch.nn.Module, types.ModuleType)) or callable(v)):
                _walk(v, where, out, seen, max_items)  # (read_object keys no deeper than 6 levels)


def module_values(modules: Sequence[torch.nn.Module | None]) -> dict[Path, Any]:
    """The plain values in the ``__dict__`` of every submodule of ``modules``, by
    ``(-1 - module index, ("m", submodule name), ("a", attribute))``: a module's own Python
    state, which its key does not hold (modules are keyed by identity and ``training``)."""
    out: dict[Path, Any] = {}
    for i, module in enumerate(modules):
        if module is None:
            continue
        for sub_name, sub in module.named_modules(remove_duplicate=True):
            for name, v in vars(sub).items():
                if _plain(v):
                    out[(-1 - i, ("m", sub_name), ("a", name))] = v
    return out


def _plain(v: Any) -> bool:
    """A value compared and written whole: a plain one, or a tuple of plain ones."""
    return type(v) in PLAIN_TYPES or (type(v) is tuple and all(type(e) in PLAIN_TYPES for e in v))


def changes(before: dict[Path, Any], after: dict[Path, Any], name: str) -> Writes:
    """The plain values the call changed, as ``(path, new value)``; raises :class:`Unrepeatable`
    for a change a replay cannot repeat."""
    writes: list[tuple[Path, Any]] = []
    for path, new in after.items():
        old = before.get(path, _MISSING)
        if old is _MISSING:
            raise Unrepeatable(_reason(name, path, "adds"))
        if _kept_by_identity(old) or _kept_by_identity(new):
            if _kept_by_identity(old) and _kept_by_identity(new) and old[1] is new[1]:
                continue
            raise Unrepeatable(_reason(name, path, "rebinds"))
        if type(old) is type(new) and old == new:
            continue
        if path[-1][0] in ("t", "len"):
            raise Unrepeatable(_reason(name, path, "resizes or rebuilds"))
        writes.append((path, new))
    for path in before.keys() - after.keys():
        raise Unrepeatable(_reason(name, path, "deletes"))
    return tuple(writes)


def _kept_by_identity(v: Any) -> bool:
    return type(v) is tuple and len(v) == 2 and v[0] is _NOT_PLAIN


def apply(leaves: Sequence[Any], writes: Writes) -> None:
    """Write the recorded values into this call's arguments (after a replay)."""
    for path, value in writes:
        obj = leaves[path[0]]
        for kind, key in path[1:-1]:
            obj = getattr(obj, key) if kind == "a" else obj[key]
        kind, key = path[-1]
        if kind == "a":
            setattr(obj, key, value)
        else:
            obj[key] = value


def restore(leaves: Sequence[Any], before: dict[Path, Any]) -> None:
    """Put back the plain values a call changed inside its object arguments since ``before`` (a
    capture that failed after the function's Python ran: the eager run that follows starts where
    the caller left them). What :func:`changes` would call unrepeatable is left as it is."""
    after = values(leaves)
    back = tuple(
        (path, old)
        for path, old in before.items()
        if path in after
        and _plain(old)
        and _plain(after[path])
        and path[-1][0] not in ("t", "len")
        and not (type(old) is type(after[path]) and old == after[path])
    )
    apply(leaves, back)


def module_changes(before: dict[Path, Any], after: dict[Path, Any], name: str) -> None:
    """Raise :class:`Unrepeatable` if the call changed a module's plain attribute: not in its key,
    so a replay could start from any value, and no recorded value would be right to write."""
    for path in before.keys() | after.keys():
        old, new = before.get(path, _MISSING), after.get(path, _MISSING)
        if type(old) is not type(new) or old != new:
            sub, attr = path[1][1], path[2][1]
            raise Unrepeatable(
                f"`{name}` changes the Python attribute `{attr}` of its module{f' `{sub}`' if sub else ''} "
                f"({old if old is not _MISSING else 'unset'} -> {new if new is not _MISSING else 'deleted'}): a "
                "replay runs no Python and cannot repeat that; keep such state in a buffer (a tensor) or "
                "outside the graphed call"
            )


def _reason(name: str, path: Path, what: str) -> str:
    steps = [f".{k}" if kind == "a" else "" if kind == "len" else f"[{k!r}]" for kind, k in path[1:]]
    where = f"argument {path[0]}" + "".join(steps)
    return (
        f"`{name}` {what} {where} (a value inside an object it was given): a replay runs no Python and "
        "cannot repeat that; change plain values in place (ints, floats, bools) or keep such state out of "
        "the graphed call"
    )
