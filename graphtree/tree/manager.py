"""The tree manager: one per (thread, device), and the state machine every graphed call goes through.

States of a call (the diagram is in ``DESIGN.md`` beside this file):

- **eager**: the call cannot be graphed (no CUDA, CPU inputs, autograd, a disabled function);
  it runs as plain PyTorch and ``stats()`` counts the reason.
- **warm-up**: the first call(s) of a function with a new signature run eagerly, with their
  memory in the tree's pool. Once a step has warmed up, the rest of that step warms up too.
- **record**: capture the function into a CUDA graph as a child of the current node, from the
  allocator state that node left behind (restored from its checkpoint if replays happened).
- **replay**: a child of the current node with the same function and signature, whose inputs
  are where it expects and whose assumptions about dead outputs still hold, is replayed.

A *step* (generation) is the unit of output lifetime: within one, calls walk down the tree and
every output stays valid. A step starts at the root on :func:`mark_step`, or (with no mark_step
ever) when a function already called in the step is called again. Held outputs of the previous
step are invalidated (reading one raises, saying so); an input that is one is cloned first.
"""

from __future__ import annotations

import contextlib
import gc as _collector
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType
from typing import Any, NoReturn

import torch

from graphtree import _native, _torch
from graphtree.tree.callee import Callee
from graphtree.tree.grow import Grower
from graphtree.tree.inputs import Call
from graphtree.tree.launch_order import LaunchOrder
from graphtree.tree.memory import TreeMemory
from graphtree.tree.node import Node, signature
from graphtree.tree.replay_error import explain, is_cuda_error
from graphtree.tree.state_epoch import param_epoch, param_epoch_cell
from graphtree.tree.stats import Counters, Stats, log, untreed
from graphtree.tree.walk import Walk

MAX_PATH_DEPTH = 64
"""Calls in one step before graphtree starts a new step by itself (guards a missing mark_step)."""

_tls = threading.local()
_EPOCH_CELL = param_epoch_cell()  # (the parameter epoch, read on a module's replay as fast_hit.py reads it)
_all_managers: weakref.WeakSet[TreeManager] = weakref.WeakSet()
_registry_lock = threading.Lock()
# Ids of graphed callables collected (appended by their finalizers, from any thread: a list append
# needs no lock); each tree prunes their recordings at its next step.
_collected: list[int] = []


def forget(gc_id: int) -> None:
    """A graphed callable was garbage-collected: its recordings go at each tree's next step."""
    _collected.append(gc_id)


def collected_ids() -> list[int]:
    """The ids of the graphed callables collected so far (the list itself: it only grows); a tree
    whose ``_collected_seen`` is its length has none to prune (what a fast hit's native step reads)."""
    return _collected


# --- the calling thread's trees ---------------------------------------------------------------------
def tree_for(device: int) -> TreeManager:
    """The calling thread's tree on ``device`` (created on first use)."""
    managers = getattr(_tls, "managers", None)
    if managers is None:
        managers = _tls.managers = {}
    if device in managers:
        found: TreeManager = managers[device]
        return found
    m = managers[device] = TreeManager(device, user_steps=getattr(_tls, "user_steps", False))
    with _registry_lock:
        _all_managers.add(m)
    return m


def run(gc: Callee, call: Call, device: int) -> Any:
    """Run ``call`` of ``gc`` in the calling thread's tree on ``device``."""
    try:
        tree = _tls.managers[device]
    except (AttributeError, KeyError):
        tree = tree_for(device)
    return tree.call(gc, call)


def explain_fault_before_replay(e: RuntimeError, name: str, debug: str | None) -> RuntimeError:
    """``e`` itself, or, for a CUDA error raised before ``name``'s replay began (while its inputs
    were copied for ``debug=``), one that names the recording this thread's trees ran last."""
    if not is_cuda_error(e):
        return e
    previous = next((s for m in getattr(_tls, "managers", {}).values() if (s := m.last_signature())), None)
    during = f"before graphtree replayed {name} (while copying its inputs for its debug dump)"
    return explain(e, recording=name, previous=previous, debug_dir=debug, during=during)


def tree_here(device: int) -> tuple[TreeManager | None, bool]:
    """The calling thread's tree on ``device``, if it has one, and whether a call of this thread may
    start a step by itself (not inside :func:`one_step`)."""
    here = _tls.__dict__
    managers: dict[int, TreeManager] | None = here.get("managers")
    return (managers.get(device) if managers is not None else None), not here.get("one_step", 0)


def thread_state() -> threading.local:
    """The threads' own state: ``managers`` (device -> tree) and ``one_step`` in each thread's
    ``__dict__`` (the native fast replay reads them as :func:`tree_here` does)."""
    return _tls


