"""Random numbers in recordings: every replay draws what eager would draw, and other threads draw meanwhile.

A CUDA random operation draws from a generator's (seed, offset) and moves the offset on. A graph
captured by torch registers the default generator's state: each replay writes the generator's
current seed and offset into the graph and advances the offset by what the capture drew, so that
replays draw eager's numbers (``torch.manual_seed``, ``set_rng_state`` and ``fork_rng`` act on them
as on eager calls). Up to torch 2.11 that state is the whole process's and is in capture mode for
the length of a capture: a random op of any other thread fails then ("Offset increment outside
graph capture encountered unexpectedly"; torch 2.12 keeps capture state per capture).

With graphtree's native CUDA part (torch < 2.12), a capture keeps the generators out and draws from
stand-ins (:class:`Draws`): a fresh generator per capture for the default one, registered in its
place (``_native.capture_begin_isolated``), and one for each explicit ``generator=`` the callable's
warm-ups drew from. The capture's random operations run their own kernels with the stand-in as
their generator (``_torch.draw_from``). The first replay goes through ``_native.replay_drawing``:
under the generators' mutexes, the stand-ins take their generators' seed and offset, torch's
replay writes them into the graph's device slots and launches it, and the generators' offsets move
as far as the stand-ins' did (how far each moves per replay: the capture's increments). Later
replays (``_native.launch_drawing``) read each generator's seed and offset and advance it by its
increment under its mutex, write them into the slots on the stream (``cuStreamWriteValue64``, no
kernel: torch's prologue launches two ``fill_`` kernels per generator, about 20 us of CPU a call on
the H100 host) and launch the graph. A slot that holds its value already is not written: the seed
seldom changes, and each capture ends with an add that moves its offset slots on by what it drew
(:func:`seal`), so that after a replay they hold where the generators are; only a draw by something
else in between (an eager call, another graph, ``manual_seed``) makes the next replay write. The
numbers are eager's at that point of the sequence, the generators end where eager leaves them,
and other threads' random ops never meet a generator in capture mode (they wait on a mutex for a
few reads). A graph that drew nothing replays plainly.

Without the native part (torch >= 2.12, or no C++ compiler or CUDA headers), torch's own capture:
the default generator and the explicit ones are registered as they are, and torch's replay
prologue writes the registered *state's* seed and offset into the graph and advances that state.
A generator switched to another state with ``graphsafe_set_state`` between calls no longer holds
the registered one, and the replay would draw from the old state (torch's
``test_graph_graphsafe_set_get_rng_state``, ported, differed from eager from its third call on an
H200 in the twenty-second session). So each such recording keeps a generator on each state it
registered (``graphsafe_get_state``, :class:`_Registered`), and a replay follows the switch
(:func:`_replay_following`): where the generator's seed or offset differ from the registered
state's, that state takes them for the replay and gets its own back after; where the generator did
not move with the replay (another state of equal values, a ``clone_state()``), the generator is
moved on and the registered state put back. Both are reads and writes of the generators' seeds
and offsets without their mutexes, as torch's own prologue makes them. On torch < 2.12 without
the native part, another thread's random op still raises while a capture runs (torch's capture
puts the process's generator state in capture mode): the thread's error, not a wrong number.

Example (what :mod:`graphtree.tree.recorder` does)::

    draws = Draws(device, seen(gc.id))
    draws.begin(graph, pool_id, watch)      # instead of graph.capture_begin(...)
    out = fn(*args)                         # captured; its random ops draw from the stand-ins
    seal(graph)                             # each replay moves its offset slots on itself
    graph.capture_end()
    replay(graph)                           # the recording's outputs: eager's numbers
    launch = launcher(graph)                # each later replay: launch()
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple, cast

import torch

from graphtree import _native, _torch

log = logging.getLogger("graphtree")

_ATTR = "graphtree_draws"
"""A graph's attribute: how its replays hand its stand-ins their generators' seeds and offsets (a
:class:`_Pending` before its first replay, then ``_native.launch_drawing`` bound to what
``_native.prepare_drawing`` made), or None."""

_NATIVE_WAIT_S = 300.0

_seen: dict[int, dict[int, torch.Generator]] = {}
_seen_lock = threading.Lock()


def note(callee_id: int, generators: dict[int, torch.Generator]) -> None:
    """Remember the explicit CUDA generators a warm-up of callable ``callee_id`` drew from (by
    ``_torch.generator_key``): its recordings give each a stand-in."""
    if generators:
        with _seen_lock:
            _seen.setdefault(callee_id, {}).update(generators)


def seen(callee_id: int) -> list[torch.Generator]:
    """The explicit CUDA generators the warm-ups of callable ``callee_id`` drew from."""
    with _seen_lock:
        return list(_seen.get(callee_id, {}).values())


class Draws:
    """The generators one capture on ``device`` draws from, and their stand-ins.

    ``explicit``: generators other than the default one that the captured code passes as
    ``generator=`` (those of another device are left alone). Build one per graph, then call
    :meth:`begin` in place of ``graph.capture_begin``.
    """

    def __init__(self, device: int, explicit: Iterable[torch.Generator] = ()) -> None:
        where = torch.device("cuda", device)
        default = torch.cuda.default_generators[device]
        self.device = device
        key = _torch.generator_key
        # (a generator made with device="cuda" says no index: it draws on the current device)
        here = [g for g in explicit if g.device.type == "cuda" and g.device.index in (None, device)]
        self.explicit = [g for g in here if key(g) != key(default)]
        self._standins = {key(g): torch.Generator(device=where) for g in (default, *self.explicit)}
        self.pairs = tuple((self._standins[key(g)], g) for g in (default, *self.explicit))
        self.isolated = False

    def begin(self, graph: torch.cuda.CUDAGraph, pool_id: tuple[int, int], watch: _torch.StateWatch) -> bool:
        """Begin capturing into ``graph`` (thread-local mode) with the generators kept out where
        graphtree's native part can (True), else torch's own way (False)."""
        helpers = _native_helpers()
        if helpers is not None:
            for standin, _ in self.pairs[1:]:
                graph.register_generator_state(standin)
            self.isolated = _torch.begin_capture(graph, pool_id, self.device, self.pairs[0][0])
        if not self.isolated:
            # each generator's state as torch registers it (capture_begin: the default one's)
            held = tuple((gen.graphsafe_get_state(), gen) for _, gen in self.pairs)
            for gen in self.explicit:
                graph.register_generator_state(gen)
            _torch.begin_capture(graph, pool_id, self.device, None)
            setattr(graph, _ATTR, _Registered(held))
            return False
        watch.standin_of = self.standin_of
        slots = tuple(helpers.standin_slots(standin) for standin, _ in self.pairs)  # (read while capturing)
        setattr(graph, _ATTR, _Pending(helpers, self.pairs, slots))
        return True

    def standin_of(self, gen: torch.Generator | None) -> torch.Generator:
        """The stand-in a captured random operation draws from in place of ``gen`` (None: the default one)."""
        if gen is None:
            return self.pairs[0][0]
        standin = self._standins.get(_torch.generator_key(gen))
        if standin is not None:
            return standin
        if gen.device.type != "cuda":
            return gen
        raise _torch.RandomOutsideCapture(
            "it draws from a torch.Generator its warm-up did not draw from (a new one each call?): a replay "
            "could not advance it as eager does"
        )


class _Pending(NamedTuple):
    """A graph captured with stand-ins, not yet replayed: its first replay finds out what it draws."""

    helpers: Any  # graphtree's native helpers, which began the capture (tests switch _native.loaded off)
    pairs: tuple[tuple[torch.Generator, torch.Generator], ...]
    slots: tuple[tuple[int, int], ...]  # where its kernels read each stand-in's seed and offset
    sealed: bool = False  # its replays move their offset slots on themselves (seal)


class _Registered(NamedTuple):
    """A graph torch captured its own way (no stand-ins), not yet replayed: its first replay finds
    out which generators it draws from."""

    pairs: tuple[tuple[torch.Generator, torch.Generator], ...]  # (on the state registered, the generator)


def _first_replay(graph: torch.cuda.CUDAGraph, how: _Registered) -> None:
    """Replay ``graph`` right after its capture (no generator switched since) and keep, for its
    later replays, the generators it draws from with how far each moves per replay."""
    before = [held.get_offset() for held, _ in how.pairs]
    graph.replay()
    after = [held.get_offset() for held, _ in how.pairs]
    drawing = tuple((held, gen, a - b) for (held, gen), b, a in zip(how.pairs, before, after) if a != b)
    setattr(graph, _ATTR, functools.partial(_replay_following, graph, drawing) if drawing else None)


def _replay_following(
    graph: torch.cuda.CUDAGraph, drawing: tuple[tuple[torch.Generator, torch.Generator, int], ...]
) -> None:
    """Replay a graph torch captured its own way so that it draws from each generator's state now,
    as eager does, though ``graphsafe_set_state`` may have given the generator another state than
    the one torch registered (``held`` shares that one)."""
    moved = []
    for held, gen, increment in drawing:
        offset, seed = gen.get_offset(), gen.initial_seed()
        own = None
        if held.get_offset() != offset or held.initial_seed() != seed:  # another state: lend it gen's values
            own = (held.initial_seed(), held.get_offset())
            held.manual_seed(seed)  # (resets the offset: set after)
            held.set_offset(offset)
        moved.append((held, gen, increment, offset, own))
    graph.replay()  # torch's prologue: the registered states' values into the graph, then advanced
    for held, gen, increment, offset, own in moved:
        if gen.get_offset() == offset:  # the replay advanced the registered state, not gen's
            gen.set_offset(offset + increment)
            if own is None:
                held.set_offset(offset)
            else:
                held.manual_seed(own[0])
                held.set_offset(own[1])


def seal(graph: torch.cuda.CUDAGraph) -> None:
    """Right before ``graph.capture_end()`` (side streams joined), on the capturing stream: if the
    capture draws from stand-ins, capture as its last work an add that moves each stand-in's offset
    slot on by what the capture drew. A replay then leaves the slots where the generators are after
    it, and the next replay writes nothing unless something else drew in between
    (``_native.launch_drawing``)."""
    how = getattr(graph, _ATTR, None)
    if isinstance(how, _Pending) and hasattr(how.helpers, "standin_seal"):
        for standin, _ in how.pairs:
            how.helpers.standin_seal(standin)
        setattr(graph, _ATTR, how._replace(sealed=True))


def replay(graph: torch.cuda.CUDAGraph) -> None:
    """Replay ``graph`` drawing eager's numbers.

    The first replay of a graph captured with stand-ins goes through torch's replay (its prologue
    writes the seeds and offsets), which says how far each generator moves per replay; later ones
    write them with no kernel (``_native.launch_drawing``), or replay plainly if it draws nothing."""
    how = getattr(graph, _ATTR, None)
    if how is None:
        graph.replay()
    elif isinstance(how, _Registered):
        _first_replay(graph, how)
    elif not isinstance(how, _Pending):
        how()
    else:
        increments = how.helpers.replay_drawing(graph, how.pairs)
        if not any(increments):
            setattr(graph, _ATTR, None)  # it draws nothing: plain replays from now on
        elif len(how.pairs) <= 2:  # (more generators: each replay goes through replay_drawing)
            prepared = how.helpers.prepare_drawing(graph, how.pairs, how.slots, increments, how.sealed)
            setattr(graph, _ATTR, functools.partial(how.helpers.launch_drawing, prepared))


def launcher(graph: torch.cuda.CUDAGraph) -> Callable[[], Any]:
    """A zero-argument callable that replays ``graph`` as :func:`replay` does, at the least cost."""
    how = getattr(graph, _ATTR, None)
    if how is None:
        return _torch.graph_launcher(graph)
    if isinstance(how, (_Pending, _Registered)):  # (a segment made before its first replay: tree/breaks.py)
        return functools.partial(replay, graph)
    return cast(Callable[[], Any], how)


def plain_exec(graph: torch.cuda.CUDAGraph) -> int:
    """The ``cudaGraphExec_t`` of a graph whose replay is a plain launch (it draws nothing: torch's
    replay would add nothing to ``cudaGraphLaunch`` but its device guard), or 0 where a replay must
    go through :func:`launcher`'s callable (a graph that draws, or one not yet replayed)."""
    return _torch.graph_exec(graph) if getattr(graph, _ATTR, None) is None else 0


_waited = False


def _native_helpers() -> Any:
    """graphtree's native helpers with their CUDA part, or None. While their first build runs, a
    capture made with other threads alive waits for it (once; their cached build loads in under a
    second): torch's own capture would make those threads' random ops fail while it runs."""
    global _waited
    helpers = _native.capture  # (built with GRAPHTREE_NATIVE=0 too: that switch is the call path's)
    if helpers is None and not _waited and _native.status() == "building" and _other_threads():
        _waited = True
        log.info(
            "graphtree: waiting for the first build of its native helpers (other threads' random "
            "draws keep working during its captures with them)"
        )
        helpers = _native.wait_capture(_NATIVE_WAIT_S)
    return helpers if hasattr(helpers, "replay_drawing") else None


def _other_threads() -> bool:
    """Whether threads other than this one and graphtree's own are alive."""
    me = threading.current_thread()
    return any(t is not me and not t.name.startswith("graphtree") for t in threading.enumerate())
