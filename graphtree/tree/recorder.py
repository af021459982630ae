"""Running the user's function for the tree: warm-ups in the pool, and captures that build a Node.

Both run the function inside the tree's memory pool on the tree's side stream, one at a time
across threads (they clear cuBLAS's workspaces, which all threads share). Graphed functions
called from inside run inline: they become part of the outer warm-up or recording
(:data:`user_code`).

What a capture produces is handed to :class:`~graphtree.tree.node.Node`'s constructor whole.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from graphtree import _events, _torch
from graphtree.tree.capture import CaptureFailed, OpTracker, SyncWatch, clear_traceback, explain_capture_error
from graphtree.tree.inputs import Call, is_marked_static, mutation_watch, place_inputs
from graphtree.tree.node import Node, OutputRef, Root, next_node_id
from graphtree.tree.outputs import OutputPlan, stale_message
from graphtree.tree.pool import Pool

if TYPE_CHECKING:
    from graphtree.tree.graphed import GraphedCallable


class _UserCode(threading.local):
    """Per thread: whether the thread runs a graphed function's warm-up or capture right now."""

    active = False


user_code = _UserCode()
"""``user_code.active``: this thread runs user code for a tree; graphed functions called from
there run inline, as part of the outer warm-up or recording (read on every graphed call)."""

# Warm-ups and captures run one at a time across threads: they clear cuBLAS's workspaces, which
# are shared by all threads, and a capture must not see another thread's workspace vanish.
_capture_lock = threading.RLock()


class _Inside:
    """This thread runs user code for a tree (see :data:`user_code`)."""

    def __enter__(self) -> None:
        _capture_lock.acquire()
        user_code.active = True
        _torch.clear_cublas_workspaces()

    def __exit__(self, *exc: object) -> None:
        try:
            _torch.clear_cublas_workspaces()
        finally:
            user_code.active = False
            _capture_lock.release()


class WarmUp:
    """The result of one warm-up run: its outputs, a reason to stop graphing, held pool outputs."""

    def __init__(self, out: Any, disable_reason: str | None, held: list[tuple[int, str]]) -> None:
        self.out = out
        self.disable_reason = disable_reason  # None: the function can be recorded
        self.held = held  # (weak ref, stale message) of outputs on pool memory


def warm_up(gc: GraphedCallable, call: Call, pool: Pool, stream: torch.cuda.Stream, device: int) -> WarmUp:
    """Run ``gc``'s function eagerly with its memory in ``pool``, watching for what a graph cannot hold.

    Host synchronisations and writes to inputs that would be copied make the result name a
    reason to run eagerly for good. Exceptions of the function propagate unchanged.
    """
    leaves = call.leaves
    copied = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor) and not is_marked_static(x)]
    watch = mutation_watch(leaves, copied)
    args, kwargs = call.arguments()
    tracker = OpTracker()
    sync = SyncWatch(tracker, gc.name)
    current = torch.cuda.current_stream(device)
    stream.wait_stream(current)
    try:
        with _Inside(), torch.cuda.device(device), torch.cuda.stream(stream), pool.allocating(), sync, tracker, watch:
            out = gc.fn(*args, **kwargs)
    finally:
        current.wait_stream(stream)
    reason = _mutation_reason(watch.written) if watch.written else (sync.found or None)
    return WarmUp(out, reason, _pool_outputs(gc.name, out, leaves, pool, device))


def _pool_outputs(name: str, out: Any, leaves: Sequence[Any], pool: Pool, device: int) -> list[tuple[int, str]]:
    """(weak ref, stale message) of each warm-up output storage that lives in the pool."""
    outs, _ = _torch.tree_flatten(out)
    inputs = {_torch.storage_id(x) for x in leaves if isinstance(x, torch.Tensor)}
    seen: set[int] = set()
    in_pool = pool.address_test()
    held = []
    for j, t in enumerate(outs):
        if not isinstance(t, torch.Tensor) or t.get_device() != device:
            continue
        c = _torch.storage_id(t)
        storage = t.untyped_storage()
        if c in seen or c in inputs or not storage.nbytes():
            continue
        seen.add(c)
        if in_pool(storage.data_ptr()):
            where = f"{t.dtype} {list(t.shape)}, a warm-up run".replace("torch.", "")
            held.append((_torch.weak_ref(storage), stale_message(name, [j], where)))
    return held


