"""Durable dumps of a failing call: what a fresh process needs to run it again.

A dump holds the call's arguments (tensors with dtype, shape, strides and device, their values
copied to the host), the callable (its import path, or itself by value: a script's function, a
lambda, a model with its weights; :mod:`graphtree.debug.recipe`), the random-number states, the
versions of torch, CUDA and the driver, and the exception with its traceback. It is written
atomically: to a temporary file in the same folder, flushed and ``fsync``'d, renamed over the final
name, and the folder ``fsync``'d, so a crash or a kill at any moment leaves the old dump or the new
one, never a torn file. A dump larger than
``limit_bytes`` is refused before anything is written.

After a sticky CUDA error (an illegal address, a device-side assert) the arguments on the GPU
can no longer be read: ``dump_on_error(..., snapshot=True)`` and ``graphed(..., debug=dir)``
copy them to pinned host memory before each call (:mod:`graphtree.debug.snapshot`) and dump
those copies, of the call that raised and, for a CUDA error, of the call before it.

Example::

    from graphtree.debug import dump_on_error, load_dump

    @dump_on_error(dir="dumps")
    def step(x):
        return x[torch.tensor([10**9])]      # raises: the dump is written, the error re-raised

    d = load_dump("dumps/step-....gtdump")
    d.args, d.error, d.target
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from graphtree import _torch
from graphtree.debug import late as late_faults
from graphtree.debug.recipe import Recipe, recipe_of
from graphtree.debug.snapshot import ORIGIN_BEFORE, ORIGIN_RAISED, InputSnapshots, Snapshot, layout_of
from graphtree.tree.replay_error import GraphReplayError, is_cuda_error

__all__ = [
    "DEFAULT_LIMIT_BYTES",
    "Dump",
    "DumpTooLarge",
    "dump_failure",
    "dump_on_error",
    "load_dump",
    "write_dump",
    "write_snapshot",
]

SUFFIX = ".gtdump"
FORMAT = 2
_READS = (1, 2)  # format 1: no callable by value, no sys.path or working directory
DEFAULT_LIMIT_BYTES = 4 << 30
"""Dumps larger than this (4 GiB) are refused unless a larger limit is given."""


class DumpTooLarge(ValueError):
    """The dump would exceed its size limit; nothing was written."""


@dataclasses.dataclass
class Dump:
    """A loaded dump (see :func:`load_dump`)."""

    format: int
    target: str | None  # "module:qualname" when the callable is imported, else None
    target_note: str  # how the callable is rebuilt, or why it cannot be
    args: tuple
    kwargs: dict[str, Any]
    tensors: list[dict[str, Any]]  # dtype, shape, stride, device of each tensor argument, in order
    rng: dict[str, Any]
    versions: dict[str, Any]
    error: str  # "TypeName: message"
    traceback: str
    created: float
    origin: str = ORIGIN_RAISED  # or ORIGIN_BEFORE (a fault reported one call late)
    by_value: bytes | None = None  # the callable itself when it is not imported (format 2)
    sys_path: list[str] = dataclasses.field(default_factory=list)  # the dumping process's (format 2)
    cwd: str = ""  # the dumping process's working directory (format 2)

    def resolve(self) -> Callable[..., Any]:
        """The callable the dump was taken from, rebuilt here (``ValueError`` saying why if it cannot be)."""
        recipe = Recipe(self.target, self.target_note, self.by_value, self.sys_path, self.cwd)
        try:
            return recipe.rebuild()
        except ImportError as e:
            raise ValueError(f"{e} (the dump was written in {self.cwd or 'an unknown folder'})") from e


def _to_host(x: Any, layouts: list[dict[str, Any]]) -> Any:
    """A host copy of a tensor argument with its layout noted; other values as they are."""
    if not isinstance(x, torch.Tensor):
        return x
    layouts.append(layout_of(x))
    host = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="cpu")
    host.copy_(x.detach())
    return host


def _rng_states() -> dict[str, Any]:
    states: dict[str, Any] = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        try:
            states["cuda"] = torch.cuda.get_rng_state_all()
        except RuntimeError:  # a sticky CUDA error: the device can no longer be read
            states["cuda"] = None
    return states


def _versions() -> dict[str, Any]:
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "driver": _driver(),
        "graphtree": importlib.import_module("graphtree").__version__,
    }


def _driver() -> str | None:
    """The NVIDIA driver's version as ``nvidia-smi`` reports it (``None`` without one)."""
    from graphtree.debug.doctor import nvidia_smi_driver

    try:
        return nvidia_smi_driver()
    except Exception:  # noqa: BLE001 - a dump is never lost for want of a version string
        return None


