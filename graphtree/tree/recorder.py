"""Running the user's function for the tree: warm-ups in the pool, and captures that build a Node.

Both run the function inside the tree's memory pool on the tree's side stream, one at a time
across threads (they clear cuBLAS's workspaces, which all threads share). Graphed functions
called from inside run inline: they become part of the outer warm-up or recording
(:data:`user_code`).

What a capture produces is handed to :class:`~graphtree.tree.node.Node`'s constructor whole.
"""

from __future__ import annotations

import contextlib
import gc as _collector
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from graphtree import _events, _torch
from graphtree.tree import draws as _draws
from graphtree.tree import refusals as _refusals
from graphtree.tree import training_step as _training_step
from graphtree.tree import writes as _writes
from graphtree.tree.adoption import Adoption
from graphtree.tree.breaks import BreakFailed, Breaks, Segment, WarmUpReads
from graphtree.tree.callee import Callee, user_code
from graphtree.tree.capture import CaptureFailed, OpTracker, SyncWatch, clear_traceback, explain_capture_error
from graphtree.tree.host_random import HostRandom
from graphtree.tree.host_scalars import HostScalars, ScalarEscapes, placeholders_of
from graphtree.tree.inputs import Call
from graphtree.tree.lockstep import UnagreedCollective, Vote, watch_collectives
from graphtree.tree.node import External, Node, OutputRef, Root, next_node_id
from graphtree.tree.numbers import Numbers
from graphtree.tree.outputs import OutputPlan
from graphtree.tree.placement import copied_inputs, place_inputs, state_watch
from graphtree.tree.pool import Pool
from graphtree.tree.state_epoch import param_epoch

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


@contextmanager
def _workspace_in(pool: Pool) -> Iterator[None]:
    """cuBLAS's workspace for the current stream, made now in ``pool`` (inside :class:`_Inside`, which
    cleared the workspaces before and frees this one after): ``current_blas_handle()`` makes it."""
    with pool.allocating():
        torch.cuda.current_blas_handle()
    yield


@contextmanager
def _no_collection() -> Iterator[None]:
    """No automatic garbage collection while a graph is captured: a collection runs the finalizers
    of whatever garbage it finds, and one that freed a CUDA graph (a ``torch.cuda.CUDAGraph`` in a
    reference cycle; recordings ``reset()`` had dropped) ended the capture with an error. The
    switch is process-wide, for the capture's duration (captures run one at a time, under
    ``_capture_lock``); explicit ``gc.collect()`` calls still run."""
    if not _collector.isenabled():
        yield
        return
    _collector.disable()
    try:
        yield
    finally:
        _collector.enable()


@contextmanager
def _no_autocast_cache() -> Iterator[None]:
    """Autocast's cache of cast weights off while graphtree runs the function for a tree: a cast
    cached during a warm-up would count as state the function keeps, and one cached during a capture
    would be read by every replay after autocast cleared it. Off, the casts are recorded with the
    graph and run on each replay (what ``make_graphed_callables`` asks of its users). Thread-local."""
    was = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(was)


class WarmUp:
    """The result of one warm-up run: its outputs, and what it showed about the signature."""

    def __init__(
        self,
        out: Any,
        give_up: str | None,
        kept: int,
        groups: dict[str, tuple[int, ...]],
        ops: int = 0,
        compiled: bool = False,
        mutated: str = "",
    ) -> None:
        self.out = out
        self.give_up = give_up  # a reason never to graph this signature, or None
        self.kept = kept  # storages the function made and kept beyond its outputs (state it allocated)
        self.groups = groups  # the process groups of the collectives it called: name -> global ranks
        self.ops = ops  # operators it dispatched (views included, metadata queries not)
        # torch.compile compiled code the call ran, in it: its host syncs were the compiler's (the
        # next warm-up, compiled already, says whether the call syncs)
        self.compiled = compiled
        # a list, dict or set its code reads from a global or closure that the call changed ("" if
        # none): warmed up again (a cache filled on first use), given up if every call does it
        self.mutated = mutated

    def again_reason(self, name: str, kept_hint: str = "") -> str:
        """Why ``name``'s signature runs eagerly when its warm-ups keep asking for another (every
        call keeps state it allocated, or changes a container its code reads). ``kept_hint``: why
        the models it reaches keep memory, where known (``FreeValues.kept_hint``)."""
        if not self.mutated and kept_hint:
            return f"`{name}` keeps tensors it allocates beyond its outputs on every call: {kept_hint}"
        if self.mutated:
            return (
                f"`{name}` changes {self.mutated} on every call: a replay runs no Python and would not; "
                f"return what it adds and add it after the call, or keep such bookkeeping outside the "
                f"graphed function"
            )
        return (
            f"`{name}` keeps tensors it allocates beyond its outputs on every call (a cache created "
            f"inside the call, or tensors returned inside an object graphtree cannot see into): allocate "
            f"that state before the first call and pass it in, or return tensors, tuples, lists or dicts"
        )


