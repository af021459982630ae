"""The tree manager: one per (thread, device), and the state machine every graphed call goes through.

States of a call (see docs/design.md for the diagram):

- **eager**: the call cannot be graphed (no CUDA, CPU inputs, autograd, a disabled function);
  it runs as plain PyTorch and ``stats()`` counts the reason.
- **warm-up**: the first call(s) of a function with a new signature run eagerly, with their
  memory in the tree's pool. Once a step has warmed up, the rest of that step warms up too.
- **record**: capture the function into a CUDA graph as a child of the current node, from the
  allocator state that node left behind (restored from its checkpoint if replays happened).
- **replay**: a child of the current node with the same function and signature, whose inputs
  are where it expects and whose assumptions about dead outputs still hold, is replayed.

A *step* (generation) is the unit of output lifetime. Within a step, calls walk down the tree
and every output stays valid. A new step starts at the root: on :func:`mark_step`, or — while
the program never calls :func:`mark_step` — when a function already called in the current step
is called again (a loop iteration). Outputs of the previous step that are still held are then
invalidated: reading them raises an error that says so. Inputs of the new call that are such
outputs are cloned first, so feeding an output back in works.
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import TYPE_CHECKING, Any

import torch

from graphtree import _events, _torch
from graphtree.tree.inputs import CallInfo, InputPlan, is_marked_static, mutation_watch, unflatten
from graphtree.tree.capture import CaptureFailed, OpTracker, SyncWatch, clear_traceback, explain_capture_error
from graphtree.tree.node import Node
from graphtree.tree.outputs import OutputPlan, stale_message
from graphtree.tree.pool import Pool
from graphtree.tree.stats import Counters, Stats, log

if TYPE_CHECKING:
    from graphtree.tree.graphed import GraphedCallable

MAX_PATH_DEPTH = 64
"""Calls in one step before graphtree starts a new step by itself (guards a missing mark_step)."""

_tls = threading.local()
_all_managers: "weakref.WeakSet[TreeManager]" = weakref.WeakSet()
_registry_lock = threading.Lock()
untreed = Counters()  # eager runs that never reached a tree (no CUDA, CPU inputs, ...)

# Warm-ups and captures run one at a time across threads: they clear cuBLAS's workspaces, which
# are shared by all threads, and a capture must not see another thread's workspace vanish.
_capture_lock = threading.RLock()


def inside_user_code() -> bool:
    """Whether this thread is running a graphed function's warm-up or capture right now.

    Graphed functions called from there run inline: they become part of the outer recording.
    """
    return getattr(_tls, "inside", False)


class _Inside:
    def __enter__(self) -> None:
        _capture_lock.acquire()
        _tls.inside = True
        _torch.clear_cublas_workspaces()

    def __exit__(self, *exc: Any) -> None:
        try:
            _torch.clear_cublas_workspaces()
        finally:
            _tls.inside = False
            _capture_lock.release()

# Bumped whenever any nn.Module registers a parameter or buffer: a cheap signal that a
# recording's parameters may have been replaced (checked on replay with one int compare).
param_epoch = [0]


def _bump_epoch(*_: Any) -> None:
    param_epoch[0] += 1


torch.nn.modules.module.register_module_parameter_registration_hook(_bump_epoch)
torch.nn.modules.module.register_module_buffer_registration_hook(_bump_epoch)


def manager_for(device: int) -> "TreeManager":
    """The calling thread's tree on ``device`` (created on first use)."""
    managers = getattr(_tls, "managers", None)
    if managers is None:
        managers = _tls.managers = {}
    m = managers.get(device)
    if m is None:
        m = managers[device] = TreeManager(device, user_steps=getattr(_tls, "user_steps", False))
        with _registry_lock:
            _all_managers.add(m)
    return m


