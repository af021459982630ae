"""Replays of a graph torch captured its own way (no native stand-ins: torch >= 2.12, or no C++
compiler or CUDA headers) draw from each generator's state at the call, as eager does, when
``graphsafe_set_state`` gave the generator another state since the capture (tree/draws.py).

CPU: a generator, its states and a graph are modelled as torch's CUDA ones behave (a graph's replay
reads and advances the state registered at its capture); the GPU test is
tests/gpu/test_random_gpu.py::test_a_switched_generator_state_is_followed_without_the_native_part.
"""

from __future__ import annotations

from graphtree.tree import draws


class _State:
    def __init__(self, seed: int, offset: int = 0) -> None:
        self.seed, self.offset = seed, offset


class _Gen:
    """torch.Generator's calls on a CUDA generator, over a state it may share with others."""

    def __init__(self, state: _State) -> None:
        self.state = state

    def get_offset(self) -> int:
        return self.state.offset

    def set_offset(self, offset: int) -> None:
        self.state.offset = offset

    def initial_seed(self) -> int:
        return self.state.seed

    def manual_seed(self, seed: int) -> None:
        self.state.seed, self.state.offset = seed, 0

    def graphsafe_get_state(self) -> _Gen:
        return _Gen(self.state)

    def graphsafe_set_state(self, other: _Gen) -> None:
        self.state = other.state


class _Graph:
    """A captured graph that draws ``increment`` from the state registered at its capture."""

    def __init__(self, registered: _State, increment: int) -> None:
        self.registered, self.increment = registered, increment
        self.drawn: list[tuple[int, int]] = []

    def replay(self) -> None:
        self.drawn.append((self.registered.seed, self.registered.offset))
        self.registered.offset += self.increment


def _recorded(gen: _Gen, increment: int = 8) -> _Graph:
    graph = _Graph(gen.state, increment)
    setattr(graph, draws._ATTR, draws._Registered(((gen.graphsafe_get_state(), gen),)))
    draws.replay(graph)  # the recording's own replay
    return graph


def test_a_replay_after_the_generator_switched_state_draws_from_the_state_it_holds_now():
    gen = _Gen(_State(9))
    graph = _recorded(gen)
    own = gen.graphsafe_get_state()
    other = _Gen(_State(77, 40))
    gen.graphsafe_set_state(other.graphsafe_get_state())
    draws.replay(graph)
    assert graph.drawn[-1] == (77, 40)  # eager draws from the state the generator holds
    assert other.get_offset() == 48  # ... and moves that state on
    assert own.get_offset() == 8 and own.initial_seed() == 9  # the other state is left as it was
    gen.graphsafe_set_state(own)
    draws.replay(graph)
    assert graph.drawn[-1] == (9, 8) and own.get_offset() == 16


def test_a_replay_on_a_clone_of_the_registered_state_moves_the_clone_on_not_the_original():
    gen = _Gen(_State(9))
    graph = _recorded(gen)
    own = gen.graphsafe_get_state()
    clone = _Gen(_State(9, own.get_offset()))  # clone_state(): equal values, another state
    gen.graphsafe_set_state(clone)
    draws.replay(graph)
    assert graph.drawn[-1] == (9, 8)
    assert clone.get_offset() == 16 and own.get_offset() == 8  # as eager leaves them


def test_a_replay_with_no_switch_is_torchs_own_and_a_graph_that_draws_nothing_replays_plainly():
    gen = _Gen(_State(3))
    graph = _recorded(gen)
    for _ in range(3):
        draws.replay(graph)
    assert graph.drawn == [(3, 0), (3, 8), (3, 16), (3, 24)] and gen.get_offset() == 32
    quiet = _recorded(_Gen(_State(3)), increment=0)
    assert getattr(quiet, draws._ATTR) is None  # nothing to follow
