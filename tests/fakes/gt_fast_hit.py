"""Shared by the fast hit's tests and ``benchmarks/probes/replay_hit_cpu*.py``: stand-ins for the
native helpers that let a replay hit run on CPU tensors, a recording planted by hand (one copied
input, one output from the pool) and a count of the calls a fast hit took.

Example::

    helpers = stand_in_helpers(ambient=lambda: (1, torch.float32, None))
    seen = count_fast_replays(monkeypatch)  # 1 per call a fast hit replayed, 0 per call it missed
    with counting_fast_replays() as seen: ...  # the same for a block, outside pytest
"""

from __future__ import annotations

import array
import contextlib
import os
import sys
import types
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

import graphtree
from graphtree._torch import meta_of, weak_ref
from graphtree.tree import fast_hit
from graphtree.tree import node as node_mod
from graphtree.tree.outputs import FromPool, Group, OutputPlan
from graphtree.tree.placement import InputPlan
from graphtree.tree.state_epoch import param_epoch

if TYPE_CHECKING:
    import pytest


def stand_in_signature(args: tuple[Any, ...], plain: Any) -> Any:
    """The native signature's answer for CPU tensors (the real one leaves them to Python) and
    plain values (``(type, value)``, as the real one gives them: floats, ints, ...)."""
    parts: list[tuple[Any, ...]] = []
    for x in args:
        if type(x) is float or type(x) in (plain or ()):
            parts.append((type(x), x))
            continue
        if type(x) is not torch.Tensor:
            return None
        parts.append((tuple(x.shape), x.dtype, x.stride()))
    return tuple(parts), 0, any(x.requires_grad for x in args if type(x) is torch.Tensor)


def stand_in_helpers(ambient: Callable[[], Any]) -> types.SimpleNamespace:
    """What a replay hit asks of ``graphtree._native``, for CPU tensors: the signature above, the
    ambient state from ``ambient``, a copy-in that copies nothing and the address checks in Python."""
    return types.SimpleNamespace(
        signature=stand_in_signature,
        ambient=ambient,
        copy_in=lambda stream, leaves, copies, writes: True,
        # (packed: each tensor's TensorImpl and address; the addresses are every second)
        addresses_unchanged=lambda ts, packed: array.array("Q", packed)[1::2].tolist() == [t.data_ptr() for t in ts],
        ptrs_equal=lambda ts, ptrs, idx: all(ts[k].data_ptr() == ptrs[k] for k in idx),
    )


def with_native_hit(fake: types.SimpleNamespace, real: Any) -> types.SimpleNamespace:
    """``fake`` (:func:`stand_in_helpers`) with the real native hit: ``fast_replay``, ``fast_call``
    and ``fast_entry`` (given the stand-in signature, for CPU tensors) and a module's
    ``module_entry`` and ``module_type_call``. Returns ``fake``."""
    fake.fast_replay = real.fast_replay
    fake.fast_call = lambda gc, hits, args, plain, miss, threads, float_part: real.fast_call(
        gc, hits, args, plain, miss, threads, float_part, fake.signature
    )
    fake.fast_entry = lambda package, owner, fallback, plain, miss, threads, float_part: real.fast_entry(
        package, owner, fallback, plain, miss, threads, float_part, fake.signature
    )
    fake.module_entry = real.module_entry
    fake.module_type_call = real.module_type_call
    return fake


def count_fast_replays(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """From now until the test ends: 1 for each call a fast hit replayed, 0 for each it left to the
    Python path (``fast_hit.entry``: a counting ``replay_again``, restored by ``monkeypatch``)."""
    seen: list[int] = []
    monkeypatch.setattr(fast_hit, "entry", _counted(fast_hit.replay_again, seen))
    return seen


@contextlib.contextmanager
def counting_fast_replays() -> Iterator[list[int]]:
    """:func:`count_fast_replays` for a block, outside pytest (``benchmarks/per_call.py``)."""
    seen: list[int] = []
    # (graphtree before the C entry, 62e2f48, called replay_again itself: per_call.py's "before" run)
    name = "entry" if hasattr(fast_hit, "entry") else "replay_again"
    original = getattr(fast_hit, name)
    setattr(fast_hit, name, _counted(fast_hit.replay_again, seen))
    try:
        yield seen
    finally:
        setattr(fast_hit, name, original)


def _counted(original: Callable[..., Any], seen: list[int]) -> Callable[..., Any]:
    def counted(gc: Any, hits: Any, args: Any) -> Any:
        out = original(gc, hits, args)
        seen.append(0 if out is fast_hit.MISS else 1)
        return out

    return counted


def plant_recording(
    tree: Any, gc: Any, key: Any, x: torch.Tensor, launch: Callable[[], Any], parent: Any = None
) -> Any:
    """A recording of ``gc(x)`` keyed ``key``, under ``parent`` (``tree``'s root by default) as if
    captured, launching ``launch``: one input copied into a placeholder, one output from the pool.
    Returns its node."""
    parent = tree.walk.root if parent is None else parent
    # The recording's output in "the pool": its graph holds it, as a real graph's pool holds its
    # memory, and it holds defined values (a replay reads them through its address).
    out = torch.empty_like(x).copy_(torch.arange(x.numel()).reshape(x.shape))
    storage = out.untyped_storage()
    inputs = InputPlan(
        inplace_idx=[], inplace_ptrs=[0], copy_idx=[0], placeholders=[torch.empty_like(x)],
        padded=(), pad_dim=0, bucket=-1, device=0,
    )  # fmt: skip
    groups = [Group(storage.data_ptr(), storage.nbytes(), "stale")]
    plan = OutputPlan(None, [FromPool(0, meta_of(out))], groups, [], 0, -1)
    node = node_mod.Node(
        id="n", parent=parent, key=(gc.id, key), name=gc.name, depth=getattr(parent, "depth", -1) + 1,
        graph=types.SimpleNamespace(replay=int, pool=out), inputs=inputs, outputs=plan, refs=[weak_ref(storage)],
        checkpoint=None, alive_at_checkpoint=[], dead_before=[], statics=gc.static_tensors(), epoch=param_epoch(),
        capture_seconds=0.0, input_refs=[], externals=[],
    )  # fmt: skip
    node._launch = launch
    parent.children[(gc.id, key)] = [node]
    return node


def module_stops(call: Callable[[], Any]) -> tuple[list[str], int]:
    """The graphtree modules ``call()`` stops in, in order, and how many of those stops re-enter a
    module the walk had already left (issue 47, item 4). A *stop* is a change of the graphtree
    module that runs, at a Python call or return; frames outside graphtree (torch's Python) are not
    stops. ``benchmarks/call_walk.py`` walks a replay with it on a GPU, ``tests/test_fast_hit.py`` on CPU."""
    root = os.path.dirname(os.path.abspath(graphtree.__file__)) + os.sep
    seq: list[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        f = frame if event == "call" else frame.f_back if event == "return" else None
        path = os.path.abspath(f.f_code.co_filename) if f is not None else ""
        if path.startswith(root):
            mod = path[len(root) :].removesuffix(".py").replace(os.sep, ".")
            if not seq or seq[-1] != mod:
                seq.append(mod)

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    return seq, sum(m in seq[:i] for i, m in enumerate(seq))
