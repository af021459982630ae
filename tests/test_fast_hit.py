"""tree/fast_hit.py on the CPU: a replay hit made again without the Python path, against the Python
path itself. The recordings are built by hand (one copied input, one output from the pool) and the
native helpers, the stream and the launch are stand-ins, as ``benchmarks/probes/replay_hit_cpu.py``
does: the tree, the walk, the liveness of outputs and the counters are graphtree's own."""

from __future__ import annotations

import concurrent.futures
import gc
import os
import sys
import threading
import types
import weakref
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from gt_fast_hit import (
    count_fast_replays,
    module_stops,
    plant_recording,
    stand_in_helpers,
    stand_in_signature,
    with_native_hit,
)

import graphtree
from graphtree import _native, _torch
from graphtree.tree import ambient, fast_hit, graphed_module, liveness, placement, reach
from graphtree.tree import graphed as graphed_mod
from graphtree.tree import manager as manager_mod
from graphtree.tree import walk as walk_mod
from graphtree.tree.inputs import read_call


class _Launches:
    def __init__(self) -> None:
        self.n = 0

    def __call__(self) -> None:
        self.n += 1


@pytest.fixture(params=["python twin", "native"])
def stand_ins(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[types.SimpleNamespace]:
    """Stand-ins for the native helpers; the fast hit's replay is its Python twin, or the native
    ``fast_replay`` where the helpers build (their CUDA calls fall back to the Python twins here)."""
    fake = stand_in_helpers(ambient=ambient._python_state)  # (the real state, read in Python)
    if request.param == "native":
        real = _native.wait(600)
        if real is None:
            pytest.skip(f"no native helpers: {_native.status()}")
        # the native replay, replay_again's native whole and its C entry, a module's C entry
        with_native_hit(fake, real)
    monkeypatch.setattr(_native, "loaded", fake)
    monkeypatch.setattr(fast_hit, "entry", fast_hit.replay_again)  # (bound again to these helpers)
    monkeypatch.setattr(ambient, "_checked", fake)
    monkeypatch.setattr(graphed_mod, "_cuda_ok", True)
    monkeypatch.setattr(placement, "_current_stream", abs)
    # (a storage on the recording's memory, as on a GPU: the CPU's, where plant_recording's graph holds it)
    monkeypatch.setattr(liveness, "_storage_at", lambda ptr, dev, n: _torch.storage_at(ptr, torch.device("cpu"), n))
    monkeypatch.setattr(liveness, "_tensor_on", lambda m, s: torch.empty(0).set_(s, 0, m["size"], m["stride"]))
    before = set(manager_mod.managers())
    _fresh()
    yield fake
    _fresh()
    for tree in set(manager_mod.managers()) - before:  # (graphtree.reset() would synchronize their device)
        manager_mod._all_managers.discard(tree)


def _fresh() -> None:
    """This thread without trees (``graphtree.reset()`` would synchronize a CUDA device), its steps
    automatic (an earlier test's ``mark_step()`` made them the caller's)."""
    getattr(manager_mod._tls, "managers", {}).clear()
    manager_mod._tls.__dict__.pop("user_steps", None)


def _record(gc: Any, x: torch.Tensor, *numbers: float) -> tuple[Any, Any, _Launches]:
    """A recording of ``gc(x, *numbers)`` at the tree's root, as if captured (its numbers keyed as the
    Python path keys them): the tree, the node, its launches."""
    call = read_call((x, *numbers), {}, None)
    gc.numbers.rekey(call)
    graphed_mod._key_state(call, gc.module(), gc.free.part() if gc.free.active else None, None)
    tree = manager_mod.tree_for(0)
    launches = _Launches()
    node = plant_recording(tree, gc, call.key, x, launches)
    return tree, node, launches


def _state(tree: Any, node: Any) -> tuple[Any, ...]:
    """What a call leaves in the tree, comparable across trees (the node and its callable by role)."""
    walk = tree.walk
    return (
        walk.generation, [n is node for n in walk.path], walk.current is node, walk.called == {node.key[0]},
        walk.step_requested, tree.counters.replays, tree.counters.warmups, node.replays,
        walk.last_replayed is node, walk.warming, walk.retired,
    )  # fmt: skip


@pytest.mark.parametrize("marked", [False, True], ids=["automatic steps", "mark_step"])
def test_a_loop_replays_through_the_fast_hit_and_leaves_what_the_python_path_leaves(stand_ins, monkeypatch, marked):
    x = torch.randn(8, 8)
    walks = []
    for fast in (False, True):
        _fresh()
        step = graphtree.graphed(lambda t: t * 2 + 1)
        tree, node, launches = _record(step, x)
        seen = count_fast_replays(monkeypatch)
        states = []
        for _ in range(6):
            if not fast:
                step.fast_hits.clear()  # (the Python path on every call)
            if marked:
                graphtree.mark_step()
            out = step(x)
            assert out.shape == x.shape
            del out
            states.append(_state(tree, node))
        walks.append(states)
        assert launches.n == 6
        if fast:
            assert seen == [1] * 5, seen  # the first call went the Python path and left its FastHit
        else:
            assert seen == []
    assert walks[0] == walks[1]


def test_a_held_output_is_invalidated_at_the_next_step_as_on_the_python_path(stand_ins, monkeypatch):
    x = torch.randn(8, 8)
    results = []
    for fast in (False, True):
        _fresh()
        invalidated: list[str] = []
        monkeypatch.setattr(walk_mod._torch, "invalidate_storage", lambda ref, msg, seen=invalidated: seen.append(msg))
        step = graphtree.graphed(lambda t: t * 2 + 1)
        tree, node, _ = _record(step, x)
        step(x)
        seen = count_fast_replays(monkeypatch)
        if not fast:
            step.fast_hits.clear()
        held = step(x)  # kept by the caller
        if not fast:
            step.fast_hits.clear()
        again = step(x)  # a new step: the held output is invalidated
        assert seen == ([1, 1] if fast else [])
        results.append((invalidated, _state(tree, node), held.shape, again.shape))
    assert results[0] == results[1]
    assert len(results[0][0]) == 1, results


def _live_refs(node: Any) -> tuple[Any, ...]:
    """What a node's OutputLiveness holds between calls, comparable across trees."""
    live = node.live
    return (live._base is None, live._keep_base, [bool(r) for r in live.refs])


class _WeakRefs:
    """The weak references to output storages made and freed (``_torch``'s, counted)."""

    def __init__(self, ref: Any, free: Any) -> None:
        self._ref, self._free = ref, free
        self.made: list[int] = []
        self.freed: list[int] = []

    def ref(self, storage: Any) -> int:
        self.made.append(self._ref(storage))
        return self.made[-1]

    def free(self, r: int) -> None:
        self.freed.append(r)
        self._free(r)


_REAL = (liveness._weak_ref, liveness._weak_free, manager_mod.TreeManager.new_step)  # (before any test patches)


def _watch_step_ends(monkeypatch: pytest.MonkeyPatch) -> tuple[list[tuple[int, str]], _WeakRefs, list[int]]:
    """What ending a step does, recorded: each output invalidated ``(ref, message)`` (a stand-in for
    CUDA's invalidation), the output storages' weak references made and freed, and one item per step
    ended by ``TreeManager.new_step`` (Python's end) rather than natively."""
    invalidated: list[tuple[int, str]] = []
    monkeypatch.setattr(walk_mod._torch, "invalidate_storage", lambda ref, msg: invalidated.append((ref, msg)))
    refs = _WeakRefs(_REAL[0], _REAL[1])
    monkeypatch.setattr(liveness, "_weak_ref", refs.ref)
    monkeypatch.setattr(liveness, "_weak_free", refs.free)
    monkeypatch.setattr(walk_mod._torch, "weak_free", refs.free)
    in_python: list[int] = []

    def new_step(tree: Any, leaves: Any) -> Any:
        in_python.append(1)
        return _REAL[2](tree, leaves)

    monkeypatch.setattr(manager_mod.TreeManager, "new_step", new_step)
    return invalidated, refs, in_python


def test_outputs_kept_call_after_call_are_invalidated_as_on_the_python_path(stand_ins, monkeypatch, request):
    """``y = step(x)`` in a loop: each call ends a step whose single output the caller still holds.
    The native fast hit invalidates it itself (``end_step_natively``: the output's weak reference
    released, the same message, the same walk) where the twin calls ``TreeManager.new_step``; as many
    weak references are made and freed on both paths."""
    x = torch.randn(8, 8)
    results = []
    for fast in (False, True):
        _fresh()
        invalidated, refs, in_python = _watch_step_ends(monkeypatch)
        step = graphtree.graphed(lambda t: t * 2 + 1)
        tree, node, _ = _record(step, x)
        step(x)
        seen = count_fast_replays(monkeypatch)
        states = []
        y = None
        for _ in range(6):
            if not fast:
                step.fast_hits.clear()
            y = step(x)  # (the last call's output is held while this one runs)
            states.append((_state(tree, node), _live_refs(node)))
        assert y is not None
        assert seen == ([1] * 6 if fast else [])
        if fast and request.node.callspec.params["stand_ins"] == "native":
            # calls 1 and 2 end in Python: the output dropped before the loop (a base is kept from
            # then on), then that base held; from call 3 each call's held output is one built anew
            assert len(in_python) == 2, ("the native fast hit ends such a step itself", in_python)
        elif fast:
            assert len(in_python) == 6, in_python  # (the twin: TreeManager.new_step)
        results.append(([m for _, m in invalidated], states, len(refs.made), len(refs.freed)))
    assert results[0] == results[1], results
    assert len(results[0][0]) >= 4, results  # (each call after the first kept one invalidated its predecessor)


def test_two_calls_a_step_with_both_outputs_kept_are_invalidated_as_on_the_python_path(stand_ins, monkeypatch, request):
    """``a = f(x); b = g(a)`` in a loop: each step's path holds two recordings whose outputs the
    caller keeps into the next step; the native fast hit invalidates both, as the twin does."""
    x = torch.randn(8, 8)
    results = []
    for fast in (False, True):
        _fresh()
        invalidated, refs, in_python = _watch_step_ends(monkeypatch)
        f = graphtree.graphed(lambda t: t * 2 + 1, name="f")
        g = graphtree.graphed(lambda t: t - 1, name="g")
        tree, f_node, _ = _record(f, x)
        call = read_call((x,), {}, None)
        graphed_mod._key_state(call, None, g.free.part() if g.free.active else None, None)
        g_node = plant_recording(tree, g, call.key, x, _Launches(), parent=f_node)
        states = []
        for _ in range(6):
            if not fast:
                f.fast_hits.clear()
                g.fast_hits.clear()
            a = f(x)
            b = g(a)
            states.append((_state(tree, f_node), _live_refs(f_node), _live_refs(g_node), g_node.replays))
        assert a is not None and b is not None
        if fast and request.node.callspec.params["stand_ins"] == "native":
            assert in_python == [], in_python  # (each step with both outputs held ended natively)
        else:
            assert len(in_python) == 5, in_python  # (steps 2-6 through TreeManager.new_step)
        results.append(([m for _, m in invalidated], states, len(refs.made), len(refs.freed)))
    assert results[0] == results[1], results
    assert len(results[0][0]) >= 6, results  # (both outputs of each step after the first kept ones)


def test_a_held_output_fed_back_as_the_next_input_ends_its_step_in_python(stand_ins, monkeypatch):
    """``y = step(y)``: the output to invalidate is this call's input, which ``Walk.end_step``
    clones before invalidating it; the native fast hit leaves that step to ``TreeManager.new_step``."""
    _, _, in_python = _watch_step_ends(monkeypatch)
    x = torch.randn(8, 8)
    step = graphtree.graphed(lambda t: t * 2 + 1)
    _record(step, x)
    step(x)  # (dropped: a base is kept from now on)
    y = step(x)  # the base, held
    y = step(x)  # an output built anew, held
    in_python.clear()
    seen = count_fast_replays(monkeypatch)
    z = step(y)
    assert seen == [1] and in_python == [1], (seen, in_python)
    assert z is not y


CHANGES = (
    "grad of the input", "grad mode", "a forward hook", "eval mode", "default dtype", "disabled",
    "another thread", "a new shape",
)  # fmt: skip


@pytest.mark.parametrize("change", CHANGES)
def test_what_changes_the_python_paths_answer_sends_the_call_there_untouched(stand_ins, monkeypatch, change):
    model = torch.nn.Linear(8, 8)
    model.train()
    x = torch.randn(8, 8)
    gm = graphtree.graphed(model)
    gc = gm._graphtree_call
    with torch.no_grad():
        tree, node, launches = _record(gc, x)
        gm(x)
        gm(x)
    seen = count_fast_replays(monkeypatch)
    with torch.no_grad():
        gm(x)
    assert seen == [1], "the fast hit replays first"
    before = _state(tree, node)
    arg = x
    if change == "grad of the input":
        arg = x.clone().requires_grad_()
    elif change == "a forward hook":
        model.register_forward_hook(lambda m, i, o: None)
    elif change == "eval mode":
        model.eval()
    elif change == "disabled":
        gc.disable("for the test")
    elif change == "a new shape":
        arg = torch.randn(4, 8)
    hit = gc.fast_hits[next(iter(gc.fast_hits))]
    if change == "another thread":
        answers = []

        def other() -> None:
            manager_mod.tree_for(0)  # (a tree of its own on the device)
            with torch.no_grad():  # (the same ambient state: only the thread differs)
                answers.append(fast_hit.replay_hit(gc, hit, (x,), False))

        thread = threading.Thread(target=other)
        thread.start()
        thread.join()
        assert answers == [fast_hit.MISS]
    elif change == "default dtype":
        torch.set_default_dtype(torch.float64)
        try:
            with torch.no_grad():
                assert fast_hit.replay_hit(gc, hit, (x,), False) is fast_hit.MISS
        finally:
            torch.set_default_dtype(torch.float32)
    elif change == "a new shape":
        assert not any(key[0] == stand_in_signature((arg,), None)[0] for key in gc.fast_hits)
    else:
        grad = change == "grad of the input"  # (grad mode: the parameters require grad, not the input)
        with torch.set_grad_enabled(grad or change == "grad mode"):
            assert fast_hit.replay_hit(gc, hit, (arg,), grad) is fast_hit.MISS
    assert _state(tree, node) == before, "a MISS changes nothing"
    assert launches.n == 3


def test_parameters_made_to_require_grad_send_a_call_under_grad_mode_to_the_python_path(stand_ins, monkeypatch):
    """Under grad mode, a module's call builds an autograd graph once its parameters require grad
    (graphed._builds_autograd): a fast hit made while they did not must not replay it."""
    model = torch.nn.Linear(8, 8).requires_grad_(False)
    x = torch.randn(8, 8)
    gm = graphtree.graphed(model)
    gc = gm._graphtree_call
    tree, node, launches = _record(gc, x)
    gm(x)
    gm(x)
    seen = count_fast_replays(monkeypatch)
    gm(x)
    assert seen == [1], "the fast hit replays first, under grad mode"
    before = _state(tree, node)
    model.weight.requires_grad_(True)
    hit = gc.fast_hits[next(iter(gc.fast_hits))]
    assert fast_hit.replay_hit(gc, hit, (x,), False) is fast_hit.MISS
    assert _state(tree, node) == before, "a MISS changes nothing"
    assert launches.n == 3


class _EvictedMeanwhile(dict):
    """A callable's hits whose oldest entry another thread evicts between the read and the delete."""

    def __iter__(self) -> Iterator[Any]:
        first = next(dict.__iter__(self))
        dict.__delitem__(self, first)
        yield first


def test_a_signature_evicted_by_another_thread_first_does_not_fail_the_call(stand_ins):
    """Two threads calling one callable with more than KEEP signatures evict its oldest at once: the
    second delete met a missing key and raised KeyError from a call that had already replayed."""
    x = torch.randn(8, 8)
    step = graphtree.graphed(lambda t: t * 2 + 1)
    _, _, launches = _record(step, x)
    step.fast_hits = _EvictedMeanwhile({("old", i): object() for i in range(fast_hit.KEEP)})
    out = step(x)  # the Python path replays, then keeps the hit in the oldest one's place
    assert out.shape == x.shape and launches.n == 1
    assert len(step.fast_hits) == fast_hit.KEEP, step.fast_hits


def test_a_new_float_each_call_replays_through_the_fast_hit_and_leaves_what_the_python_path_leaves(
    stand_ins, monkeypatch
):
    """A temperature per request (issue 45): a float read as a device scalar is keyed by its type,
    so that every value replays one recording; the fast hit keys it so too."""
    x = torch.randn(8, 8)
    walks = []
    for fast in (False, True):
        _fresh()
        sample = graphtree.graphed(lambda t, temperature: t / temperature)
        tree, node, launches = _record(sample, x, 0.7)
        assert node.key[1][1] == fast_hit._FLOAT, node.key
        seen = count_fast_replays(monkeypatch)
        states = []
        for k in range(6):
            if not fast:
                sample.fast_hits.clear()  # (the Python path on every call)
            sample(x, 0.5 + k / 10)
            states.append(_state(tree, node))
        walks.append(states)
        assert launches.n == 6
        assert seen == ([1] * 5 if fast else []), seen
    assert walks[0] == walks[1]


def test_a_float_keyed_by_value_since_sends_the_call_to_the_python_path_untouched(stand_ins, monkeypatch):
    """Once a float is found to reach Python (a branch on it, a size), the Python path keys it by its
    value: the fast hit made while it was a device scalar must not replay another value's call."""
    x = torch.randn(8, 8)
    sample = graphtree.graphed(lambda t, temperature: t / temperature)
    tree, node, launches = _record(sample, x, 0.7)
    sample(x, 0.7)
    seen = count_fast_replays(monkeypatch)
    sample(x, 0.8)
    assert seen == [1]
    before = _state(tree, node)
    sample.numbers.keep_by_value([1], "for the test")
    assert fast_hit.replay_again(sample, sample.fast_hits, (x, 0.9)) is fast_hit.MISS
    assert _state(tree, node) == before and launches.n == 2


def test_an_int_argument_is_left_to_the_python_path(stand_ins, monkeypatch):
    x = torch.randn(8, 8)
    scale = graphtree.graphed(lambda t, k: t * k)
    scale.numbers.rekey(read_call((x, 3), {}, None))  # an int that comes with a new value (4 below):
    _, _, launches = _record(scale, x, 4)  # a device scalar from then on, keyed int64
    scale(x, 5)
    assert launches.n == 1 and not scale.fast_hits, "the Python path replayed; no fast hit is kept for an int"


SCALE = 2.0


def scaled(t: torch.Tensor) -> torch.Tensor:
    return t * SCALE


def test_a_value_the_code_reads_keys_the_fast_hit_as_the_python_path(stand_ins, monkeypatch):
    global SCALE
    x = torch.randn(8, 8)
    step = graphtree.graphed(scaled)
    tree, node, launches = _record(step, x)
    step(x)
    seen = count_fast_replays(monkeypatch)
    step(x)
    assert seen == [1], "a function reading a global replays through its fast hit"
    (hit,) = step.fast_hits.values()
    before = _state(tree, node)
    SCALE = 3.0
    try:
        assert fast_hit.replay_hit(step, hit, (x,), False) is fast_hit.MISS
    finally:
        SCALE = 2.0
    assert _state(tree, node) == before and launches.n == 2


def test_a_steady_loop_checks_the_values_its_code_reads_without_calling_part(stand_ins, monkeypatch, request):
    """The native fast hit compares the values a callable's code reads (a global here) with the last
    call's itself (``reads_part``); ``FreeValues.part()``, the reference, runs where one changed."""
    global SCALE
    x = torch.randn(8, 8)
    step = graphtree.graphed(scaled)
    _record(step, x)
    step(x)
    parts: list[int] = []
    real = reach.FreeValues.part
    monkeypatch.setattr(reach.FreeValues, "part", lambda self: parts.append(1) or real(self))
    seen = count_fast_replays(monkeypatch)
    for _ in range(3):
        step(x)
    assert seen == [1, 1, 1], seen
    native = request.node.callspec.params["stand_ins"] == "native"
    assert len(parts) == (0 if native else 3), parts
    (hit,) = step.fast_hits.values()
    SCALE = 3.0
    try:  # (rebound: part() gives a new part, and the fast hit misses)
        assert fast_hit.replay_hit(step, hit, (x,), False) is fast_hit.MISS
    finally:
        SCALE = 2.0
    assert len(parts) == (1 if native else 4), parts


def test_a_fast_hit_that_missed_is_made_again_and_left_to_the_python_path_when_it_keeps_missing(stand_ins, monkeypatch):
    x = torch.randn(8, 8)
    step = graphtree.graphed(lambda t: t * 2 + 1)
    _record(step, x)
    step(x)
    seen = count_fast_replays(monkeypatch)
    step(x)
    torch.nn.Linear(2, 2)  # a parameter registered anywhere: the epoch every recording's check keys moves
    step(x)  # the fast hit misses, the Python path replays and makes it again
    step(x)
    assert seen == [1, 0, 1], seen
    for _ in range(fast_hit.MAX_REPLACED):
        torch.nn.Linear(2, 2)
        step(x)
    (kept,) = step.fast_hits.values()
    assert kept is fast_hit._GAVE_UP
    step(x)
    assert seen[-1] == 0 and list(step.fast_hits.values()) == [fast_hit._GAVE_UP], "given up: the Python path"


def test_misses_far_apart_do_not_give_the_signature_up(stand_ins, monkeypatch):
    """A module made now and then (a new adapter, a model loaded) moves the parameter epoch: each
    time, one miss. Misses SETTLED replays apart start the count again, so a long-running loop keeps
    its fast hit; misses in a row still give it up (the test above)."""
    x = torch.randn(8, 8)
    step = graphtree.graphed(lambda t: t * 2 + 1)
    _record(step, x)
    step(x)
    seen = count_fast_replays(monkeypatch)
    for _ in range(fast_hit.MAX_REPLACED + 2):
        torch.nn.Linear(2, 2)
        for _ in range(fast_hit.SETTLED + 2):
            step(x)
    assert seen.count(0) == fast_hit.MAX_REPLACED + 2 and seen[-fast_hit.SETTLED :] == [1] * fast_hit.SETTLED, seen
    assert fast_hit._GAVE_UP not in step.fast_hits.values()


def test_two_threads_calling_one_callable_each_replay_through_a_fast_hit_of_their_own(stand_ins, monkeypatch):
    """Each thread has a tree of its own: its calls keep a fast hit of their own. Kept by signature
    alone, the threads' calls in turn made each other's miss, and the signature was given up."""
    x = torch.randn(8, 8)
    step = graphtree.graphed(lambda t: t * 2 + 1)
    rounds = fast_hit.MAX_REPLACED + 3
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as other:  # (one thread, always the same)
        _record(step, x)
        step(x)
        other.submit(_record, step, x).result()  # (in the other thread's tree)
        other.submit(step, x).result()
        seen = count_fast_replays(monkeypatch)
        for _ in range(rounds):
            step(x)
            other.submit(step, x).result()
    assert seen == [1] * (2 * rounds), seen
    assert fast_hit._GAVE_UP not in step.fast_hits.values() and len(step.fast_hits) == 2


def test_user_code_counts_the_threads_inside_it_and_each_thread_keeps_its_own_flag():
    """A graphed call reads ``UserCode.threads`` before its thread's own ``user_code.active``: the
    count must be the number of threads whose flag is set, whatever order they set and clear it in."""
    from graphtree.tree.callee import UserCode, user_code

    assert UserCode.threads == 0 and not user_code.active
    inside, leave = threading.Event(), threading.Event()
    seen: list[bool] = []

    def other() -> None:
        user_code.active = True
        user_code.active = True  # (set twice: counted once)
        inside.set()
        leave.wait(10)
        seen.append(user_code.active)
        user_code.active = False
        user_code.active = False

    t = threading.Thread(target=other)
    t.start()
    assert inside.wait(10)
    assert UserCode.threads == 1 and not user_code.active  # (the other thread's flag, not this one's)
    user_code.active = True
    assert UserCode.threads == 2
    leave.set()
    t.join(10)
    assert seen == [True] and UserCode.threads == 1 and user_code.active
    user_code.active = False
    assert UserCode.threads == 0 and not user_code.active


def test_the_same_tensors_on_another_device_are_not_replayed_from_this_devices_hit(stand_ins, monkeypatch):
    """Hits are keyed by the tensors' parts and their device: the same shapes on a second GPU met
    the first GPU's hit and replayed its recording (outputs on the wrong device)."""
    x = torch.randn(8, 8)
    step = graphtree.graphed(lambda t: t * 2 + 1)
    _, _, launches = _record(step, x)
    step(x)
    seen = count_fast_replays(monkeypatch)
    step(x)
    assert seen == [1]
    on_device_1 = lambda args, plain: (stand_in_signature(args, plain)[0], 1, False)  # noqa: E731
    monkeypatch.setattr(stand_ins, "signature", on_device_1)
    assert fast_hit.replay_again(step, step.fast_hits, (x,)) is fast_hit.MISS
    assert launches.n == 2


def test_a_fast_hit_keeps_neither_its_recording_nor_its_callable_alive(stand_ins, monkeypatch):
    """A recording dropped (``graphtree.reset()``: ``TreeManager.drop``) is freed with its pool
    memory though a fast hit remembers it, and a dropped callable is freed at once (no cycle
    through its hits): both kept memory after reset on the GPU."""
    x = torch.randn(8, 8)
    step = graphtree.graphed(lambda t: t * 2 + 1)
    tree, node, _ = _record(step, x)
    step(x)
    step(x)
    (hit,) = step.fast_hits.values()
    assert fast_hit.replay_hit(step, hit, (x,), False) is not fast_hit.MISS
    recording, callable_ = weakref.ref(node), weakref.ref(step)
    del node
    tree.drop("the test dropped it")
    gc.collect()
    assert recording() is None, gc.get_referrers(recording())
    assert fast_hit.replay_hit(step, hit, (x,), False) is fast_hit.MISS
    del hit
    gc.disable()
    try:
        del step
        assert callable_() is None, "a cycle keeps the graphed callable alive"
    finally:
        gc.enable()


def test_python_path_calls_that_replay_the_same_way_do_not_give_the_fast_hit_up(stand_ins, monkeypatch):
    """Calls the Python path runs though the fast hit holds (no helpers for them: per_call.py's
    Python-path row on the same callable) replay as it would: they must not count as its misses,
    which gave the signature up for every later call."""
    x = torch.randn(8, 8)
    step = graphtree.graphed(lambda t: t * 2 + 1)
    _record(step, x)
    step(x)
    tried = fast_hit.entry
    fast_hit.entry = lambda gc, hits, args: fast_hit.MISS
    try:
        for _ in range(fast_hit.MAX_REPLACED + 2):
            step(x)
    finally:
        fast_hit.entry = tried
    seen = count_fast_replays(monkeypatch)
    step(x)
    assert seen == [1], (seen, step.fast_hits)


MOST_FRAMES = 3
"""Python frames a native fast hit of a graphed function runs: ``__call__``, torch's
``is_dynamo_compiling`` and, on CPU tensors only, ``InputPlan.copy_in`` (the native copy-in takes
CUDA tensors). Twenty-first session: 13; the twenty-second moved the step's end, the outputs'
base, the stream check and ``takes_python_path`` into ``fast_replay``; the twenty-fourth called
the helpers' C entry (``fast_hit.entry``) where ``replay_again`` was. A change that adds one to
the hot path should say why, here."""


def _native_hits(request: pytest.FixtureRequest) -> tuple[Any, torch.Tensor, _Launches]:
    """A graphed function recorded by hand and called three times, with the native stand-ins
    only (the test is skipped with the Python twin): the callable, its input, its launches."""
    if request.node.callspec.params["stand_ins"] != "native":
        pytest.skip("the native fast hit")
    x = torch.randn(8, 8)
    step = graphtree.graphed(lambda t: t * 2 + 1)
    _, _, launches = _record(step, x)
    for _ in range(3):
        step(x)
    return step, x, launches


def test_a_native_fast_hit_runs_few_python_frames(stand_ins, request):
    step, x, launches = _native_hits(request)
    fakes = os.path.dirname(os.path.abspath(stand_in_helpers.__code__.co_filename))
    frames: list[str] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        path = frame.f_code.co_filename
        if event == "call" and not path.startswith(fakes) and path != __file__:
            frames.append(f"{os.path.basename(path)}:{frame.f_code.co_name}")

    before = launches.n
    sys.setprofile(profile)
    try:
        step(x)
    finally:
        sys.setprofile(None)
    assert launches.n == before + 1
    assert len(frames) <= MOST_FRAMES, frames


MOST_RETURNS = {"function": 13, "module": 15}
"""How often the Python path's replay of a call re-enters a graphtree module it had left (issue 47,
item 4: read, key, match, replay and outputs, each once; ``benchmarks/call_walk.py`` walks it on a
GPU). Twenty-second session, on this CPU walk: 22 and 28; the twenty-third read the hook counters
and the thread's tree where they live, and asked the module arguments, the numbers and the hooks
only where a call has any. A change that adds one should say why, here."""


@pytest.mark.parametrize("kind", ["function", "module"])
def test_the_python_path_of_a_replay_returns_to_few_modules_it_left(stand_ins, request, kind):
    if request.node.callspec.params["stand_ins"] != "python twin":
        pytest.skip("one walk: the Python path is the same with the native fast hit")
    x = torch.randn(8, 8)
    fn = graphtree.graphed(lambda t: t * 2 + 1) if kind == "function" else graphtree.graphed(torch.nn.Linear(8, 8))
    gc = fn._graphtree_call if kind == "module" else fn
    with torch.no_grad():
        _, _, launches = _record(gc, x)
        for _ in range(3):
            fn(x)
        gc.fast_hits.update(dict.fromkeys(gc.fast_hits, fast_hit._GAVE_UP))  # (its signature left to the Python path)
        seq, back = module_stops(lambda: fn(x))
    assert launches.n == 4
    assert back <= MOST_RETURNS[kind], " -> ".join(seq)


def test_the_python_signature_keys_a_call_as_read_call_does(monkeypatch):
    """Without the native helpers a fast hit is looked up by ``tensor_signature``: its parts must
    equal ``read_call``'s key parts, which ``remember`` keeps it by (CPU tensors made to pass as
    CUDA ones here)."""
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.Tensor, "get_device", lambda self: 0)
    base = torch.randn(4, 6)
    calls = [
        (base,),
        (base.t(), torch.randn(3)),
        (base[:, ::2], torch.zeros((), dtype=torch.int64)),
        (base.expand(2, 4, 6), base.requires_grad_(False)),
        (torch.randn(5, requires_grad=True),),
    ]
    for args in calls:
        sig = fast_hit.tensor_signature(args)
        assert sig is not None
        assert sig[0] == read_call(args, {}, None).key[: len(args)], args
        assert sig[1] == 0 and sig[2] == any(a.requires_grad for a in args)
    sig = fast_hit.tensor_signature((base, 2.0))  # a float: read_call's part, before Numbers.rekey
    assert sig is not None and sig[0] == read_call((base, 2.0), {}, None).key[:2]
    assert fast_hit.tensor_signature((base, 2)) is None  # (an int: the fast hit keeps no such call)
    assert fast_hit.tensor_signature((base.conj(),)) is None or not base.is_complex()
    assert fast_hit.tensor_signature((torch.randn(2, dtype=torch.complex64).conj(),)) is None
    assert fast_hit.tensor_signature(()) is None