def record(
    gc: GraphedCallable,
    call: Call,
    *,
    parent: Node | Root,
    path: list[Node],
    pool: Pool,
    stream: torch.cuda.Stream,
    device: int,
    epoch: int,
) -> tuple[Node, Any]:
    """Capture one call of ``gc`` as a child of ``parent`` (the last node of ``path``).

    Returns the new node and this call's outputs (the capture runs nothing, so the graph is
    replayed once to compute them). Raises :class:`CaptureFailed` when the function does what a
    graph cannot hold; an exception of the function itself propagates unchanged, and nothing
    of the failed capture stays behind.
    """
    # Outputs of the path the caller holds are read in place and kept out of this graph's
    # memory; those that are dead must stay dead for the graph to be replayed.
    held: dict[int, OutputRef] = {}
    dead_before: list[OutputRef] = []
    for d, owner in enumerate(path):
        for g, group in enumerate(owner.outputs.groups):
            if owner.is_held(g):
                held[group.ptr] = OutputRef(d, g)
            else:
                dead_before.append(OutputRef(d, g))
    pad_dim = gc.bucketing.dim if gc.bucketing else 0
    current = torch.cuda.current_stream(device)
    stream.wait_stream(current)
    with torch.cuda.device(device), torch.cuda.stream(stream), pool.allocating():
        inputs, graph_leaves, owning = place_inputs(call, set(held), device, pad_dim)
    statics = gc.static_tensors()
    watch = mutation_watch(graph_leaves, inputs.copy_idx)
    args, kwargs = call.arguments(graph_leaves)
    graph = torch.cuda.CUDAGraph()
    tracker = OpTracker()
    node_id = next_node_id()
    _events.publish("record_begin", name=gc.name, node=node_id)
    t0 = time.perf_counter()
    user_error: BaseException | None = None
    end_error: Exception | None = None
    began = False
    try:
        with _Inside(), torch.cuda.device(device), torch.cuda.stream(stream):
            graph.capture_begin(pool=pool.id, capture_error_mode="thread_local")
            began = True
            try:
                with tracker, watch:
                    out = gc.fn(*args, **kwargs)
            except BaseException as e:  # noqa: BLE001 - the function's error (or the capture's), re-raised below
                user_error = e
            try:
                graph.capture_end()
            except Exception as e:  # noqa: BLE001 - whatever ended the capture, it is explained below
                end_error = e
    except Exception as e:  # noqa: BLE001 - capture_begin itself failed: explained below
        end_error = e
    finally:
        current.wait_stream(stream)
    if end_error is not None:  # the stream capture broke: torch will not capture into this pool again
        err = user_error if isinstance(user_error, Exception) else end_error
        msg = explain_capture_error(err, tracker, gc.name)
        for e in (user_error, end_error):
            if e is not None:
                clear_traceback(e)
        del user_error, end_error, err, args, kwargs, graph_leaves, owning, graph
        _torch.end_failed_capture(device, pool.id, began)
        raise CaptureFailed(msg, pool_tainted=True)
    if user_error is not None:
        # The capture itself ended well: the graph is dropped (its destructor gives back its
        # reference on the pool) and the function's error reaches the caller as it was raised.
        del args, kwargs, graph_leaves, owning, graph
        raise user_error
    capture_seconds = time.perf_counter() - t0
    if watch.written:  # the graph would write into a placeholder, not the caller's tensor
        del out, owning, graph
        raise CaptureFailed(_mutation_reason(watch.written))
    outputs, out_leaves = OutputPlan.from_recording(
        out, graph_leaves, pool.address_test(), gc.name, call.bucket, pad_dim
    )
    del out, owning, graph_leaves  # placeholders go back to the pool: only replays read them
    # The capture ran nothing: replay once to compute this call's outputs.
    inputs.copy_in(call.leaves, call.n)
    graph.replay()
    out_leaves = outputs.adopt(out_leaves, call.leaves)
    refs = outputs.refs_of(out_leaves)
    depth = len(path)
    node = Node(
        id=node_id,
        parent=parent,
        key=(gc.id, call.key),
        name=gc.name,
        depth=depth,
        graph=graph,
        inputs=inputs,
        outputs=outputs,
        refs=refs,
        checkpoint=pool.checkpoint(),
        alive_at_checkpoint=[*held.values(), *(OutputRef(depth, g) for g in range(len(outputs.groups)))],
        dead_before=dead_before,
        statics=statics,
        epoch=epoch,
        capture_seconds=capture_seconds,
    )
    _events.publish("record_end", name=gc.name, node=node.id, graph=graph)
    return node, outputs.finish(out_leaves, call.n)


def _mutation_reason(written: list[int]) -> str:
    which = ", ".join(str(i) for i in sorted(written))
    return f"mutates its input {which} in place (mark it with graphtree.mark_static to graph it)"