def warm_up(gc: Callee, call: Call, stream: torch.cuda.Stream, device: int, pool: Pool) -> WarmUp:
    """Run ``gc``'s function eagerly, watching for what a graph cannot hold.

    Warm-ups allocate from the ordinary caching allocator, not the tree's pool: whatever the
    function keeps (a cache it fills on first use) can never be overwritten by a recording. Only
    cuBLAS's workspace for the tree's stream comes from ``pool`` (whose bookkeeping must be live):
    it is scratch, freed when the warm-up ends, and the recordings' workspace reuses its block
    (a warm-up's own workspace had cost a second 32 MiB outside the pool, issue 45).
    Host synchronisations and writes to inputs that would be copied name a reason never to graph
    this signature; tensors the function made and kept (other than its outputs) are counted.
    Exceptions of the function propagate unchanged.
    """
    watch = state_watch(call.leaves, copied_inputs(call))
    numbers = Numbers.positions(call)  # Python numbers tried as device scalars: where operators take them
    noted = HostScalars({}, gc.name, {i: call.leaves[i] for i in numbers}) if numbers else None
    args, kwargs = call.arguments()
    tracker = OpTracker()
    # host reads of a scalar (with breaks on) and graphtree.eager parts: breaks, no reason to give up
    # (none for a function that calls collectives: the segment before a read runs them there and
    # then, and a capture that fails after it would run them again; the read gives it up instead)
    reads = WarmUpReads(count_reads=gc.options.max_break_values > 0 and gc.lockstep() is None)
    sync = SyncWatch(tracker, gc.name, allowed=reads)
    collectives = watch_collectives()  # (None without torch.distributed)
    step = gc.training_step()  # a training step's parameters: did the call change them or their gradients?
    versions = step.before(call.leaves) if step is not None and not step.trains else None
    current = torch.cuda.current_stream(device)
    stream.wait_stream(current)
    traces = _torch.dynamo_traces()
    host_random = HostRandom.now()
    containers = gc.free.containers()
    try:
        with (
            _Inside(),
            _no_autocast_cache(),
            torch.cuda.device(device),
            torch.cuda.stream(stream),
            _workspace_in(pool),
            sync,
            tracker,
            reads,
            collectives or contextlib.nullcontext(),
            watch,
            noted or contextlib.nullcontext(),
        ):
            out = gc.fn(*args, **kwargs)
        if noted is not None:
            gc.numbers.warmed(call, numbers, noted)
        # dynamo compiled during it: its syncs and generator-state reads may be the compiler's (dynamo
        # saves and restores the CUDA generator's state around a trace), and it is warmed up again
        compiled = _torch.dynamo_traces() != traces
        syncs = sync.found if not compiled else ""
        reason = (
            _refusals.mutation_reason(watch.written)
            if watch.written
            else (
                _refusals.output_reason(out)
                or syncs
                or _refusals.unsafe_reason(gc.name, watch, compiled)
                or (host_random.drawn(gc.name) if not compiled else None)
            )
        )
        grads: list[torch.Tensor] = []  # a training step's gradients are the caller's, not state it keeps
        if step is not None:
            if versions is not None:
                step.after(versions, call.leaves)
            if step.trains:
                reason = reason or step.refusal(gc.name, call.leaves)
                grads = [p.grad for p in step.params(call.leaves) if p.grad is not None]
        kept = 0 if reason else len(watch.kept(_storages(call.leaves, out, [*gc.static_tensors(), *grads])))
        _draws.note(gc.id, watch.generators)  # its recordings give each explicit generator a stand-in
    finally:
        current.wait_stream(stream)
        watch.close()
    mutated = gc.free.after_warm_up(containers) if containers is not None else ""
    return WarmUp(out, reason, kept, collectives.groups if collectives else {}, reads.ops, compiled, mutated)