def _nbytes(x: Any) -> int:
    leaves, _ = _torch.tree_flatten(x)
    return sum(t.untyped_storage().nbytes() for t in leaves if isinstance(t, torch.Tensor))


def write_dump(
    path: str | os.PathLike[str],
    fn: Callable[..., Any],
    args: tuple,
    kwargs: dict[str, Any],
    error: BaseException | None = None,
    limit_bytes: int = DEFAULT_LIMIT_BYTES,
    recipe: Recipe | None = None,
) -> Path:
    """Write a dump of the call ``fn(*args, **kwargs)`` (that raised ``error``) to ``path``, atomically.

    The arguments are read as they are now (after the call). Raises :class:`DumpTooLarge` (and
    writes nothing) when the arguments' tensors exceed ``limit_bytes``. ``recipe``: how to rebuild
    ``fn``, when the caller has it already (default: :func:`recipe_of` now). Returns the path written.
    """
    size = _nbytes((args, kwargs))
    if size > limit_bytes:
        raise DumpTooLarge(
            f"graphtree: a dump of this call would hold {size / 2**20:.1f} MiB of tensors, over its limit of "
            f"{limit_bytes / 2**20:.1f} MiB; nothing was written (raise limit_bytes to keep it)"
        )
    layouts: list[dict[str, Any]] = []
    leaves, spec = _torch.tree_flatten((args, kwargs))
    host_args, host_kwargs = _torch.tree_unflatten([_to_host(x, layouts) for x in leaves], spec)
    recipe = recipe or recipe_of(fn, limit_bytes)
    doc = _document(recipe, host_args, host_kwargs, layouts, _rng_states(), error, ORIGIN_RAISED)
    return _write_atomically(Path(path), doc)


def write_snapshot(
    path: str | os.PathLike[str],
    fn: Callable[..., Any],
    snapshot: Snapshot,
    error: BaseException | None = None,
    recipe: Recipe | None = None,
) -> Path:
    """Write a dump of a call of ``fn`` from its :class:`~graphtree.debug.snapshot.Snapshot`
    (its inputs and random states as they were before it ran), atomically; returns the path.
    ``recipe``: how to rebuild ``fn``, when the caller has it already (default: :func:`recipe_of` now)."""
    recipe = recipe or recipe_of(fn)
    doc = _document(recipe, snapshot.args, snapshot.kwargs, snapshot.tensors, snapshot.rng, error, snapshot.origin)
    return _write_atomically(Path(path), doc)


def _recipe_now_or_kept(fn: Callable[..., Any], limit_bytes: int, kept: Recipe | None) -> Recipe:
    """How to rebuild ``fn`` as it is now, or as kept at its first call (:attr:`InputSnapshots.recipe`)
    when it cannot be kept now (a model's weights unreadable after a sticky CUDA error)."""
    recipe = recipe_of(fn, limit_bytes)
    if recipe.by_value is None and recipe.target is None and kept is not None and kept.by_value is not None:
        recipe = dataclasses.replace(kept, note=f"{kept.note}, as of its first call (now: {recipe.note})")
    return recipe