@contextlib.contextmanager
def one_step() -> Iterator[dict[int, int] | None]:
    """Calls in the block (this thread's) start no step by themselves: a function called twice keeps
    its first output (a module graphed in parts: tree/parts.py); past ``MAX_PATH_DEPTH`` calls in a
    step they run eagerly instead, but collective ones (ranks decide alike). :func:`mark_step` still
    starts steps. Yields each tree's path length, for :func:`step_outputs` (None when nested)."""
    depth = _tls.__dict__.get("one_step", 0)
    _tls.one_step = depth + 1
    try:
        yield None if depth else {d: len(m.walk.path) for d, m in getattr(_tls, "managers", {}).items()}
    finally:
        _tls.one_step = depth


def begin_internal_step() -> None:
    """Start a new step in the calling thread's trees without turning off automatic steps."""
    for m in getattr(_tls, "managers", {}).values():
        m.walk.step_requested = True


class TreeManager:
    """A tree of recordings on one device for one thread, with its memory pool: where a call replays
    (:meth:`call`), and where it warms up or records instead (:class:`~graphtree.tree.grow.Grower`)."""

    # (slots: the native fast hit reads them at their offsets, graphtree/_native/fast_hit.h)
    __slots__ = (
        "__weakref__", "_collected_seen", "check", "counters", "device", "grow", "hit", "lock", "memory", "order",
        "thread", "user_steps", "walk", "warmed",
    )  # fmt: skip

    def __init__(self, device: int, user_steps: bool = False) -> None:
        self.device = device
        self.lock = threading.RLock()  # against reset() from another thread; eager fallbacks may re-enter
        self.thread = threading.current_thread().name
        self.counters = Counters()
        self.check = _torch.data_ptrs_checker()  # until the native helpers are ready (_replayable)
        _native.start()
        self.user_steps = user_steps  # mark_step() was called: no automatic steps
        # Warm-up runs per (graphed function, signature). Kept per tree, so per thread and device:
        # lazy initialisation (cuBLAS handles, workspaces) is per thread and per device.
        self.warmed: dict[tuple[int, Any], int] = {}
        self.walk = Walk()
        self.memory = TreeMemory(device)
        self.grow = Grower(device, self.walk, self.memory, self.counters, self.warmed)
        self.order = LaunchOrder(device)  # a call on another stream waits for the last one's
        self._collected_seen = len(_collected)
        self.hit: Node | None = None  # the node the last call replayed on the hot path

    def pool_bytes(self) -> int:
        """Bytes the tree's pool holds on the device (0 before the first recording)."""
        return self.memory.reserved_bytes()

    def pool_breakdown(self) -> str:
        """Where the pool's bytes go (:meth:`Pool.breakdown`), or "" before the first recording."""
        return self.memory.breakdown()

    # --- the entry point -----------------------------------------------------------------
    def call(self, gc: Callee, call: Call) -> Any:
        """Run one call of ``gc``: replay, warm up or record, as the state machine says."""
        with self.lock:
            self.hit = None
            walk = self.walk
            if len(walk.path) >= MAX_PATH_DEPTH and _tls.__dict__.get("one_step", 0) and gc.lockstep() is None:
                return gc.run_eager(call, _DEEP.format(n=MAX_PATH_DEPTH))  # (no step mid-call: one_step)
            leaves = call.leaves
            if (
                walk.step_requested
                or (not self.user_steps and gc.id in walk.called and not _tls.__dict__.get("one_step", 0))
                or len(walk.path) >= MAX_PATH_DEPTH
            ):
                if len(walk.path) >= MAX_PATH_DEPTH and not walk.step_requested:
                    log.warning(_NO_STEP, MAX_PATH_DEPTH)
                leaves = call.leaves = self.new_step(leaves)
            walk.called.add(gc.id)
            self.order.follow()
            if not walk.warming:
                kids = walk.current.children.get((gc.id, call.key))
                if kids:
                    node: Node | None  # None: no recording at this place fits
                    node = kids[0]
                    if not node.unconditional:  # something to check first (see Node.can_replay)
                        # A module's recording: only its parameters and buffers to check, in one
                        # native call when the helpers are built; anything else, or a miss, looks
                        # through every recording at this place.
                        native = _native.loaded
                        if not (
                            node.statics_only
                            and native is not None
                            and node.epoch == _EPOCH_CELL[0]  # (param_epoch(), read without its frame)
                            and native.addresses_unchanged(node.statics, node.static_packed)
                        ):
                            node = self._replayable(gc, kids, leaves)
                    if node is not None:  # the hot path: a recording that fits
                        if node.first is not None:  # it reads values on the host (tree/breaks.py)
                            reason = gc.verdicts.given_up.get(call.key)
                            if reason is not None:  # a read met too many values: eager from the start,
                                return gc.run_eager(call, reason)  # not after replaying what comes before it
                            return self._replay_segments(gc, call, node)
                        # Before the launch: a replay that raises after it has still written the pool.
                        self.memory.live = False
                        try:  # costs nothing unless it raises (Python 3.11+)
                            out = node.replay(leaves, call.n)
                        except RuntimeError as e:
                            self.raise_replay_error(gc, node, e)
                        walk.path.append(node)  # (walk.enter, inline on the hot path)
                        walk.current = node
                        self.counters.replays += 1
                        self.hit = node  # (what the callable's next call may replay again: tree/fast_hit.py)
                        return out
            reason = gc.verdicts.given_up.get(call.key)
            if reason is not None:
                return gc.run_eager(call, reason)
            warmed = self.warmed.get((gc.id, call.key), 0)
            warm = walk.warming or warmed < gc.warmup or gc.free.warms_up(warmed)
            if gc.lockstep() is not None:  # it calls collectives: its ranks start alike (tree/lockstep.py)
                return self.grow.start_together(gc, call, warm)
            if warm:
                if gc.churn.skip(call.key, call.tensors()):  # signatures keep changing: eager, without the checks
                    return gc.run_eager(call, gc.churn.reason(gc.name))
                return self.grow.warm_up(gc, call)
            return self.grow.record(gc, call)

    def _replay_segments(self, gc: Callee, call: Call, node: Node) -> Any:
        """Replay a recording broken at host reads (:mod:`graphtree.tree.breaks`): its segments for
        the values read, or, at a value never read there before, record the rest of the call."""
        self.memory.live = False
        try:
            leaf, read = node.run_segments(call.leaves, call.n)
            if leaf is not None:
                out = leaf.hand_out(call.leaves, call.n)
        except RuntimeError as e:
            self.raise_replay_error(gc, node, e)
        if leaf is None:
            return self.grow.record_value(gc, call, read)
        self.walk.enter(leaf)
        self.counters.replays += 1
        return out

    def raise_replay_error(self, gc: Callee, node: Node, e: RuntimeError) -> NoReturn:
        """Raise ``e`` as it came, or, for a CUDA error, one (from ``e``) that names the recording,
        the graph replayed before it, and how to find the kernel (:mod:`graphtree.tree.replay_error`)."""
        if not is_cuda_error(e):
            raise e
        debug = None if gc.options.debug is None else str(gc.options.debug)
        raise explain(e, recording=signature(node), previous=self.last_signature(), debug_dir=debug) from e

    def last_signature(self) -> str | None:
        """The signature of the recording this tree ran last (in this step or the one before)."""
        node = self.walk.path[-1] if self.walk.path else self.walk.last_replayed
        return signature(node) if node is not None else None

    # --- steps ----------------------------------------------------------------------------
    def request_step(self) -> None:
        self.user_steps = True
        self.walk.step_requested = True

    def new_step(self, leaves: Sequence[Any]) -> Sequence[Any]:
        """Go back to the root (outputs of the step that ends invalidated, :meth:`Walk.end_step`);
        drop the recordings of graphed callables collected since the last step."""
        leaves = self.walk.end_step(leaves)
        if len(_collected) != self._collected_seen:
            self._prune_collected()
        return leaves

    def _prune_collected(self) -> None:
        """Drop the recordings of graphed callables that were garbage-collected (with everything
        recorded under them), at the start of a step: their outputs were invalidated as it began.
        A tree left empty gives its pool back to the caching allocator."""
        n = len(_collected)
        dead = set(_collected[self._collected_seen : n])
        self._collected_seen = n
        self.walk.prune(dead)
        for key in [k for k in self.warmed if k[0] in dead]:
            del self.warmed[key]
        if not self.walk.root.children and not self.walk.retired and self.memory.has_pool:
            self.memory.release()

    # --- replay ---------------------------------------------------------------------------
    def _replayable(self, gc: Callee, kids: list[Node], leaves: Sequence[Any]) -> Node | None:
        """The first recording among ``kids`` that can be replayed for these inputs, if any."""
        epoch = param_epoch()
        native = _native.loaded
        check = native.ptrs_equal if native is not None else self.check
        path = self.walk.path
        for node in kids:
            if node.epoch != epoch:
                now = gc.static_tensors()
                if len(now) != len(node.statics) or any(a is not b for a, b in zip(now, node.statics)):
                    continue
                node.epoch = epoch
            if node.first is not None:  # a broken recording: every value's recording must fit
                if all(n.can_replay(leaves, path, check, native) for n in node.first.leaves):
                    return node
            elif node.unconditional or node.can_replay(leaves, path, check, native):
                return node
        return self._adopting(kids, leaves, check, native)

    def _adopting(
        self, kids: list[Node], leaves: Sequence[Any], check: Callable[..., bool], native: ModuleType | None
    ) -> Node | None:
        """The first recording among ``kids`` that fits once the object tensors that moved (a fresh
        cache) are adopted into the storages it keeps; adopts them (:mod:`graphtree.tree.adoption`)."""
        epoch = param_epoch()
        path = self.walk.path
        for node in kids:
            if node.adoption is None or node.epoch != epoch:
                continue
            values = node.first.leaves if node.first is not None else [node]
            if all(n.can_adopt(leaves, path, check, native) for n in values):
                node.adoption.adopt(leaves)
                if all(n.can_replay(leaves, path, check, native) for n in values):
                    self.counters.adopted += 1
                    return node
        return None

    # --- reporting and reset ----------------------------------------------------------------
    def kept_storages(self) -> dict[int, int]:
        """The storages this tree's recordings keep for later objects of their layout
        (:mod:`graphtree.tree.adoption`), by StorageImpl address, with their sizes in bytes."""
        with self.lock:
            return {
                _torch.storage_ref(k.storage): k.storage.nbytes()
                for n in self.walk.nodes()
                if n.adoption is not None
                for k in n.adoption.kept
            }

    def nodes(self) -> list[Node]:
        """Every recording of the tree."""
        return self.walk.nodes()

    def reset(self) -> None:
        """Drop every recording (:meth:`drop`), start the counters again and give the pool's memory back."""
        with self.lock:
            self.drop("graphtree.reset() was called")
            self.user_steps = False
            self.counters = self.grow.counters = Counters()  # (whole: stats() reads it without the lock)
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def drop(self, why: str, wait: float = -1) -> bool:
        """Invalidate held outputs (saying ``why``) and drop every recording, without waiting for the
        device; False when another thread held the tree for ``wait`` seconds (-1: however long)."""
        if not self.lock.acquire(timeout=wait):
            return False
        try:
            for r, msg in self.walk.held_outputs():
                _torch.invalidate_storage(r, msg.replace("a new step began", why))
            self.walk.clear()
            self.hit = None
            self.memory.release()
            self.warmed.clear()  # (a group torn down mid-program: its next calls warm up again, agreeing)
            _collector.collect()  # dropped recordings link to each other: only the collector frees them (and the pool)
        finally:
            self.lock.release()
        return True


