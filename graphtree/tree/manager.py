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

from graphtree import _native, _streams, _torch
from graphtree.tree import recorder
from graphtree.tree.adoption import adopt_orphans, release_oldest_orphans
from graphtree.tree.breaks import Segment
from graphtree.tree.callee import Callee
from graphtree.tree.capture import CaptureFailed
from graphtree.tree.inputs import Call, param_epoch
from graphtree.tree.launch_order import LaunchOrder
from graphtree.tree.lockstep import Vote, environment_problem
from graphtree.tree.node import Node, Root, below, drop_subtree, signature
from graphtree.tree.pool import Pool
from graphtree.tree.replay_error import explain, is_cuda_error
from graphtree.tree.stats import Counters, Stats, log, log_fallback

MAX_PATH_DEPTH = 64
"""Calls in one step before graphtree starts a new step by itself (guards a missing mark_step)."""

_tls = threading.local()
_all_managers: weakref.WeakSet[TreeManager] = weakref.WeakSet()
_registry_lock = threading.Lock()
_untreed = Counters()  # calls that never reached a tree (eager ones; a module's under autograd)
# Ids of graphed callables collected (appended by their finalizers, from any thread: a list append
# needs no lock); each tree prunes their recordings at its next step.
_collected: list[int] = []


def forget(gc_id: int) -> None:
    """A graphed callable was garbage-collected: its recordings go at each tree's next step."""
    _collected.append(gc_id)


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


def count_eager(name: str, reason: str) -> None:
    """Count (and log once) a call that ran eagerly before reaching any tree."""
    _untreed.eager[reason] += 1
    log_fallback(name, reason)


def count_untreed(what: str) -> None:
    """Count a warm-up, recording or replay (``what``) made outside the trees (tree/module_training.py)."""
    setattr(_untreed, what, getattr(_untreed, what) + 1)


def explain_fault_before_replay(e: RuntimeError, name: str, debug: str | None) -> RuntimeError:
    """``e`` itself, or, for a CUDA error raised before ``name``'s replay began (while its inputs
    were copied for ``debug=``), one that names the recording this thread's trees ran last."""
    if not is_cuda_error(e):
        return e
    previous = next((s for m in getattr(_tls, "managers", {}).values() if (s := m.last_signature())), None)
    during = f"before graphtree replayed {name} (while copying its inputs for its debug dump)"
    return explain(e, recording=name, previous=previous, debug_dir=debug, during=during)


@contextlib.contextmanager
def one_step() -> Iterator[dict[int, int] | None]:
    """Calls in the block (this thread's) start no step by themselves: a function called twice keeps
    its first output (a module graphed in parts: tree/parts.py); past ``MAX_PATH_DEPTH`` calls in a
    step they run eagerly instead, but collective ones (ranks decide alike). :func:`mark_step` still
    starts steps. Yields each tree's path length, for :func:`step_outputs` (None when nested)."""
    depth = _tls.__dict__.get("one_step", 0)
    _tls.one_step = depth + 1
    try:
        yield None if depth else {d: len(m.path) for d, m in getattr(_tls, "managers", {}).items()}
    finally:
        _tls.one_step = depth


def begin_internal_step() -> None:
    """Start a new step in the calling thread's trees without turning off automatic steps."""
    for m in getattr(_tls, "managers", {}).values():
        m.step_requested = True