def _storages(leaves: Sequence[Any], out: Any, statics: Sequence[torch.Tensor]) -> set[int]:
    """Storage ids of the tensors among ``leaves``, the tensor leaves of ``out`` and ``statics``:
    what a call may keep alive without having allocated state of its own."""
    outs, _ = _torch.tree_flatten(out)
    return {_torch.storage_id(t) for t in (*leaves, *outs, *statics) if isinstance(t, torch.Tensor)}


def record(
    gc: Callee,
    call: Call,
    *,
    parent: Node | Root,
    path: list[Node],
    pool: Pool,
    stream: torch.cuda.Stream,
    device: int,
    prefix: list[tuple[Segment, Any]] | None = None,
    captured: Vote | None = None,
) -> tuple[Node, Any]:
    """Capture one call of ``gc`` as a child of ``parent`` (the last node of ``path``).

    Returns the new node and this call's outputs (the capture runs nothing, so the graph is
    replayed once to compute them). Raises :class:`CaptureFailed` when the function does what a
    graph cannot hold; an exception of the function itself propagates unchanged, and nothing
    of the failed capture stays behind. A host read of a scalar ends a segment of the recording
    (:mod:`graphtree.tree.breaks`); with ``prefix`` (the segments a replay ran before it read a
    value never recorded, and the values read), the new node extends that recording. With
    ``captured`` (a function that calls collectives: :mod:`graphtree.tree.lockstep`), the ranks
    agree that each captured before the graph first runs; one that did not makes all fail.
    """
    # Outputs of the path the caller holds are read in place and kept out of this graph's
    # memory; those that are dead must stay dead for the graph to be replayed.
    held: dict[int, OutputRef] = {}
    dead_before: list[OutputRef] = []
    for d, owner in enumerate(path):
        for g, group in enumerate(owner.outputs.groups):
            if owner.live.is_held(g):
                held[group.ptr] = OutputRef(d, g)
            else:
                dead_before.append(OutputRef(d, g))
    current = torch.cuda.current_stream(device)
    stream.wait_stream(current)
    with torch.cuda.device(device), torch.cuda.stream(stream), pool.allocating():
        inputs, graph_leaves, owning = place_inputs(call, set(held), device, _pad_dim(gc))
    statics, epoch = gc.static_tensors(), param_epoch()  # read together: the epoch dates the statics
    step = gc.training_step()
    params = step.params(call.leaves) if step is not None and step.trains else []
    old_grads = _training_step.grad_targets(params)  # where new gradients are copied to, in the graph
    # (No torch.cuda.empty_cache() here to give back what the warm-ups cached, as torch.cuda.graph
    # does: on the H100 it made a graph the user had captured by hand earlier read freed memory.)
    grads: list[tuple[torch.Tensor, torch.Tensor]] = []
    watch = state_watch(graph_leaves, inputs.copy_idx, track_reads=True)
    # host scalars' placeholders computed with as eager's CPU-scalar path does (tree/host_scalars.py)
    scalars = HostScalars(placeholders_of(call, graph_leaves, inputs.host), gc.name) if inputs.host else None
    numbers = Numbers.positions(call) if scalars is not None else []
    isolated: list[bool] = []  # per graph begun: whether its capture kept the generators out
    try:
        args, kwargs = call.arguments(graph_leaves)
        before = _writes.values(call.leaves)  # plain values inside object arguments (see writes.py)
        modules = [gc.module(), *(x for x in call.leaves if isinstance(x, torch.nn.Module))]
        modules_before = _writes.module_values(modules)
        lockstep = gc.lockstep()  # a collective on a group its ranks did not agree on stops the capture
        breaks = Breaks(
            begin=lambda g: isolated.append(begin_capture(g, pool.id, device, watch, gc.id)),
            new_graph=new_graph,
            first_replay=lambda: inputs.copy_in(call.leaves, call.n),
            prefix=prefix,
            placed=[t.data_ptr() for t in graph_leaves if isinstance(t, torch.Tensor) and t.is_cuda],
            enabled=gc.options.max_break_values > 0 and lockstep is None,  # (no breaks with collectives: warm_up)
        )
        tracker = OpTracker()
        collectives = watch_collectives(lockstep.groups if lockstep is not None else {})
        node_id = next_node_id()
        _events.publish("record_begin", name=gc.name, node=node_id)
        t0 = time.perf_counter()
        traces = _torch.dynamo_traces()
        user_error: BaseException | None = None  # the function's (or the capture's) error
        end_error: BaseException | None = None  # what broke the stream capture itself
        began = ended = False
        try:
            with (
                _Inside(),
                _no_collection(),
                _no_autocast_cache(),
                torch.cuda.device(device),
                torch.cuda.stream(stream),
            ):
                # A capture left open on the stream is ended here, before the stream is waited on (a
                # capturing stream cannot be), through the graph, which then owns its reference on the
                # pool (its destructor gives it back); a broken one's is given back below.
                try:
                    breaks.begin()
                    began = True
                except BaseException as e:  # noqa: BLE001 - explained below
                    end_error = e
                    began = torch.cuda.is_current_stream_capturing()  # it raised after the capture began
                    ended = began and _torch.end_open_capture(breaks.graph, stream)
                else:
                    try:
                        with tracker, breaks, collectives or contextlib.nullcontext(), watch:
                            with scalars or _nothing:  # (only the function's operators: its warm-up's to compare)
                                out = gc.fn(*args, **kwargs)
                            grads = _training_step.keep_out_of_pool(params, old_grads)
                        if len(breaks.segments) < len(prefix or ()):
                            raise BreakFailed("running it again for a new value did not read the values it had read")
                    except BaseException as e:  # noqa: BLE001 - the function's error (or the capture's), re-raised below
                        user_error = e
                    try:
                        if breaks.open:  # (not after a break that raised between two segments)
                            breaks.end()
                    except BaseException as e:  # noqa: BLE001 - whatever ended the capture, it is explained below
                        end_error = e
                        ended = _torch.end_open_capture(breaks.graph, stream)
        finally:
            current.wait_stream(stream)
        graph = breaks.graph
        if end_error is not None:  # the stream capture broke: torch will not capture into this pool again
            err = user_error if isinstance(user_error, Exception) else end_error
            msg = explain_capture_error(err, tracker, gc.name)
            interrupt = next(
                (x for x in (user_error, end_error) if x is not None and not isinstance(x, Exception)), None
            )
            for x in (user_error, end_error):
                if x is not None and x is not interrupt:
                    clear_traceback(x)
            del user_error, end_error, err, args, kwargs, graph_leaves, owning, graph, breaks
            _torch.end_failed_capture(device, pool.id, began and not ended, bool(isolated) and isolated[-1])
            if interrupt is not None:  # Ctrl-C (or SystemExit) reaches the caller, the mess cleaned up
                raise interrupt
            raise CaptureFailed(msg, pool_tainted=True)
        escaped = _escaped(gc, (scalars and scalars.escaped) or user_error, numbers)
        if escaped:  # (the eager run raises the function's own error again, if it is one)
            _writes.restore(call.leaves, before)  # (its Python ran: the eager run starts where the caller left it)
            clear_traceback(user_error)  # (the frames of a number that reached Python hold the capture's tensors:
            clear_traceback(scalars.escaped if scalars else None)  # freed now, not by a later collection)
            del args, kwargs, graph_leaves, owning, graph, breaks, user_error
            raise CaptureFailed(escaped)
        if _torch.dynamo_traces() != traces and not prefix:
            # torch.compile traced in the capture (a compiled part's guards failed, or its first call):
            # the trace read and set the generators' states and may have run the compiler's kernels
            # into the graph. The recording is dropped; the call runs eagerly and warms up again.
            _writes.restore(call.leaves, before)
            clear_traceback(user_error)
            del args, kwargs, graph_leaves, owning, graph, breaks, user_error
            raise CaptureFailed(_refusals.COMPILED_IN_CAPTURE.format(name=gc.name), again=True)
        if isinstance(user_error, (_torch.RandomOutsideCapture, BreakFailed, UnagreedCollective)):
            msg = f"`{gc.name}` cannot be recorded: {user_error}"
            clear_traceback(user_error)
            del args, kwargs, graph_leaves, owning, graph, breaks, user_error
            raise CaptureFailed(msg)
        if user_error is not None and _refusals.refused_in_capture(user_error):  # (eager runs it: so does this call)
            msg = explain_capture_error(user_error, tracker, gc.name)
            clear_traceback(user_error)
            del args, kwargs, graph_leaves, owning, graph, breaks, user_error
            raise CaptureFailed(msg)
        if user_error is not None:
            # The capture itself ended well: the graph is dropped (its destructor gives back its
            # reference on the pool) and the function's error reaches the caller as it was raised.
            del args, kwargs, graph_leaves, owning, graph, breaks
            raise user_error
        capture_seconds = time.perf_counter() - t0
        chain = breaks.finish()  # the segments, when the call read values on the host
        # which Python stack made which node of each graph it launches (tree/sites.py)
        graph_sites = [(seg.graph, seg.sites) for seg in chain] if chain else [(graph, breaks.sites.take())]
        reads = [seg.read.describe(v) for seg, v in zip(chain, breaks.values) if seg.read is not None]
        del breaks
        if watch.written:  # the graph would write into a placeholder, not the caller's tensor
            del out, owning, graph
            raise CaptureFailed(_refusals.mutation_reason(watch.written))
        problem = _refusals.unsafe_reason(gc.name, watch) or _refusals.output_reason(out)
        returned = scalars.in_outputs(out) if scalars is not None and numbers and not problem else None
        if returned is not None:
            gc.numbers.keep_by_value(returned.positions, str(returned))
            problem = str(returned)
        if not problem and numbers and scalars is not None:
            unlike = gc.numbers.compare(call.key, scalars.log, numbers)
            problem = f"`{gc.name}` keys its number argument(s) {numbers} by value: {unlike}" if unlike else None
        if problem:
            del out, owning, graph
            raise CaptureFailed(problem)
        try:  # what the call wrote into its object arguments, to write again on each replay
            written = _writes.changes(before, _writes.values(call.leaves), gc.name)
            _writes.module_changes(modules_before, _writes.module_values(modules), gc.name)
        except _writes.Unrepeatable as e:
            # Its Python ran, side effects and all: its outputs come from this graph, copied out
            # of the pool (which then retires: no checkpoint knows this capture's blocks), and the
            # signature runs eagerly from the next call on.
            if not chain:  # (the segments before the last ran at their reads)
                inputs.copy_in(call.leaves, call.n)
            _draws.replay(graph)
            leaves, spec = _torch.flatten_outputs(out)
            result = _torch.tree_unflatten([t.clone() if isinstance(t, torch.Tensor) else t for t in leaves], spec)
            del out, owning, graph, leaves
            raise CaptureFailed(str(e), pool_tainted=True, result=result) from None
        kept = watch.kept(_storages(graph_leaves, out, statics))
        if kept:  # state allocated inside the pool would be overwritten by later recordings
            del out, owning, graph
            raise CaptureFailed(_refusals.KEPT_REASON.format(name=gc.name, n=len(kept)), pool_tainted=True)
        in_pool = pool.address_test()
        outputs, out_leaves = OutputPlan.from_recording(out, graph_leaves, in_pool, gc.name, call.bucket, _pad_dim(gc))
        # every rank captured, or none keeps it (after the last check that can fail the capture)
        other = captured(None) if captured is not None else None
        if other is not None:
            del out, owning, graph, outputs, out_leaves
            raise CaptureFailed(f"`{gc.name}` is not recorded on any rank: {other}")
        held_by_node = [*statics, *(g for _, g in grads)]  # (a training step's gradient tensors: the node holds them)
        externals = _externals(gc, watch, graph_leaves, held_by_node, in_pool)
        # Placeholders go back to the pool before the checkpoint: only replays read them, and a
        # block the checkpoint shows allocated must belong to an output (restoring the checkpoint
        # later would leave it allocated with no owner). ``args``/``kwargs`` hold them too.
        del out, owning, graph_leaves, args, kwargs
        # The capture ran nothing: replay once to compute this call's outputs (after a break,
        # the segments before the last ran at their reads).
        if not chain:
            inputs.copy_in(call.leaves, call.n)
        _draws.replay(graph)
        out_leaves = outputs.adopt(out_leaves, call.leaves)
        depth = len(path)
        if chain and chain[0].leaves:  # a new value's recording: the same object tensors as its first value's
            adoption = chain[0].leaves[0].adoption
        else:
            adoption = Adoption.of(call.leaves, inputs.inplace_idx, call.n_args, lambda p: p in held or in_pool(p))
        node = Node(
            id=node_id,
            parent=parent,
            key=(gc.id, call.key),
            name=gc.name,
            depth=depth,
            graph=graph,
            inputs=inputs,
            outputs=outputs,
            refs=outputs.refs_of(out_leaves),
            checkpoint=pool.checkpoint(),
            alive_at_checkpoint=[*held.values(), *(OutputRef(depth, g) for g in range(len(outputs.groups)))],
            dead_before=dead_before,
            statics=statics,
            epoch=epoch,
            capture_seconds=capture_seconds,
            input_refs=[
                _torch.weak_ref(call.leaves[i].untyped_storage())
                for i in inputs.inplace_idx
                if call.leaves[i].untyped_storage().data_ptr() not in held
            ],
            externals=externals,
            writes=written,
            first=chain[0] if chain else None,
            reads=reads,
            graph_sites=graph_sites,
            adoption=adoption,
            grads=grads,
        )
        if chain:
            chain[-1].node = node
            chain[0].leaves.append(node)
        _events.publish("record_end", name=gc.name, node=node.id, graph=graph)
        return node, outputs.finish(out_leaves, call.n)
    finally:
        watch.close()


