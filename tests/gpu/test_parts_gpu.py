"""A module that cannot be graphed whole runs with its parts graphed (graphtree.tree.parts): its own
code eagerly, each submodule worth a graph replayed in its place. Each call compared with eager.
The detector graphed whole is in test_profile_gpu.py (it profiles the share of GPU time replayed)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import graphtree

DEV = "cuda"


@pytest.fixture(autouse=True)
def _fresh():
    graphtree.reset()
    yield
    graphtree.reset()


class _Heavy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.seq = nn.Sequential(*[m for _ in range(12) for m in (nn.Linear(64, 64), nn.ReLU())])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.seq(x)


class _Filter(nn.Module):
    """A heavy submodule, then a data-dependent shape in the module's own code, then a small one."""

    def __init__(self) -> None:
        super().__init__()
        self.heavy = _Heavy()
        self.small = nn.Linear(64, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.heavy(x)
        keep = y[y.sum(1) > 0]  # rows kept depend on the values: no graph can hold this
        return self.small(keep)


def _calls(model: nn.Module, g: nn.Module, n: int = 6) -> list[bool]:
    equal = []
    with torch.inference_mode():
        for i in range(n):
            graphtree.mark_step()
            x = torch.randn(32, 64, device=DEV, generator=torch.Generator(DEV).manual_seed(i))
            equal.append(bool(torch.equal(g(x), model(x))))
    return equal


def test_a_module_with_a_data_dependent_shape_runs_with_its_heavy_part_replayed():
    model = _Filter().to(DEV).eval()
    g = graphtree.graphed(model)
    assert _calls(model, g) == [True] * 6
    s = graphtree.stats()
    # call 1: the module's warm-up finds the shape; 2: the parts warm up; 3: record; 4-6: replay
    assert s.recordings == 1 and s.replays == 3, s
    assert g.graphed_callable.parts() == ["_Filter.heavy"]  # the small one left for good
    (own,) = s.eager  # the module's own reason, on every call but the first (its warm-up)
    assert "_Filter" in own and "synchronizes with the host" in own and s.eager[own] == 5, s.eager
    # warm-ups: the module's, the heavy part's, and the small part's one (1 operation: taken out,
    # later calls reach it directly, uncounted)
    assert s.warmups == 3, s
    assert "forward" not in model.small.__dict__ and "forward" not in model.heavy.__dict__  # put back


def test_parts_false_runs_such_a_module_wholly_eagerly():
    model = _Filter().to(DEV).eval()
    g = graphtree.graphed(model, parts=False)
    assert _calls(model, g) == [True] * 6
    s = graphtree.stats()
    assert s.recordings == 0 and s.replays == 0 and g.graphed_callable.parts() == [], s


class _Twice(nn.Module):
    """One submodule called on two inputs (a siamese encoder), then a data-dependent shape."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = _Heavy()

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        d = self.enc(a) - self.enc(b)  # the first output is still read after the second call
        return d[d.sum(1) > 0]


def test_a_part_called_twice_in_one_call_keeps_its_first_output_without_mark_step():
    """Without mark_step a function's second call starts a new step, which invalidates the first
    call's outputs: the module's own code would have read an overwritten output. The calls of a
    module's parts are one step per call of the module (manager.one_step)."""
    model = _Twice().to(DEV).eval()
    g = graphtree.graphed(model)
    with torch.inference_mode():
        for i in range(6):
            gen = torch.Generator(DEV).manual_seed(i)
            a, b = (torch.randn(32, 64, device=DEV, generator=gen) for _ in range(2))
            assert torch.equal(g(a, b), model(a, b)), i
    s = graphtree.stats()
    # call 1: the module's warm-up; 2: both calls of the part warm up; 3: both record; 4-6: replay
    assert s.recordings == 2 and s.replays == 6, s


class _Returns(nn.Module):
    """Returns its heavy part's output itself, beside a data-dependent selection."""

    def __init__(self) -> None:
        super().__init__()
        self.heavy = _Heavy()

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        y = self.heavy(x)
        return y, y[y.sum(1) > 0]


def test_what_the_module_returns_stays_the_callers_across_calls_as_eager():
    """`preds.append(model(x))` worked eagerly: a part's output returned by the module is copied out
    of the part's memory (its next replay would overwrite it, and reading it would raise)."""
    model = _Returns().to(DEV).eval()
    g = graphtree.graphed(model)
    got, want = [], []
    with torch.inference_mode():
        for i in range(6):
            x = torch.randn(32, 64, device=DEV, generator=torch.Generator(DEV).manual_seed(i))
            got.append(g(x))
            want.append(model(x))
    assert all(torch.equal(a, b) for gw, ww in zip(got, want) for a, b in zip(gw, ww))
    assert graphtree.stats().replays >= 3


class _Deep(nn.Module):
    """70 heavy blocks in a row, then a data-dependent selection: more part calls in one call than a
    step holds (manager.MAX_PATH_DEPTH)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Heavy() for _ in range(70))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        first = x = self.blocks[0](x)
        for b in self.blocks[1:]:
            x = b(x)
        y = x + first  # the first block's output, read after the 64th call
        return y[y.sum(1) > 0]


def test_past_the_depth_of_a_step_the_rest_of_the_call_runs_its_parts_eagerly():
    model = _Deep().to(DEV).eval()
    g = graphtree.graphed(model)
    with torch.inference_mode():
        for i in range(4):
            x = torch.randn(16, 64, device=DEV, generator=torch.Generator(DEV).manual_seed(i))
            assert torch.equal(g(x), model(x)), i
    s = graphtree.stats()
    deep = [r for r in s.eager if "more than 64 graphed calls" in r]
    assert deep and s.eager[deep[0]] >= 6, s.eager
    assert s.replays >= 64, s