def _document(
    recipe: Recipe,
    args: tuple,
    kwargs: dict[str, Any],
    layouts: list[dict[str, Any]],
    rng: dict[str, Any],
    error: BaseException | None,
    origin: str,
) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "target": recipe.target,
        "target_note": recipe.note,
        "by_value": recipe.by_value,
        "sys_path": recipe.sys_path,
        "cwd": recipe.cwd,
        "args": args,
        "kwargs": kwargs,
        "tensors": layouts,
        "rng": rng,
        "versions": _versions(),
        "error": "" if error is None else f"{type(error).__name__}: {error}",
        "traceback": "" if error is None else "".join(traceback.format_exception(error)),
        "created": time.time(),
        "origin": origin,
    }


def _write_atomically(final: Path, doc: dict[str, Any]) -> Path:
    """``torch.save`` to a temporary file beside ``final``, ``fsync``, rename, ``fsync`` the folder."""
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(doc, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return final


def load_dump(path: str | os.PathLike[str]) -> Dump:
    """Load a dump written by :func:`write_dump` (tensors come back on the host)."""
    doc = torch.load(Path(path), map_location="cpu", weights_only=False)
    if not isinstance(doc, dict) or doc.get("format") not in _READS:
        raise ValueError(f"{path} is not a graphtree dump of format {' or '.join(map(str, _READS))}")
    return Dump(**doc)


def dump_on_error(
    fn: Callable[..., Any] | None = None,
    *,
    dir: str | os.PathLike[str] = "graphtree-dumps",
    limit_bytes: int = DEFAULT_LIMIT_BYTES,
    snapshot: bool = False,
) -> Any:
    """Wrap ``fn`` so that a call that raises writes a dump into ``dir`` before the error propagates.

    The error is re-raised unchanged, with a note naming the dump (Python 3.11+). A dump that
    cannot be written (too large, disk full) adds a note saying so and never hides the error.
    Works on functions, modules and graphed callables, as a call or a decorator.

    ``snapshot=True`` is the mode for CUDA errors that leave GPU memory unreadable (an illegal
    address, a device-side assert): before each call the tensor arguments are copied to pinned
    host memory (asynchronously, keeping the last two calls; see
    :mod:`graphtree.debug.snapshot`), and an error writes the dump of the call that raised and
    of the call before it, whose fault CUDA may report one call late. It costs a
    ``cudaMemcpyAsync`` per tensor argument per call, and the bytes at the device-to-host
    bandwidth. Without it, the dump reads the arguments after the error (as the call left them).

    Example::

        step = graphtree.debug.dump_on_error(step, dir="dumps", snapshot=True)
    """
    if fn is None:
        return functools.partial(dump_on_error, dir=dir, limit_bytes=limit_bytes, snapshot=snapshot)
    if not callable(fn):
        raise TypeError(f"dump_on_error needs a callable, got {type(fn).__name__}")
    if type(limit_bytes) is not int or limit_bytes <= 0:
        raise ValueError(f"limit_bytes must be a positive int, got {limit_bytes!r}")
    folder = Path(dir)
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    snaps = watched_snapshots(fn, folder, name, limit_bytes) if snapshot else None

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            if snaps is not None:
                snaps.take(args, kwargs)
            return fn(*args, **kwargs)
        except Exception as e:
            dump_failure(folder, fn, name, args, kwargs, e, limit_bytes, snaps)
            raise

    late_faults.handled_inside(wrapper.__code__)  # type: ignore[attr-defined] # (its except clause writes the dumps)
    return wrapper


def dump_failure(
    dir: str | os.PathLike[str],
    fn: Callable[..., Any],
    name: str,
    args: tuple,
    kwargs: dict[str, Any],
    error: Exception,
    limit_bytes: int = DEFAULT_LIMIT_BYTES,
    snapshots: InputSnapshots | None = None,
    late: bool = False,
) -> list[Path]:
    """Write the dump(s) of a call of ``fn`` that raised ``error`` into ``dir``; returns their paths.

    With ``snapshots``, the dumps hold the inputs as they were before the call: one of the call
    that raised (``NAME-TIME-PID.gtdump``) and one of the call before it
    (``NAME-TIME-PID-before.gtdump``, for a CUDA error only), each when its copy is known to be
    whole; the call that raised falls back to its arguments as they are now. ``late``: ``error``
    surfaced outside ``fn``'s calls (:mod:`graphtree.debug.late`): the dumps are of its last call
    and the one before, from the snapshots only. Adds a note to ``error`` for each dump written or
    not written (and why): it never raises itself, so the caller's error always reaches the caller.
    Used by :func:`dump_on_error` and ``graphtree.graphed(..., debug=dir)``.

    Example::

        except Exception as e:
            dump_failure("dumps", step, "step", args, kwargs, e)
            raise
    """
    cuda = is_cuda_error(error) or isinstance(error, GraphReplayError)
    if cuda:
        late_faults.mark_dumped(error)
    base = f"{_safe(name)}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
    written: list[Path] = []
    kept = snapshots.recipe if snapshots is not None else None
    recipe = functools.cache(lambda: _recipe_now_or_kept(fn, limit_bytes, kept))  # read once, if a dump is written
    snaps = snapshots.completed(scan=late) if snapshots is not None else []
    if not cuda:  # only a CUDA fault is reported late
        snaps = [s for s in snaps if s.origin == ORIGIN_RAISED]
    for snap in snaps:
        path = Path(dir) / f"{base}{'' if snap.origin == ORIGIN_RAISED else '-before'}{SUFFIX}"
        what = _which_call(snap, name, late)
        try:
            written.append(write_snapshot(path, fn, snap, error, recipe()))
            _note(error, f"graphtree: a dump of {what} (its inputs before it ran) was written to {path}")
        except Exception as dump_error:  # noqa: BLE001 - the user's error must reach them in any case
            _note(error, f"graphtree: no dump of {what} was written: {dump_error}")
    if late:
        return written
    if not any(s.origin == ORIGIN_RAISED for s in snaps):
        lost = snapshots.lost() if snapshots is not None else ""
        path = Path(dir) / f"{base}{SUFFIX}"
        try:
            written.append(write_dump(path, fn, args, kwargs, error, limit_bytes, recipe()))
            after = " (its inputs as the call left them)" if snapshots is not None else ""
            _note(error, f"graphtree: a dump of this call{after} was written to {path}")
        except Exception as dump_error:  # noqa: BLE001 - as above
            why = f"{lost}; reading the inputs now failed too: {dump_error}" if lost else str(dump_error)
            _note(error, f"graphtree: no dump of the call that raised was written: {why}")
    if any(s.origin == ORIGIN_BEFORE for s in snaps):
        _note(
            error,
            "graphtree: CUDA reports a fault inside a graph or an asynchronous kernel at a later call: if "
            "re-running this call's dump does not reproduce the error, re-run the -before one",
        )
    return written


def watched_snapshots(
    fn: Callable[..., Any], dir: str | os.PathLike[str], name: str, limit_bytes: int = DEFAULT_LIMIT_BYTES
) -> InputSnapshots:
    """The input snapshots of ``fn`` (:class:`InputSnapshots`, keeping ``fn`` itself at its first
    call), whose dumps are written into ``dir`` also should a CUDA fault surface outside its calls
    (:mod:`graphtree.debug.late`). What ``snapshot=True`` and ``graphed(fn, debug=dir)`` use."""
    snapshots = InputSnapshots(limit_bytes, of=fn)
    late_faults.watch(
        snapshots, lambda error, snaps: dump_failure(dir, fn, name, (), {}, error, limit_bytes, snaps, late=True)
    )
    return snapshots


def _which_call(snap: Snapshot, name: str, late: bool) -> str:
    """How a dump's note names the call a snapshot is of."""
    if snap.origin != ORIGIN_RAISED:
        return snap.origin
    if late and snap.age:
        return (
            f"the call of `{name}` {snap.age} before the last (the newest whose inputs reached host memory "
            "before the GPU failed: the fault came from its work)"
        )
    return f"the last call of `{name}`" if late else snap.origin


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in name)[:80] or "call"


def _note(e: BaseException, text: str) -> None:
    add = getattr(e, "add_note", None)  # Python 3.11+
    if add is not None:
        add(text)