new_graph = torch.cuda.CUDAGraph
"""Makes each recording's graph (the fault-injection test replaces it with a graph that fails on cue)."""


def begin_capture(
    graph: torch.cuda.CUDAGraph, pool_id: tuple[int, int], device: int, watch: _torch.StateWatch, callee_id: int = 0
) -> bool:
    """Begin capturing into ``graph`` on the current stream, in thread-local mode, its random
    operations drawing what eager draws (:mod:`graphtree.tree.draws`; ``callee_id``: the graphed
    callable, whose warm-ups said which explicit generators it draws from). True when the
    generators were kept out of the capture (other threads draw meanwhile)."""
    return _draws.Draws(device, _draws.seen(callee_id)).begin(graph, pool_id, watch)


def user_code_section() -> contextlib.AbstractContextManager[None]:
    """Run user code for graphtree outside the trees (a training recording's warm-up: tree/training.py)
    as the trees' warm-ups run: one at a time across threads, cuBLAS's workspaces cleared around it."""
    return _Inside()


def capture_isolated(
    graph: torch.cuda.CUDAGraph, pool_id: tuple[int, int], stream: torch.cuda.Stream, fn: Callable[[], Any]
) -> Any:
    """Capture ``fn()`` into ``graph`` (memory from the pool ``pool_id``) on ``stream``, as the tree's
    recordings are captured; returns what ``fn`` returned.

    One capture at a time across threads, cuBLAS's workspaces cleared around it, no garbage
    collection and no autocast cache during it, the default CUDA generator kept out
    (:func:`begin_capture`), and no ``torch.cuda.empty_cache()`` (a graph captured by hand earlier
    would read freed memory). Capture the parts of one computation on the same ``stream``: autograd
    runs a backward on its forward's stream. A capture that fails is cleaned up as :func:`record`'s
    is, so that the process stays usable; an exception of ``fn`` reaches the caller unchanged.

    Example::

        out = capture_isolated(graph, torch.cuda.graph_pool_handle(), _streams.own_stream(0), lambda: model(x))
    """
    device = stream.device.index if stream.device.index is not None else torch.cuda.current_device()
    current = torch.cuda.current_stream(device)
    stream.wait_stream(current)
    watch = _torch.StateWatch({})
    error: BaseException | None = None
    broken = began = ended = isolated = False
    out: Any = None
    try:
        with _Inside(), _no_collection(), _no_autocast_cache(), torch.cuda.device(device), torch.cuda.stream(stream):
            try:
                isolated = begin_capture(graph, pool_id, device, watch)
                began = True
            except BaseException as e:  # noqa: BLE001 - raised below, after the clean-up
                error, broken = e, True
                began = torch.cuda.is_current_stream_capturing()
                ended = began and _torch.end_open_capture(graph, stream)
            else:
                try:
                    with watch:
                        out = fn()
                except BaseException as e:  # noqa: BLE001 - raised below, after the capture ends
                    error = e
                try:
                    _draws.seal(graph)
                    graph.capture_end()
                except BaseException as e:  # noqa: BLE001 - the function's error first, if any
                    error, broken = error or e, True
                    ended = _torch.end_open_capture(graph, stream)
    finally:
        current.wait_stream(stream)
        watch.close()
    if broken:  # the stream capture broke: what torch left in capture state is put back
        _torch.end_failed_capture(device, pool_id, began and not ended, isolated)
    if error is not None:
        raise error
    refusal = _refusals.unsafe_reason(getattr(fn, "__name__", "the function"), watch)
    if refusal:  # (its replays would not compute what eager computes)
        raise RuntimeError(refusal)
    return out