_NO_STEP = "graphtree: %d calls without a new step; starting one (call graphtree.mark_step() once per iteration)"
_DEEP = "more than {n} graphed calls in a step, in a call of a module graphed in parts: the rest run eagerly"


def managers() -> list[TreeManager]:
    """Every tree of every thread (for :func:`stats` and :func:`graphtree.describe`)."""
    with _registry_lock:
        return list(_all_managers)


# --- module-level API -----------------------------------------------------------------------
def mark_step() -> None:
    """Begin a new step (iteration) in the calling thread's trees.

    Outputs of earlier steps may then be overwritten by the next replay; reading one that was
    raises a ``RuntimeError`` saying so. Once called, graphtree stops starting steps by itself,
    so calls between two ``mark_step()`` keep all their outputs.

    Example::

        for batch in loader:
            graphtree.mark_step()
            loss = step(batch)
    """
    _tls.user_steps = True
    for m in getattr(_tls, "managers", {}).values():
        m.request_step()


def reset() -> None:
    """Drop every recording of every tree and free their memory pools.

    Outputs still held are invalidated (reading them raises). Counters restart from zero, and
    the calling thread goes back to automatic steps until it calls :func:`mark_step` again.

    Example::

        graphtree.reset()
    """
    _tls.user_steps = False
    for m in managers():
        m.reset()
    untreed.clear()


def step_outputs(since: dict[int, int]) -> set[int]:
    """The storages (``StorageImpl`` addresses) of held outputs of recordings this thread's trees ran
    after ``since`` (path lengths by device, from :func:`one_step`) or retired (a failed capture)."""
    held: set[int] = set()
    for d, m in getattr(_tls, "managers", {}).items():
        held |= m.walk.held_since(since.get(d, 0))
    return held


def stats() -> Stats:
    """Counters of recordings, replays, warm-ups and eager runs (by reason), and pool bytes.

    Example::

        print(graphtree.stats())
    """
    s = Stats(cuda=torch.cuda.is_available())
    if not s.cuda:
        s.note = "no CUDA: graphed functions run eagerly"
    untreed.add_to(s)
    kept: dict[int, int] = {}
    for m in managers():
        m.counters.add_to(s)
        s.trees += 1
        s.pool_bytes += m.pool_bytes()
        kept.update(m.kept_storages())
    s.kept_bytes = sum(kept.values())
    return s
