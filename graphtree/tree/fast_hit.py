"""Replaying again what a graphed callable's last call replayed, without the Python path's steps.

In a loop, a graphed call replays the same recording call after call. The Python path
(``GraphedCallable._run`` → ``TreeManager.call``) reaches that recording through 23 Python frames:
it reads the call, keys it, checks the hooks, the module arguments, the numbers, the ambient state,
decides the step, looks the recording up and checks it. Most answers never change in a steady
loop. :class:`FastHit` keeps, after a replay by the Python path, what those answers depended on;
the next call of the same thread with the same tensors' signature on the same device (each
thread has its own tree, so its own fast hits) checks those inputs alone (the
hook counters, the ambient state, the module's mode, the values its code reads, the step, the
recording still in place) and does what the Python path would do from there, in its order: end
the step, replay, enter the node, count. Anything else it does not decide: it answers
:data:`MISS` before it changes any state, and the Python path, the reference, runs the call.
With the native helpers, ``_native.fast_call`` reads the signature, finds the hit and replays it
in one call; without them (``GRAPHTREE_NATIVE=0``) :func:`tensor_signature` and
:meth:`FastHit.replay` are its Python twins, the Python path of a replay hit (issue 47;
``graphtree/_native/DESIGN.md``).

What a :class:`FastHit` covers: a call of CUDA tensors and Python floats read as device scalars
(a temperature per request; no keywords, no ints, no objects),
of a callable with no debug dumps, no buckets, no closure tensors followed per call, no training
step, and a recording that is unconditional or checks only its statics. The values its code reads
(``reach.FreeValues``) are keyed as on the Python path: the same part object, or a miss.
Several signatures of one callable each keep theirs (:data:`KEEP` at most); a signature whose
fast hit keeps missing (:data:`MAX_REPLACED` times, less than :data:`SETTLED` replays apart) is
left to the Python path. A fast hit holds its tree and recording weakly: ``graphtree.reset()``
frees them as before.

``GraphedCallable.__call__`` calls :data:`entry`: :func:`replay_again` until the helpers have
loaded, then their ``fast_entry``, ``fast_call`` with its fixed arguments bound: a C function, with
no Python frame of graphtree's between the call and the replay.

Example (what ``GraphedCallable.__call__`` does)::

    hits = gc.fast_hits
    if hits and not kwargs:
        out = fast_hit.entry(gc, hits, args)
        if out is not MISS:
            return out
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from typing import Any

import torch

from graphtree import _native, _torch
from graphtree.tree import inputs as _inputs
from graphtree.tree import manager as _manager
from graphtree.tree import state_epoch as _state_epoch
from graphtree.tree.ambient import state as _ambient
from graphtree.tree.inputs import Call
from graphtree.tree.manager import MAX_PATH_DEPTH, TreeManager
from graphtree.tree.node import Node
from graphtree.tree.numbers import number_part
from graphtree.tree.readable import PLAIN_TYPES

MISS = object()
"""The answer of a call :class:`FastHit` does not decide: the Python path runs it."""

KEEP = 8
"""Signatures remembered per callable; past it, the oldest is forgotten."""

MAX_REPLACED = 3
"""Times a signature's :class:`FastHit` may be made again (it missed where the Python path then
replayed: another recording, place, ambient state, parameter epoch...) before the signature is
left to the Python path: two recordings of one signature in turn (a call under autocast and one
without) would otherwise make one on every call. Misses :data:`SETTLED` replays apart are not a
see-saw (a module made somewhere moves the parameter epoch every recording of parameters checks):
such a miss starts the count again."""

SETTLED = 64
"""Replays of a fast hit's recording since it was made after which a miss starts the count of
:data:`MAX_REPLACED` again."""

_GAVE_UP = object()  # (in a callable's hits: this signature goes the Python path)
_PLAIN = PLAIN_TYPES  # (a tuple: what the native signature takes)
_FLOAT = number_part(0.0)  # (a float's key part where it is read as a device scalar: tree/numbers.py)
# Where the process keeps what every fast hit reads, as the native twin reads it (no call into
# their modules): the calling thread's trees, the hook handles made (tree/hooks.py decides again
# after a new one) and the parameter epoch (parameters registered since).
_THREADS = _manager.thread_state()
_HANDLE_CLASS: Any = _torch.hook_handle_class()  # (its next_id)
_EPOCH_CELL = _state_epoch.param_epoch_cell()  # (its item 0)
_COLLECTED = _manager.collected_ids()  # (a step that ends with more ends in Python: TreeManager.new_step)


class FastHit:
    """What a replay of ``node`` for calls of signature ``sig`` depended on (see the module)."""

    __slots__ = (
        "ambient",
        "child_key",
        "device",
        "epoch",
        "handles",
        "models",
        "module",
        "node",
        "parent",
        "plan",
        "reads",
        "replaced",
        "replays_at",
        "training",
        "tree",
    )

    def __init__(
        self, gc: Any, tree: TreeManager, node: Node, device: int, ambient: Any, reads: Any, replaced: int
    ) -> None:
        # The tree and the recording, weakly: a fast hit keeps no recording (nor its pool memory)
        # alive after graphtree.reset() or a dropped tree; the callable is not kept (it keeps this).
        self.tree = weakref.ref(tree)
        self.node = weakref.ref(node)
        self.parent = weakref.ref(node.parent)
        self.child_key = node.key
        self.device = device
        self.ambient = ambient
        self.reads = reads
        self.module: torch.nn.Module | None = gc.module()
        self.training = self.module.training if self.module is not None else None
        self.handles = _HANDLE_CLASS.next_id
        self.epoch = _EPOCH_CELL[0]
        self.models = gc.free.models
        self.replaced = replaced
        self.replays_at = node.replays  # (its recording's replays when it was made: settled())
        # What the native twin of replay() reads (graphtree/_native: fast_replay), in its order.
        self.plan = (
            MISS, self.tree, self.node, self.parent, self.child_key, device, ambient, self.module, self.training,
            _HANDLE_CLASS, self.handles, _EPOCH_CELL, self.epoch, gc.free, self.models,
            reads, _THREADS, gc.id, MAX_PATH_DEPTH, torch.is_grad_enabled,
            _COLLECTED, _torch.storage_use_count, _torch, hash(self.child_key),
        )  # fmt: skip

    def same_as(self, other: FastHit) -> bool:
        """Whether ``other`` depends on the same answers (made again, it was not replaced)."""
        mine = (self.node(), self.parent(), self.tree(), self.models, self.reads, self.ambient, self.epoch)
        theirs = (other.node(), other.parent(), other.tree(), other.models, other.reads, other.ambient, other.epoch)
        same = all(a is b or a == b for a, b in zip(mine, theirs))
        return same and self.handles == other.handles and self.training == other.training

    def settled(self) -> bool:
        """Whether its recording replayed :data:`SETTLED` times since it was made (a miss now is a
        rare one: it does not count towards giving the signature up)."""
        node = self.node()
        return node is not None and node.replays - self.replays_at >= SETTLED

    def replay(
        self, gc: Any, args: tuple[Any, ...], needs_grad: bool, here: tuple[TreeManager | None, bool] | None = None
    ) -> Any:
        """The replay the Python path would make of ``gc(*args)``, or :data:`MISS` (nothing changed);
        ``here``: :func:`_here` of its device where the caller read it already."""
        if gc.takes_python_path(needs_grad) or _HANDLE_CLASS.next_id != self.handles:
            return MISS
        if _EPOCH_CELL[0] != self.epoch or gc.free.models is not self.models or _ambient() != self.ambient:
            return MISS
        module = self.module
        if module is not None and module.training != self.training:
            return MISS
        free = gc.free  # the values its code reads: the same part object while none changed (reach.py)
        if (free.part() if free.active else None) is not self.reads:
            return MISS
        tree, steps_itself = here if here is not None else _here(self.device)
        node = self.node()
        if tree is None or tree is not self.tree() or node is None:  # (another thread: its own tree)
            return MISS
        with tree.lock:
            walk = tree.walk
            path = walk.path
            if len(path) >= MAX_PATH_DEPTH:
                return MISS
            new_step = walk.step_requested or (not tree.user_steps and gc.id in walk.called and steps_itself)
            if new_step:
                parent: Any = walk.root
            elif walk.warming:
                return MISS
            else:
                parent = walk.current
            then = self.parent()  # (None: the recording's parent was dropped)
            if then is None or parent is not then or node.first is not None:
                return MISS
            kids = then.children.get(self.child_key)
            if not kids or kids[0] is not node or not tree.order.unchanged():
                return MISS
            if not node.unconditional and not (  # (a module's recording: its parameters in place)
                node.statics_only and node.epoch == self.epoch and node.statics_in_place(tree.check, _native.loaded)
            ):
                return MISS
            # What TreeManager.call does from here, in its order.
            leaves: Sequence[Any] = tree.new_step(args) if new_step else args
            walk.called.add(gc.id)
            tree.memory.live = False
            try:
                out = node.replay(leaves, len(leaves))
            except RuntimeError as e:
                tree.raise_replay_error(gc, node, e)
            walk.path.append(node)
            walk.current = node
            tree.counters.replays += 1
            tree.hit = node
            return out


def replay_again(gc: Any, hits: dict[Any, Any], args: tuple[Any, ...]) -> Any:
    """A call ``gc(*args)`` replayed as its signature's last replay was, or :data:`MISS`. Once the
    helpers with ``fast_entry`` have loaded, makes :data:`entry` theirs (where it is still this)."""
    global entry
    native = _native.loaded
    whole = getattr(native, "fast_call", None)  # (this function and replay_hit in one native call)
    if whole is not None:
        make = getattr(native, "fast_entry", None)
        if make is not None and entry is replay_again:  # (its entry falls back here if they are swapped)
            entry = make(_native, native, replay_again, _PLAIN, MISS, _THREADS, _FLOAT)
        return whole(gc, hits, args, _PLAIN, MISS, _THREADS, _FLOAT)
    sig = native.signature(args, _PLAIN) if native is not None else tensor_signature(args)
    if sig is None:
        return MISS
    here = _here(sig[1])
    parts = floats_keyed(gc, sig[0])
    hit = hits.get((parts, sig[1], id(here[0])))  # (the arguments' parts, their device, this thread's tree)
    if hit is None or hit is _GAVE_UP:
        return MISS
    return replay_hit(gc, hit, args, sig[2], here)


entry: Callable[[Any, dict[Any, Any], tuple[Any, ...]], Any] = replay_again
"""What ``GraphedCallable.__call__`` calls for a call of positional arguments with fast hits kept:
:func:`replay_again`, or once the helpers have loaded their ``fast_entry`` (see the module). Tests
that count fast hits put a counting :func:`replay_again` here."""


def floats_keyed(gc: Any, parts: tuple[Any, ...]) -> tuple[Any, ...]:
    """A signature's ``parts`` with each float keyed as ``Numbers.rekey`` keys it: a device scalar's
    part unless the callable keys that position by value (the native ``fast_call`` does the same)."""
    if not any(len(p) == 2 and p[0] is float for p in parts):
        return parts
    by_value = gc.numbers.by_value
    return tuple(_FLOAT if len(p) == 2 and p[0] is float and i not in by_value else p for i, p in enumerate(parts))


def _here(device: int) -> tuple[TreeManager | None, bool]:
    """``manager.tree_here(device)``, read from the threads' state this module keeps, as the native
    ``fast_call`` reads it (one call of this module's where a call into the manager was two stops)."""
    state = _THREADS.__dict__
    trees = state.get("managers")
    return (trees.get(device) if trees is not None else None), not state.get("one_step", 0)


def tensor_signature(args: tuple[Any, ...]) -> tuple[tuple[Any, ...], int, bool] | None:
    """The native ``signature`` of a call of CUDA tensors and floats, read in Python (without the
    native helpers: ``GRAPHTREE_NATIVE=0``, or before they have loaded): each tensor's (shape,
    dtype, stride), as ``inputs.read_call`` keys it, each float's ``(float, value)``, the tensors'
    one device, and whether one requires grad. None for anything else (another Python value, an
    object, a tensor subclass, a CPU tensor, a lazy conjugate or negative view, tensors on several
    devices): the fast hit keeps none of those."""
    parts: list[tuple[Any, ...]] = []
    device = -1
    needs_grad = False
    for x in args:
        if type(x) is float:
            parts.append((float, x))
            continue
        if type(x) is not torch.Tensor or not x.is_cuda or x.layout is not torch.strided or x.is_conj() or x.is_neg():
            return None
        d = x.get_device()
        if d != device and device >= 0:
            return None
        device = d
        parts.append((tuple(x.shape), x.dtype, x.stride()))
        needs_grad = needs_grad or x.requires_grad
    return (tuple(parts), device, needs_grad) if device >= 0 else None


def replay_hit(
    gc: Any, hit: FastHit, args: tuple[Any, ...], needs_grad: bool, here: tuple[TreeManager | None, bool] | None = None
) -> Any:
    """``hit`` made again for ``gc(*args)`` natively, or by its Python twin without the helpers (or
    with a build from before ``fast_replay``); :data:`MISS` where an answer it depended on changed."""
    fast = getattr(_native.loaded, "fast_replay", None)
    if fast is not None:
        return fast(gc, hit.plan, args, needs_grad)
    return hit.replay(gc, args, needs_grad, here)


def remember(gc: Any, hits: dict[Any, Any], call: Call, device: int) -> None:
    """After a call the Python path ran: keep its replay for the next call of its signature, where
    the replay was one :class:`FastHit` covers (see the module). The cheap answers come first: a
    call that replays a recording no fast hit covers, or a signature given up, pays only those."""
    tree = _here(device)[0]
    node = tree.hit if tree is not None else None
    if tree is None or node is None or node.key[0] != gc.id or node.first is not None:
        return
    if not (node.unconditional or node.statics_only) or call.spec is not None or call.bucket >= 0:
        return
    args = call.leaves
    n = len(args)
    parts = call.key[:n]  # (the tensors' parts, from either read, and their device: replay_again's key)
    sig = (parts, device, id(tree))  # (each thread's tree its own: threads calling one callable)
    old = hits.get(sig)
    if old is _GAVE_UP or not all(
        type(a) is torch.Tensor or (type(a) is float and p == _FLOAT) for a, p in zip(args, parts)
    ):
        return  # (a float keyed by value: its recording's key holds the value, which the fast hit does not read)
    if not _inputs.plain_tensor_parts(parts):
        return  # (a host scalar's part has no strides, a lazy view's four items: the native signature leaves both)
    if gc.takes_python_path(call.needs_grad) or _torch.hook_handles_made() < 0:
        return
    ambient = _ambient()
    module = gc.module()
    rest: tuple[Any, ...] = (ambient, ("training", module.training)) if module is not None else (ambient,)
    free = gc.free
    reads = free.part() if free.active else None
    if reads is not None:
        rest = (*rest, reads)
    if call.key[n:] != rest or node.key[1] != call.key:
        return  # (its key holds more than the tensors, the ambient state and the values read: a step, numbers)
    if old is None and len(hits) >= KEEP:  # (the oldest goes; another thread calling it may have taken it)
        hits.pop(next(iter(hits), None), None)
    hit = FastHit(gc, tree, node, device, ambient, reads, 0)
    if old is not None and old.node() is not None and not old.settled():  # (else: a fresh start)
        hit.replaced = old.replaced + (not old.same_as(hit))  # (it missed: the Python path replayed another way)
        if hit.replaced > MAX_REPLACED:
            hits[sig] = _GAVE_UP
            return
    hits[sig] = hit