_nothing = contextlib.nullcontext()


def _escaped(gc: Callee, error: BaseException | None, numbers: list[int]) -> str | None:
    """Why the capture failed for a host scalar's sake (:class:`ScalarEscapes`, or any error of the
    function given tensors in place of its Python numbers, which are keyed by value from now on),
    or None."""
    if isinstance(error, ScalarEscapes):
        gc.numbers.keep_by_value(error.positions, str(error))
        return str(error)
    others = (_torch.RandomOutsideCapture, BreakFailed, UnagreedCollective, torch.cuda.OutOfMemoryError)
    refused = _refusals.refused_in_capture(error)
    if numbers and isinstance(error, Exception) and not isinstance(error, others) and not refused:
        first = (str(error).splitlines() or [""])[0]
        why = f"given a tensor in its place, the function raised {type(error).__name__}: {first}"
        gc.numbers.keep_by_value(numbers, why)
        return f"`{gc.name}` keys its number argument(s) {numbers} by value: {why}"
    return None


def _pad_dim(gc: Callee) -> int:
    """The dimension bucket padding pads (0 without buckets)."""
    return gc.bucketing.dim if gc.bucketing else 0


def _externals(
    gc: Callee,
    watch: _torch.StateWatch,
    graph_leaves: Sequence[Any],
    statics: list[torch.Tensor],
    in_pool: Callable[[int], bool],
) -> list[External]:
    """The CUDA storages the capture read that are neither inputs, nor state read in place, nor pool memory."""
    storages = (_torch.readable_storage(t) for t in (*graph_leaves, *statics))
    known = {st.data_ptr() for st in storages if st is not None}
    found = []
    for ptr, (ref, nbytes) in list(watch.read.items()):
        if ptr in known or in_pool(ptr) or _torch.weak_expired(ref):
            continue
        del watch.read[ptr]  # the node owns this weak reference now
        found.append(External(ref, ptr, nbytes, _origin(gc, ptr)))
    return found