class TreeManager:
    """A tree of recordings on one device for one thread, with its memory pool."""

    def __init__(self, device: int, user_steps: bool = False) -> None:
        self.device = device
        self.torch_device = torch.device("cuda", device)
        self.lock = threading.RLock()
        self.thread = threading.current_thread().name
        self.counters = Counters()
        self.check = _torch.data_ptrs_checker()
        self.user_steps = user_steps  # mark_step() was called: no automatic steps
        # Warm-up runs per (graphed function, signature). Kept per tree, so per thread and device:
        # lazy initialisation (cuBLAS handles, workspaces) is per thread and per device.
        self.warmed: dict[tuple[int, Any], int] = {}
        self._pool: Pool | None = None
        self._stream: torch.cuda.Stream | None = None
        self._clear()

    def _clear(self) -> None:
        self.root = Node(None, "root", None, -1)
        self.current = self.root
        self.path: list[Node] = []
        self.generation = 0
        self.step_requested = False
        self.warming = False
        self.bookkeeping_live = True  # the allocator's view of the pool is exact
        self.called: set[int] = set()  # graphed functions called in this step
        self.warm_refs: list[tuple[int, str]] = []  # weak refs to pool outputs of warm-ups in this step
        # Trees given up after a failed capture, kept until the step ends: their outputs may still
        # be held. (torch leaves a pool it failed to capture into unable to take another capture.)
        self.retired: list[tuple[Pool | None, list[Node], list[tuple[int, str]]]] = []

    @property
    def pool(self) -> Pool:
        if self._pool is None:
            self._pool = Pool(self.device)
            self._pool.root_state()
        return self._pool

    @property
    def stream(self) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        return self._stream

    # --- the entry point -----------------------------------------------------------------
    def call(self, gc: "GraphedCallable", leaves: list[Any], spec: Any, info: CallInfo) -> Any:
        with self.lock:
            if self.step_requested or (not self.user_steps and gc.id in self.called) or len(self.path) >= MAX_PATH_DEPTH:
                if len(self.path) >= MAX_PATH_DEPTH and not self.step_requested:
                    log.warning(
                        "graphtree: %d calls without a new step; starting one (call "
                        "graphtree.mark_step() once per iteration)", MAX_PATH_DEPTH
                    )
                leaves = self._new_step(leaves)
            self.called.add(gc.id)
            if not self.warming:
                kids = self.current.children.get((gc.id, info.key))
                if kids:
                    node = kids[0]
                    if not node.unconditional:  # something to check first (see Node.can_replay)
                        node = self._replayable(gc, kids, leaves)
                    if node is not None:  # the hot path: a recording that fits
                        out = node.replay(leaves, info.n, self.torch_device)
                        self.path.append(node)
                        self.current = node
                        self.bookkeeping_live = False
                        self.counters.replays += 1
                        return out
            if self.warming or self.warmed.get((gc.id, info.key), 0) < gc.warmup:
                return self._warm_up(gc, leaves, spec, info)
            return self._record(gc, (gc.id, info.key), leaves, spec, info)

    # --- steps ----------------------------------------------------------------------------
    def request_step(self) -> None:
        self.user_steps = True
        self.step_requested = True

    def _held_outputs(self) -> list[tuple[int, str]]:
        """(weak ref, message) of every output of this step the caller still holds."""
        held = _held_in(self.path, self.warm_refs)
        for _pool, path, warm in self.retired:
            held.extend(_held_in(path, warm))
        return held

    def _new_step(self, leaves: list[Any]) -> list[Any]:
        """Go back to the root; invalidate outputs of the step that ends (cloning inputs among them)."""
        held: list[tuple[int, str]] = []
        release: list[int] = []  # weak refs to let go of once invalidated
        if self.retired:  # their nodes release their own refs when they are dropped
            for _pool, path, warm in self.retired:
                held.extend(_held_in(path, warm))
            self.retired = []
        expired, free = _torch.weak_expired, _torch.weak_free
        for node in self.path:
            refs = node.refs
            for g, r in enumerate(refs):
                if r:
                    if expired(r):
                        free(r)
                    else:
                        held.append((r, node.outputs.group_messages[g]))  # type: ignore[union-attr]
                        release.append(r)
                    refs[g] = 0
        if self.warm_refs:
            for r, msg in self.warm_refs:
                if expired(r):
                    free(r)
                else:
                    held.append((r, msg))
                    release.append(r)
            self.warm_refs = []
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
        self.path = []
        self.current = self.root
        self.warming = False
        self.called.clear()
        self.step_requested = False
        self.generation += 1
        return leaves

    def _retire_pool(self) -> None:
        """Move to a fresh pool and an empty tree; keep the old ones until this step ends."""
        self.retired.append((self._pool, self.path, self.warm_refs))
        self._pool = None
        self.root = Node(None, "root", None, -1)
        self.current = self.root
        self.path = []
        self.warm_refs = []
        self.bookkeeping_live = True
        log.warning(
            "graphtree: a capture failed on cuda:%d; recordings start again in a new memory pool", self.device
        )

    # --- replay ---------------------------------------------------------------------------
    def _replayable(self, gc: "GraphedCallable", kids: list[Node], leaves: list[Any]) -> Node | None:
        """The first recording among ``kids`` that can be replayed for these inputs, if any."""
        epoch = param_epoch[0]
        for node in kids:
            if node.epoch != epoch:
                now = gc.static_tensors()
                if len(now) != len(node.statics) or any(a is not b for a, b in zip(now, node.statics)):
                    continue
                node.epoch = epoch
            if node.unconditional or node.can_replay(leaves, self.path, self.check):
                return node
        return None

    # --- keeping the allocator honest -------------------------------------------------------
    def _sync_bookkeeping(self) -> None:
        """Restore the pool's bookkeeping to the current node's checkpoint if replays moved on."""
        if self.bookkeeping_live:
            return
        node = self.current
        if node is self.root:
            self.pool.restore(self.pool.root_state(), [], [])
        else:
            live: list[int] = []
            dead: set[int] = set()
            for d, g in node.alive_at_checkpoint:
                owner = self.path[d]
                if owner.is_held(g):
                    live.append(owner.refs[g])
                else:
                    dead.add(owner.outputs.groups[g][0])  # type: ignore[union-attr]
            self.pool.restore(node.checkpoint, live, sorted(dead))
        self.bookkeeping_live = True

    def _side_stream(self) -> torch.cuda.Stream:
        s = self.stream
        s.wait_stream(torch.cuda.current_stream(self.device))
        return s

    # --- warm-up --------------------------------------------------------------------------
    def _warm_up(self, gc: "GraphedCallable", leaves: list[Any], spec: Any, info: CallInfo) -> Any:
        self._sync_bookkeeping()
        self.warming = True
        copied = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and not is_marked_static(x)]
        watch = mutation_watch(leaves, copied)
        args, kwargs = unflatten(leaves, spec)
        stream = self._side_stream()
        tracker = OpTracker()
        sync = SyncWatch(tracker, gc.name)
        try:
            with _Inside(), torch.cuda.device(self.device), torch.cuda.stream(stream), self.pool.allocating():
                with sync, tracker, watch:
                    out = gc.fn(*args, **kwargs)
        finally:
            torch.cuda.current_stream(self.device).wait_stream(stream)
        self.counters.warmups += 1
        done = (gc.id, info.key)
        self.warmed[done] = self.warmed.get(done, 0) + 1
        if watch.written:
            gc.disable(_mutation_reason(watch.written))
        elif sync.found:
            gc.disable(sync.found)
        self._track_warm_outputs(gc, out, leaves)
        return out

    def _track_warm_outputs(self, gc: "GraphedCallable", out: Any, leaves: list[Any]) -> None:
        outs, _ = _torch.tree_flatten(out)
        inputs = {_torch.storage_id(x) for x in leaves if isinstance(x, torch.Tensor)}
        seen: set[int] = set()
        in_pool = self.pool.address_test()
        for j, t in enumerate(outs):
            if not isinstance(t, torch.Tensor) or t.device != self.torch_device:
                continue
            c = _torch.storage_id(t)
            if c in seen or c in inputs or not t.untyped_storage().nbytes():
                continue
            seen.add(c)
            if in_pool(t.untyped_storage().data_ptr()):
                where = f"{t.dtype} {list(t.shape)}, a warm-up run".replace("torch.", "")
                self.warm_refs.append((_torch.weak_ref(t.untyped_storage()), stale_message(gc.name, [j], where)))

    # --- record ---------------------------------------------------------------------------
    def _record(self, gc: "GraphedCallable", key: Any, leaves: list[Any], spec: Any, info: CallInfo) -> Any:
        self._sync_bookkeeping()
        siblings = self.current.children.get(key, [])
        if len(siblings) >= gc.max_rerecords:
            gc.disable(
                f"re-record limit reached: recorded {len(siblings)} times at the same place "
                f"(in-place inputs or parameters keep moving, or held outputs keep changing)"
            )
            return gc.run_eager(leaves, spec, gc.disabled_reason)  # type: ignore[arg-type]
        if siblings:
            self.counters.rerecordings += 1
        node = Node(self.current, gc.name, key, len(self.path))
        try:
            out = self._capture(gc, node, leaves, spec, info)
        except CaptureFailed as e:
            gc.disable(str(e))
            if e.pool_tainted:
                self._retire_pool()
            return gc.run_eager(leaves, spec, str(e))
        self.current.children.setdefault(key, []).append(node)
        self.path.append(node)
        self.current = node
        self.counters.recordings += 1
        return out

    def _capture(self, gc: "GraphedCallable", node: Node, leaves: list[Any], spec: Any, info: CallInfo) -> Any:
        dev = self.torch_device
        held = {}
        for d, owner in enumerate(self.path):
            for g in range(len(owner.refs)):
                if owner.is_held(g):
                    held[owner.outputs.groups[g][0]] = (d, g)  # type: ignore[union-attr]
                else:
                    node.dead_before.append((d, g))

        # Inputs: in place (static, parameters, held outputs of this path) or copied.
        plan = InputPlan(padded=info.padded, pad_dim=gc.bucketing.dim if gc.bucketing else 0, bucket=info.bucket)
        plan.inplace_ptrs = [0] * len(leaves)
        graph_leaves = list(leaves)
        owning: list[torch.Tensor] = []
        stream = self._side_stream()
        with torch.cuda.device(self.device), torch.cuda.stream(stream), self.pool.allocating():
            for i, x in enumerate(leaves):
                if not isinstance(x, torch.Tensor):
                    continue
                if i not in info.padded and (is_marked_static(x) or x.untyped_storage().data_ptr() in held):
                    plan.inplace_idx.append(i)
                    plan.inplace_ptrs[i] = x.data_ptr()
                    continue
                shape, dtype, stride = info.key[i]
                ph = torch.empty_strided(shape, stride, dtype=dtype, device=dev)
                owning.append(ph)
                graph_leaves[i] = ph
                plan.copy_idx.append(i)
                plan.placeholders.append(
                    _torch.tensor_on(_meta_of(ph), _torch.storage_at(ph.untyped_storage().data_ptr(), dev, ph.untyped_storage().nbytes()))
                )
        plan.freeze(self.device)
        node.inputs = plan
        node.statics = gc.static_tensors()
        node.static_ptrs = [t.data_ptr() for t in node.statics]
        node.static_idx = list(range(len(node.statics)))
        node.epoch = param_epoch[0]

        watch = mutation_watch(graph_leaves, plan.copy_idx)
        args, kwargs = unflatten(graph_leaves, spec)
        graph = torch.cuda.CUDAGraph()
        tracker = OpTracker()
        _events.publish("record_begin", name=gc.name, node=node.id)
        t0 = time.perf_counter()
        err: Exception | None = None
        began = False
        try:
            with _Inside(), torch.cuda.device(self.device), torch.cuda.stream(stream):
                try:
                    graph.capture_begin(pool=self.pool.id, capture_error_mode="thread_local")
                    began = True
                    with tracker, watch:
                        out = gc.fn(*args, **kwargs)
                except Exception as e:  # the function's own error comes first
                    err = e
                if began:
                    try:
                        graph.capture_end()
                    except Exception as e:
                        err = err or e
        finally:
            torch.cuda.current_stream(self.device).wait_stream(stream)
        if err is not None:
            msg = explain_capture_error(err, tracker, gc.name)
            clear_traceback(err)
            del err, args, kwargs, graph_leaves, owning, graph
            _torch.end_failed_capture(self.device, self.pool.id, began)
            raise CaptureFailed(msg, pool_tainted=True)
        node.capture_seconds = time.perf_counter() - t0
        node.unconditional = not (plan.inplace_idx or node.static_idx or node.dead_before)
        if watch.written:  # the graph would write into a placeholder, not the caller's tensor
            del out, owning, graph
            raise CaptureFailed(_mutation_reason(watch.written))
        node.graph = graph
        node.launch = _torch.graph_launcher(graph)
        _events.publish("record_end", name=gc.name, node=node.id, graph=graph)

        plan_out, out_leaves = OutputPlan.from_recording(
            out, graph_leaves, self.pool.address_test(), gc.name, info.bucket, plan.pad_dim
        )
        plan_out.freeze()
        node.outputs = plan_out
        node.output_bytes = sum(nbytes for _, nbytes in plan_out.groups)
        del out, owning, graph_leaves  # placeholders go back to the pool: only replays read them
        # The capture ran nothing: replay once to compute this call's outputs.
        plan.copy_in(leaves, info.n)
        graph.replay()
        out_leaves = plan_out.adopt(out_leaves, leaves)
        node.refs = plan_out.refs_of(out_leaves)
        node.checkpoint = self.pool.checkpoint()
        node.alive_at_checkpoint = [(d, g) for _, (d, g) in held.items()] + [
            (node.depth, g) for g in range(len(plan_out.groups))
        ]
        return plan_out.finish(out_leaves, info.n if info.n != info.bucket else -1)

    # --- reporting and reset ----------------------------------------------------------------
    def nodes(self) -> list[Node]:
        out: list[Node] = []
        stack = [self.root]
        while stack:
            n = stack.pop()
            for kids in n.children.values():
                out.extend(kids)
                stack.extend(kids)
        return out

    def reset(self) -> None:
        """Invalidate held outputs, drop every recording and give the pool's memory back."""
        with self.lock:
            for r, msg in self._held_outputs():
                _torch.invalidate_storage(r, msg.replace("a new step began", "graphtree.reset() was called"))
            self._clear()
            self.user_steps = False
            self.warmed = {}
            self._pool = None
            self.counters = Counters()
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()


