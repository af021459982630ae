"""Breakable recordings on the CPU (issue 26): the parts that need no GPU. The mechanism itself is
tested on a GPU in tests/gpu/test_breaks_gpu.py."""

from __future__ import annotations

import pytest
import torch

import graphtree
from graphtree.tree.breaks import READS, is_read, value_key


def test_eager_is_public_and_an_ordinary_call_outside_a_recording():
    assert "eager" in graphtree.__all__

    @graphtree.eager
    def log(x: torch.Tensor) -> float:
        """Logs."""
        log.calls += 1
        return float(x.sum())

    log.calls = 0
    assert log(torch.ones(3)) == 3.0 and log.calls == 1
    assert log.__doc__ == "Logs." and log.__name__ == "log"
    f = graphtree.graphed(lambda x: x * 2 + log(x))  # on the CPU: eager, the part is a plain call
    assert torch.equal(f(torch.ones(2)), torch.full((2,), 4.0)) and log.calls == 2


def test_eager_refuses_what_is_not_callable():
    with pytest.raises(TypeError, match=r"graphtree\.eager needs a function"):
        graphtree.eager(3)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [-1, 1.5, "8"])
def test_max_break_values_is_checked(bad):
    with pytest.raises(ValueError, match="max_break_values must be a non-negative int"):
        graphtree.graphed(lambda x: x, max_break_values=bad)


def test_a_reads_key_tells_types_apart_and_nan_from_itself():
    assert value_key(True) != value_key(1) and value_key(1) != value_key(1.0)
    assert value_key(float("nan")) == value_key(float("nan"))
    assert torch.ops.aten._local_scalar_dense.default in READS and torch.ops.aten.is_nonzero.default in READS


def test_stats_say_recordings_for_new_values_only_when_there_are_some():
    s = graphtree.stats()
    assert "for new values" not in str(s)
    s.values = 2
    assert "2 for new values read on the host" in str(s)


def test_a_copy_to_the_host_is_keyed_by_its_contents():
    a, b = torch.tensor([1, 2, 3]), torch.tensor([1, 2, 4])
    assert value_key(a) == value_key(a.clone()) and value_key(a) != value_key(b)
    assert value_key(a) != value_key(a.float()) and value_key(a) != value_key(a.view(3, 1))


def test_reads_are_of_cuda_tensors_only():
    x = torch.ones(3)  # (the CUDA cases run in tests/gpu/test_breaks_gpu.py)
    assert not is_read(torch.ops.aten._local_scalar_dense.default, (x,), {})
    assert not is_read(torch.ops.aten._to_copy.default, (x,), {"device": torch.device("cpu")})


def test_streams_made_to_wait_while_a_capture_is_open_are_noted_as_forked():
    from types import SimpleNamespace

    from graphtree.tree.breaks import Breaks

    b = Breaks(begin=lambda g: None, new_graph=object, first_replay=lambda: None)
    assert getattr(torch.cuda.Event.wait, "__wrapped__", None) is not None  # every Event.wait is seen
    origin, side, other = (SimpleNamespace(cuda_stream=n) for n in (1, 2, 3))
    b.origin = origin
    b.note_wait(side)  # no capture open yet: nothing forked
    assert b.forked == {}
    b.open = True
    b.note_wait(side)
    b.note_wait(origin)  # the capture's own stream joining others is no fork
    b.note_wait(SimpleNamespace())  # a torch.Stream (no cuda_stream): not a CUDA stream
    b.note_wait(side)
    assert b.forked == {2: side}
    b.open = False
    b.note_wait(other)
    assert list(b.forked) == [2]


def test_a_segment_that_writes_memory_the_call_did_not_make_is_marked():
    """A replayed segment that wrote an input or state in place must not be followed by an eager
    run of the whole call (it would write it twice): Breaks marks such segments."""
    from graphtree.tree.breaks import Breaks

    b = Breaks(begin=lambda g: None, new_graph=object, first_replay=lambda: None)
    b.sites.on = False  # (no capture here: no graph nodes to note)
    state = torch.zeros(4)
    b.open = True
    with b:
        y = state * 2  # new memory
        y.add_(1)  # written: made by the call
        torch.mul(y, 3, out=y)
        v = state.view(2, 2)  # a view of the state: not new memory
    assert not b.changes_state
    with b:
        v.add_(1)  # the state written through its view
    assert b.changes_state
    b.changes_state = False
    with b:
        torch.add(state, 1, out=state)  # out= the state
    assert b.changes_state