def _origin(gc: Callee, ptr: int) -> str:
    """Where the function finds the tensor whose storage is at ``ptr``, as far as can be seen."""
    fn = getattr(gc.fn, "__func__", gc.fn)
    fn = getattr(fn, "forward", fn) if isinstance(fn, torch.nn.Module) else fn
    places: list[tuple[str, Any]] = []
    for name, v in (getattr(fn, "__globals__", None) or {}).items():
        places.append((f"global `{name}` of {getattr(fn, '__module__', '?')}", v))
    code = getattr(fn, "__code__", None)
    for name, cell in zip(getattr(code, "co_freevars", ()), getattr(fn, "__closure__", None) or ()):
        try:
            places.append((f"closure variable `{name}`", cell.cell_contents))
        except ValueError:
            continue
    module = gc.module()
    if module is not None:
        for mod_name, sub in module.named_modules():
            for name, v in vars(sub).items():
                places.append((f"attribute `{(mod_name + '.' if mod_name else '') + name}` of the module", v))
    for where, v in places:  # whatever the user holds: storages that cannot be read are skipped
        if isinstance(v, torch.Tensor) and v.is_cuda:
            st = _torch.readable_storage(v)
            if st is not None and st.data_ptr() == ptr:
                return where
    return "a tensor the function reads from outside its arguments"