class TreeManager:
    """A tree of recordings on one device for one thread, with its memory pool."""

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
        self._pool: Pool | None = None
        self._stream: torch.cuda.Stream | None = None
        self.order = LaunchOrder(device)  # a call on another stream waits for the last one's
        self._collected_seen = len(_collected)
        self._clear()

    def _clear(self) -> None:
        self.root = Root()
        self.current: Node | Root = self.root
        self.path: list[Node] = []
        self.last_replayed: Node | None = None  # the last node of an ended step (see replay_error)
        self.generation = 0
        self.step_requested = False
        self.warming = False
        self.bookkeeping_live = True  # the allocator's view of the pool is exact
        self.called: set[int] = set()  # graphed functions called in this step
        # Trees given up after a failed capture, kept until the step ends: their outputs may still
        # be held. (torch leaves a pool it failed to capture into unable to take another capture.)
        self.retired: list[tuple[Pool | None, list[Node]]] = []

    @property
    def pool(self) -> Pool:
        if self._pool is None:
            self._pool = Pool(self.device)
            self._pool.root_state()
        return self._pool

    @property
    def stream(self) -> torch.cuda.Stream:
        if self._stream is None:  # (its own: torch's pooled streams repeat, graphtree/_streams.py)
            self._stream = _streams.own_stream(self.device)
            weakref.finalize(self, _streams.give_back, self._stream)
        return self._stream

    def pool_bytes(self) -> int:
        """Bytes the tree's pool holds on the device (0 before the first recording)."""
        return self._pool.reserved_bytes() if self._pool is not None else 0

    def pool_breakdown(self) -> str:
        """Where the pool's bytes go (:meth:`Pool.breakdown`), or "" before the first recording."""
        return self._pool.breakdown() if self._pool is not None else ""

    # --- the entry point -----------------------------------------------------------------
    def call(self, gc: Callee, call: Call) -> Any:
        """Run one call of ``gc``: replay, warm up or record, as the state machine says."""
        with self.lock:
            if len(self.path) >= MAX_PATH_DEPTH and _tls.__dict__.get("one_step", 0) and gc.lockstep() is None:
                return gc.run_eager(call, _DEEP.format(n=MAX_PATH_DEPTH))  # (no step mid-call: one_step)
            leaves = call.leaves
            if (
                self.step_requested
                or (not self.user_steps and gc.id in self.called and not _tls.__dict__.get("one_step", 0))
                or len(self.path) >= MAX_PATH_DEPTH
            ):
                if len(self.path) >= MAX_PATH_DEPTH and not self.step_requested:
                    log.warning(_NO_STEP, MAX_PATH_DEPTH)
                leaves = call.leaves = self._new_step(leaves)
            self.called.add(gc.id)
            self.order.follow()
            if not self.warming:
                kids = self.current.children.get((gc.id, call.key))
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
                            and node.epoch == param_epoch()
                            and native.addresses_unchanged(node.statics, node.static_packed)
                        ):
                            node = self._replayable(gc, kids, leaves)
                    if node is not None:  # the hot path: a recording that fits
                        if node.first is not None:  # it reads values on the host (tree/breaks.py)
                            reason = gc.given_up.get(call.key)
                            if reason is not None:  # a read met too many values: eager from the start,
                                return gc.run_eager(call, reason)  # not after replaying what comes before it
                            return self._replay_segments(gc, call, node)
                        # Before the launch: a replay that raises after it has still written the pool.
                        self.bookkeeping_live = False
                        try:  # costs nothing unless it raises (Python 3.11+)
                            out = node.replay(leaves, call.n)
                        except RuntimeError as e:
                            self._raise_replay_error(gc, node, e)
                        self.path.append(node)
                        self.current = node
                        self.counters.replays += 1
                        return out
            reason = gc.given_up.get(call.key)
            if reason is not None:
                return gc.run_eager(call, reason)
            warmed = self.warmed.get((gc.id, call.key), 0)
            warm = self.warming or warmed < gc.warmup or gc.free.warms_up(warmed)
            if gc.lockstep() is not None:  # it calls collectives: its ranks start alike (tree/lockstep.py)
                return self._start_together(gc, call, warm)
            if warm:
                if gc.churn.skip(call.key):  # signatures keep changing: eager, without the checks
                    return gc.run_eager(call, gc.churn.reason(gc.name))
                return self._warm_up(gc, call)
            return self._record(gc, call)

    def _start_together(self, gc: Callee, call: Call, warm: bool) -> Any:
        """A call of a function that calls collectives, which no recording replays: its ranks agree
        to warm up (if any would: one that warmed up another function earlier in its step does),
        to record, or to run it eagerly for good (one reached the re-record limit). The churn guard
        is off for such functions: it counts what one rank saw."""
        lockstep = gc.lockstep()
        assert lockstep is not None
        limit = None if warm else self._rerecord_limit(gc, len(self._alive_siblings((gc.id, call.key))))
        reason, anyone_warms = lockstep.agree("start", limit, again=warm)
        self.counters.agreements += 1
        if reason is not None:
            gc.give_up(call.key, reason)
            return gc.run_eager(call, reason)
        return self._warm_up(gc, call) if anyone_warms else self._record(gc, call)

    def _replay_segments(self, gc: Callee, call: Call, node: Node) -> Any:
        """Replay a recording broken at host reads (:mod:`graphtree.tree.breaks`): its segments for
        the values read, or, at a value never read there before, record the rest of the call."""
        self.bookkeeping_live = False
        try:
            leaf, read = node.run_segments(call.leaves, call.n)
            if leaf is not None:
                out = leaf.hand_out(call.leaves, call.n)
        except RuntimeError as e:
            self._raise_replay_error(gc, node, e)
        if leaf is None:
            return self._record_value(gc, call, read)
        self.path.append(leaf)
        self.current = leaf
        self.counters.replays += 1
        return out

    def _record_value(self, gc: Callee, call: Call, read: list[tuple[Segment, Any]]) -> Any:
        """The last value of ``read`` has no segment after it: record the call on from there, or,
        past the limit of values at that read, run it eagerly for good."""
        seg, _value = read[-1]
        if len(seg.next) >= gc.max_break_values:
            assert seg.read is not None
            reason = (
                f"`{gc.name}` read more than {gc.max_break_values} different values at {seg.read.where}: "
                f"each needs recordings of its own (raise graphed(..., max_break_values=) if they are few)"
            )
            gc.give_up(call.key, reason)  # later calls run eagerly from the start
            if not any(s.changes_state for s, _ in read):
                return gc.run_eager(call, reason)
            # The segments just replayed wrote state the call did not make (an input or a cache in
            # place, an eager part): running the call again eagerly would do that twice. This one
            # call is finished by recording its value, as below; it is the last.
        self.counters.values += 1
        return self._record(gc, call, prefix=read)

    def _raise_replay_error(self, gc: Callee, node: Node, e: RuntimeError) -> NoReturn:
        """Raise ``e`` as it came, or, for a CUDA error, one (from ``e``) that names the recording,
        the graph replayed before it, and how to find the kernel (:mod:`graphtree.tree.replay_error`)."""
        if not is_cuda_error(e):
            raise e
        debug = None if gc.debug is None else str(gc.debug)
        raise explain(e, recording=signature(node), previous=self.last_signature(), debug_dir=debug) from e

    def last_signature(self) -> str | None:
        """The signature of the recording this tree ran last (in this step or the one before)."""
        node = self.path[-1] if self.path else self.last_replayed
        return signature(node) if node is not None else None

    # --- steps ----------------------------------------------------------------------------
    def request_step(self) -> None:
        self.user_steps = True
        self.step_requested = True

    def _held_outputs(self) -> list[tuple[int, str]]:
        """(weak ref, message) of every output of this step the caller still holds."""
        held = _held_in(self.path)
        for _pool, path in self.retired:
            held.extend(_held_in(path))
        return held

    def _new_step(self, leaves: Sequence[Any]) -> Sequence[Any]:
        """Go back to the root; invalidate outputs of the step that ends (cloning inputs among them)."""
        held: list[tuple[int, str]] = []  # invalidated below; the weak refs of the path's are freed too
        for node in self.path:
            node.release_outputs(held)
        release = [r for r, _ in held]
        if self.retired:  # their nodes release their own refs when they are dropped
            for _pool, path in self.retired:
                held.extend(_held_in(path))
            self.retired = []
        if held:
            doomed = {r for r, _ in held}
            for i, x in enumerate(leaves):
                if isinstance(x, torch.Tensor) and _torch.storage_id(x) in doomed:
                    leaves = list(leaves)
                    leaves[i] = x.clone()
            for r, msg in held:
                _torch.invalidate_storage(r, msg)
            for r in release:
                _torch.weak_free(r)
        if self.path:
            self.last_replayed = self.path[-1]
        self.path = []
        self.current = self.root
        self.warming = False
        self.called.clear()
        self.step_requested = False
        self.generation += 1
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
        stack: list[Node | Root] = [self.root]
        while stack:
            parent = stack.pop()
            for key in [k for k in parent.children if k[0] in dead]:
                for node in parent.children.pop(key):
                    drop_subtree(node)
            stack.extend(below(parent))
        self.warmed = {k: v for k, v in self.warmed.items() if k[0] not in dead}
        if self.last_replayed is not None and self.last_replayed.key[0] in dead:
            self.last_replayed = None
        if not self.root.children and not self.retired and self._pool is not None:
            self._pool = None
            self.bookkeeping_live = True

    def _retire_pool(self, quiet: bool = False) -> None:
        """Move to a fresh pool and an empty tree; keep the old ones until this step ends."""
        self.retired.append((self._pool, self.path))
        self._pool = None
        self.root = Root()
        self.current = self.root
        self.path = []
        self.bookkeeping_live = True
        (log.info if quiet else log.warning)(
            "graphtree: a capture failed on cuda:%d; recordings start again in a new memory pool", self.device
        )

    # --- replay ---------------------------------------------------------------------------
    def _replayable(self, gc: Callee, kids: list[Node], leaves: Sequence[Any]) -> Node | None:
        """The first recording among ``kids`` that can be replayed for these inputs, if any."""
        epoch = param_epoch()
        native = _native.loaded
        check = native.ptrs_equal if native is not None else self.check
        for node in kids:
            if node.epoch != epoch:
                now = gc.static_tensors()
                if len(now) != len(node.statics) or any(a is not b for a, b in zip(now, node.statics)):
                    continue
                node.epoch = epoch
            if node.first is not None:  # a broken recording: every value's recording must fit
                if all(n.can_replay(leaves, self.path, check, native) for n in node.first.leaves):
                    return node
            elif node.unconditional or node.can_replay(leaves, self.path, check, native):
                return node
        return self._adopting(kids, leaves, check, native)

    def _adopting(
        self, kids: list[Node], leaves: Sequence[Any], check: Callable[..., bool], native: ModuleType | None
    ) -> Node | None:
        """The first recording among ``kids`` that fits once the object tensors that moved (a fresh
        cache) are adopted into the storages it keeps; adopts them (:mod:`graphtree.tree.adoption`)."""
        epoch = param_epoch()
        for node in kids:
            if node.adoption is None or node.epoch != epoch:
                continue
            values = node.first.leaves if node.first is not None else [node]
            if all(n.can_adopt(leaves, self.path, check, native) for n in values):
                node.adoption.adopt(leaves)
                if all(n.can_replay(leaves, self.path, check, native) for n in values):
                    self.counters.adopted += 1
                    return node
        return None

    # --- keeping the allocator honest -------------------------------------------------------
    def _sync_bookkeeping(self) -> None:
        """Restore the pool's bookkeeping to the current node's checkpoint if replays moved on."""
        if self.bookkeeping_live:
            return
        node = self.current
        if isinstance(node, Root):
            self.pool.restore(self.pool.root_state(), [], [])
        else:
            live: list[int] = []
            dead: set[int] = set()
            for d, g in node.alive_at_checkpoint:
                owner = self.path[d]
                if owner.is_held(g):
                    live.append(owner.refs[g])
                    owner.drop_base()  # the storage gets a deleter: only the caller may keep it
                else:
                    dead.add(owner.outputs.groups[g].ptr)
            self.pool.restore(node.checkpoint, live, sorted(dead))
        self.bookkeeping_live = True

    # --- warm-up and record -------------------------------------------------------------------
    def _warm_up(self, gc: Callee, call: Call) -> Any:
        self.warming = True
        self._sync_bookkeeping()  # (the warm-up's cuBLAS workspace comes from the pool)
        done = recorder.warm_up(gc, call, self.stream, self.device, self.pool)
        self.counters.warmups += 1
        gc.churn.warmed_up()
        key = (gc.id, call.key)
        give_up, again = done.give_up or gc.size_reason(done.ops), bool(done.kept or done.mutated) or done.compiled
        lockstep = gc.lockstep(done.groups)
        if lockstep is not None:  # it calls collectives: its ranks decide together (tree/lockstep.py)
            give_up, again = lockstep.agree("warm-up", give_up or environment_problem(), again)
            self.counters.agreements += 1
        if give_up:
            gc.give_up(call.key, give_up)
        elif again:  # it allocated state or filled a container (a cache, on first use), or compiled: again
            if gc.note_kept_state(call.key):
                gc.give_up(call.key, done.again_reason(gc.name, gc.free.kept_hint))
        else:
            self.warmed[key] = self.warmed.get(key, 0) + 1
        return done.out

    def _record(self, gc: Callee, call: Call, prefix: list[tuple[Segment, Any]] | None = None) -> Any:
        self._sync_bookkeeping()
        key = (gc.id, call.key)
        siblings = [] if prefix else self._alive_siblings(key)  # a new value's recording is no re-recording
        reason = None if prefix else self._rerecord_limit(gc, len(siblings))
        if reason is not None:  # (for a function that calls collectives, agreed in _start_together)
            gc.give_up(call.key, reason)
            return gc.run_eager(call, reason)
        lockstep = gc.lockstep()  # every rank keeps its capture, or none does (tree/lockstep.py)
        captured = Vote(lockstep, "capture") if lockstep is not None else None
        if not prefix:  # object tensors into memory the callable's other recordings keep (tree/adoption.py)
            others = [
                n.adoption
                for n in sorted(self.nodes(), key=_age)
                if n.key[0] == gc.id and n.key != key and n.adoption is not None
            ]
            if others:  # (released first: a storage adopted below is held by this call's object)
                release_oldest_orphans(others)  # a cache's worth each: the newest few stay
                adopt_orphans(call.leaves, call.n_args, others)
        try:
            node, out = recorder.record(
                gc,
                call,
                parent=self.current,
                path=self.path,
                pool=self.pool,
                stream=self.stream,
                device=self.device,
                prefix=prefix,
                captured=captured,
            )
        except CaptureFailed as e:
            if captured is not None:
                if not captured.cast:  # the other ranks learn that this one failed
                    captured(str(e))
                self.counters.agreements += 1
            elif e.again and gc.may_record_again(call.key):  # (compiled in the capture: warm it up again)
                self.warmed.pop(key, None)
                return gc.run_eager(call, str(e))
            gc.give_up(call.key, str(e))
            if e.pool_tainted:
                self._retire_pool()
            if e.has_result:  # the capture ran the call whole: running it again would repeat its side effects
                count_eager(gc.name, str(e))
                return e.result
            if prefix and any(seg.changes_state for seg, _ in prefix):
                log.warning(
                    "graphtree: `%s`: recording a new value failed after the replay of the part before "
                    "the read had written state in place; the eager run now writes it again (%s)",
                    gc.name,
                    e,
                )
            return gc.run_eager(call, str(e))
        except BaseException:
            # The function's own error (or an out-of-memory, Ctrl-C, an error of graphtree's): it
            # reaches the caller unchanged. Its traceback may keep tensors the capture allocated in
            # the pool alive, which no checkpoint knows: recordings go on in a fresh pool.
            self._retire_pool(quiet=True)
            raise
        gc.churn.recorded()
        if captured is not None:
            self.counters.agreements += 1
        if siblings:
            self.counters.rerecordings += 1
        if not prefix:  # (a new value's recording is found through the first segment it shares)
            self.current.children.setdefault(key, []).append(node)
        self.path.append(node)
        self.current = node
        self.counters.recordings += 1
        return out

    @staticmethod
    def _rerecord_limit(gc: Callee, n: int) -> str | None:
        """The reason not to record a call again where ``n`` live recordings of it are, or None."""
        if n <= gc.max_rerecords:
            return None
        return (
            f"re-record limit reached: recorded {n} times at the same place "
            f"(in-place inputs or parameters keep moving, or held outputs keep changing)"
        )

    def _alive_siblings(self, key: Any) -> list[Node]:
        """The recordings of ``key`` under the current node, dropping dead ones (see
        :meth:`Node.dead_reason`): they are replaced without counting as re-recordings, and the
        new recording reuses their memory (it starts from the same checkpoint)."""
        kids = self.current.children.get(key)
        if not kids:
            return []
        alive = [n for n in kids if n.dead_reason() is None]
        if len(alive) < len(kids):
            self.counters.replaced += len(kids) - len(alive)
            self.current.children[key] = alive
        return alive

    # --- reporting and reset ----------------------------------------------------------------
    def kept_storages(self) -> dict[int, int]:
        """The storages this tree's recordings keep for later objects of their layout
        (:mod:`graphtree.tree.adoption`), by StorageImpl address, with their sizes in bytes."""
        with self.lock:
            return {
                _torch.storage_ref(k.storage): k.storage.nbytes()
                for n in self.nodes()
                if n.adoption is not None
                for k in n.adoption.kept
            }

    def nodes(self) -> list[Node]:
        """Every recording of the tree."""
        out: list[Node] = []
        stack: list[Node | Root] = [self.root]
        while stack:
            kids = below(stack.pop())
            out.extend(kids)
            stack.extend(kids)
        return out

    def reset(self) -> None:
        """Drop every recording (:meth:`drop`), start the counters again and give the pool's memory back."""
        with self.lock:
            self.drop("graphtree.reset() was called")
            self.user_steps = False
            self.counters = Counters()
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def drop(self, why: str, wait: float = -1) -> bool:
        """Invalidate held outputs (saying ``why``) and drop every recording, without waiting for the
        device; False when another thread held the tree for ``wait`` seconds (-1: however long)."""
        if not self.lock.acquire(timeout=wait):
            return False
        try:
            for r, msg in self._held_outputs():
                _torch.invalidate_storage(r, msg.replace("a new step began", why))
            self._clear()
            self._pool = None
            self.warmed = {}  # (a group torn down mid-program: its next calls warm up again, agreeing)
            _collector.collect()  # dropped recordings link to each other: only the collector frees them (and the pool)
        finally:
            self.lock.release()
        return True