def test_without_the_native_helpers_a_loop_replays_through_the_python_twin(stand_ins, monkeypatch):
    """GRAPHTREE_NATIVE=0: the fast hit is made and replayed in Python (its signature too)."""
    x = torch.randn(8, 8)
    step = graphtree.graphed(lambda t: t * 2 + 1)
    _, _, launches = _record(step, x)
    monkeypatch.setattr(_native, "loaded", None)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))  # (CPU tensors pass as CUDA's)
    monkeypatch.setattr(torch.Tensor, "get_device", lambda self: 0)
    step(x)
    seen = count_fast_replays(monkeypatch)
    for _ in range(4):
        step(x)
    assert seen == [1] * 4 and launches.n == 5, seen


def test_replay_again_calls_the_real_native_signature_as_it_takes_its_arguments(monkeypatch):
    """The stand-ins take anything; the built helpers' ``signature`` takes a tuple of plain types
    (given a frozenset it raised ``TypeError`` on every CUDA call that had a fast hit)."""
    real = _native.wait(600)
    if real is None:
        pytest.skip(f"no native helpers: {_native.status()}")
    monkeypatch.setattr(_native, "loaded", real)
    step = graphtree.graphed(lambda t: t + 1)
    # (CPU tensors: the real signature leaves them to Python, so the fast hit misses)
    assert fast_hit.replay_again(step, {"any": object()}, (torch.randn(2),)) is fast_hit.MISS