def _held_in(path: list[Node], warm_refs: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """(weak ref, message) of the outputs of ``path`` and warm-ups the caller still holds."""
    expired = _torch.weak_expired
    held = []
    for node in path:
        msgs = node.outputs.group_messages  # type: ignore[union-attr]
        held.extend((r, msgs[g]) for g, r in enumerate(node.refs) if r and not expired(r))
    held.extend((r, m) for r, m in warm_refs if not expired(r))
    return held


def _mutation_reason(written: list[int]) -> str:
    which = ", ".join(str(i) for i in sorted(written))
    return f"mutates its input {which} in place (mark it with graphtree.mark_static to graph it)"


def _meta_of(t: torch.Tensor) -> dict[str, Any]:
    return {"size": tuple(t.shape), "stride": t.stride(), "dtype": t.dtype, "device": t.device, "storage_offset": t.storage_offset()}


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
    """
    _tls.user_steps = False
    with _registry_lock:
        managers = list(_all_managers)
    for m in managers:
        m.reset()
    untreed.__init__()  # type: ignore[misc]


def stats() -> Stats:
    """Counters of recordings, replays, warm-ups and eager runs (by reason), and pool bytes.

    Example::

        print(graphtree.stats())
    """
    s = Stats(cuda=torch.cuda.is_available())
    if not s.cuda:
        s.note = "no CUDA: graphed functions run eagerly"
    untreed.add_to(s)
    with _registry_lock:
        managers = list(_all_managers)
    for m in managers:
        m.counters.add_to(s)
        s.trees += 1
        if m._pool is not None:
            s.pool_bytes += m._pool.reserved_bytes()
    return s


def describe(format: str = "text") -> str:
    """The trees as text (default) or as Graphviz ``dot`` (``format="dot"``).

    Example::

        print(graphtree.describe())
    """
    from graphtree.tree.describe import render

    if format not in ("text", "dot"):
        raise ValueError(f"describe(format=...) takes 'text' or 'dot', not {format!r}")
    with _registry_lock:
        managers = list(_all_managers)
    return render(managers, format)