def _age(node: Node) -> int:
    """The order in which recordings were made (their ids count up: "n1", "n2", ...)."""
    return int(node.id[1:])


def _held_in(path: list[Node]) -> list[tuple[int, str]]:
    """(weak ref, message) of the outputs of ``path`` the caller still holds."""
    return [pair for node in path for pair in node.held_outputs()]


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
    _untreed.__init__()  # type: ignore[misc]


def step_outputs(since: dict[int, int]) -> set[int]:
    """The storages (``StorageImpl`` addresses) of held outputs of recordings this thread's trees ran
    after ``since`` (path lengths by device, from :func:`one_step`) or retired (a failed capture)."""
    held: set[int] = set()
    for d, m in getattr(_tls, "managers", {}).items():
        start = since.get(d, 0)
        held.update(r for r, _ in _held_in(m.path[start:] if start <= len(m.path) else m.path))
        held.update(r for _pool, path in m.retired for r, _ in _held_in(path))
    return held


def stats() -> Stats:
    """Counters of recordings, replays, warm-ups and eager runs (by reason), and pool bytes.

    Example::

        print(graphtree.stats())
    """
    s = Stats(cuda=torch.cuda.is_available())
    if not s.cuda:
        s.note = "no CUDA: graphed functions run eagerly"
    _untreed.add_to(s)
    kept: dict[int, int] = {}
    for m in managers():
        m.counters.add_to(s)
        s.trees += 1
        s.pool_bytes += m.pool_bytes()
        kept.update(m.kept_storages())
    s.kept_bytes = sum(kept.values())
    return s