def test_the_native_entry_hands_calls_back_once_other_helpers_are_loaded(stand_ins, request, monkeypatch):
    """``fast_hit.entry``: the helpers' C entry once ``replay_again`` made it, which calls
    ``replay_again`` again once ``_native.loaded`` is no longer the module it was made from (tests
    swap it; ``GRAPHTREE_NATIVE=0`` never makes one)."""
    step, x, launches = _native_hits(request)
    assert type(fast_hit.entry).__name__ == "builtin_function_or_method", fast_hit.entry
    twins: list[int] = []
    real_twin = fast_hit.FastHit.replay

    def twin(hit: Any, *args: Any, **kwargs: Any) -> Any:
        twins.append(1)
        return real_twin(hit, *args, **kwargs)

    monkeypatch.setattr(fast_hit.FastHit, "replay", twin)
    step(x)
    assert twins == [], "its own helpers: the native replay"
    python_twin = stand_in_helpers(ambient=ambient._python_state)  # (no fast_call, no fast_replay)
    monkeypatch.setattr(_native, "loaded", python_twin)
    before = launches.n
    step(x)
    assert twins == [1] and launches.n == before + 1, "other helpers: replay_again, their Python twin"


def test_a_modules_call_asks_its_fast_hit_once_hit_or_miss(stand_ins, monkeypatch):
    """``GraphedModule.__call__`` tries its callable's fast hit itself; on a miss the Python path
    runs without a second try (``GraphedCallable.past_fast_hit``): one lookup a call."""
    x = torch.randn(8, 8)
    gm = graphtree.graphed(torch.nn.Linear(8, 8))
    gc = gm._graphtree_call
    with torch.no_grad():
        _, _, launches = _record(gc, x)
        for _ in range(3):
            gm(x)
        seen = count_fast_replays(monkeypatch)
        gm(x)
        assert seen == [1], seen  # a hit
        gc.fast_hits.update(dict.fromkeys(gc.fast_hits, fast_hit._GAVE_UP))  # (its signature left to the Python path)
        before = launches.n
        gm(x)
    assert seen == [1, 0], seen  # a miss, asked once
    assert launches.n == before + 1  # (the Python path replayed it)
    native = hasattr(stand_ins, "module_entry")  # (the helpers' C entry made these calls, else the twin)
    assert (graphed_module._made_by is stand_ins) == native


def _python_calls(fn: Any, *args: Any, **kwargs: Any) -> tuple[Any, list[tuple[str, str]]]:
    """``fn(*args, **kwargs)`` and the Python functions it called, as (file name, function name)."""
    seen: list[tuple[str, str]] = []

    def profile(frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            seen.append((os.path.basename(frame.f_code.co_filename), frame.f_code.co_name))

    sys.setprofile(profile)
    try:
        out = fn(*args, **kwargs)
    finally:
        sys.setprofile(None)
    return out, seen


def test_a_graphed_modules_class_calls_its_entry_in_c_and_keeps_its_python_call(stand_ins, request, monkeypatch):
    """Once the helpers' ``module_entry`` made the module's entry, ``module_type_call`` makes
    GraphedModule's call in C: a replay calls no Python function of graphtree's, and gives what the
    Python ``GraphedModule.__call__`` gives, which stays the class's ``__call__`` (what torch.compile
    traces; a subclass calls it); other helpers loaded since, or none, go back to the Python path."""
    if request.node.callspec.params["stand_ins"] != "native":
        pytest.skip("the native entry")
    x = torch.randn(8, 8)
    net = torch.nn.Linear(8, 8)
    gm = graphtree.graphed(net)
    with torch.no_grad():
        _, node, _ = _record(gm._graphtree_call, x)
        # (blocks of NaN where freed memory was: a replay that read freed memory compared unequal)
        _nan_blocks = [torch.full((8, 8), float("nan")) for _ in range(64)]
        for _ in range(3):
            gm(x)
        out, seen = _python_calls(gm, x)
        out = out.clone()  # (the replay's output dropped before the next: none held)
        assert torch.equal(out, node.graph.pool), "the replay's output is the recording's memory"
        assert torch.equal(out, graphed_module.GraphedModule.__call__(gm, x)), "the same replay"
        assert not [s for s in seen if s[0] in ("graphed_module.py", "graphed.py", "fast_hit.py")], seen
        assert type(graphed_module.GraphedModule.__dict__["__call__"]).__name__ == "function"

        class Sub(graphed_module.GraphedModule):
            pass

        sub = Sub(net, gm._graphtree_call)
        _, seen = _python_calls(sub, x)
        assert ("graphed_module.py", "__call__") in seen, seen  # (a subclass: its class's Python call)

        def refuse(module: Any, args: Any) -> None:
            raise ValueError("a pre-hook refused")

        handle = gm.register_forward_pre_hook(refuse)
        with pytest.raises(ValueError, match="refused"):  # (through nn.Module.__call__, raised as it is)
            gm(x)
        handle.remove()
        monkeypatch.setattr(_native, "loaded", None)  # (GRAPHTREE_NATIVE=0 at run time: the Python path)
        _, seen = _python_calls(gm, x)
        assert ("graphed_module.py", "_plain_call") in seen, seen


def test_a_modules_call_goes_through_nn_modules_call_where_that_does_more_on_either_entry(stand_ins, monkeypatch):
    """The module's entry (``graphed_module._plain_call`` or its C twin) answers each case as
    ``nn.Module.__call__`` would: a hook on the module, a global hook, ``m.compile()`` and a jit trace
    go through it; keywords, and a call from user code, go to the graphed callable."""
    x = torch.randn(8, 8)
    net = torch.nn.Linear(8, 8)
    gm = graphtree.graphed(net)
    gc = gm._graphtree_call
    with torch.no_grad():
        want = net(x)
        _, _, launches = _record(gc, x)
        for _ in range(3):
            gm(x)
        seen = count_fast_replays(monkeypatch)
        gm(x)
        assert seen == [1] and launches.n == 4, (seen, launches.n)
        hooked = []
        handle = gm.register_forward_hook(lambda m, i, o: hooked.append("own"))
        gm(x)
        handle.remove()
        handle = torch.nn.modules.module.register_module_forward_hook(lambda m, i, o: hooked.append(type(m).__name__))
        try:
            gm(x)
        finally:
            handle.remove()
        assert hooked == ["own", "Linear", "GraphedModule"], hooked  # (a global hook: run eagerly, hooks inside)
        object.__setattr__(gm, "_compiled_call_impl", lambda *a, **k: "compiled")
        assert gm(x) == "compiled"
        object.__setattr__(gm, "_compiled_call_impl", None)
        gm(x)  # (the Python path: hook handles were made since, the fast hit decides again)
        gm(x)
        assert seen[-1] == 1, seen
        n = len(seen)
        monkeypatch.setattr(graphed_module.user_code, "active", True)  # (inside another's warm-up: inline)
        assert torch.allclose(gm(x), want) and len(seen) == n  # (forward run inline: no fast hit asked)
        monkeypatch.setattr(graphed_module.user_code, "active", False)
        with monkeypatch.context() as m:  # (another thread in user code: this one's own flag decides)
            m.setattr(graphed_module.UserCode, "threads", 1)
            gm(x)
            assert len(seen) == n + 1, seen
        n = len(seen)
        with monkeypatch.context() as m:
            m.setattr(gc, "past_fast_hit", lambda args, kwargs: ("the Python path", args, kwargs))
            assert gm(input=x) == ("the Python path", (), {"input": x}) and len(seen) == n  # (no fast hit asked)
        gm(x)
        assert len(seen) == n + 1
    native = hasattr(stand_ins, "module_entry")
    assert (graphed_module._made_by is stand_ins) == native
