"""Durable dumps of a failing call (``graphtree.debug.dump``), on the CPU."""

import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from graphtree.debug import DumpTooLarge, dump_on_error, load_dump, write_dump


def scaled_sum(x, *, scale, extra):
    """A module-level function: a dump names it by import path."""
    return (x * scale).sum() + extra[0]


def test_a_dump_round_trips_arguments_layouts_and_the_error(tmp_path):
    x = torch.arange(12, dtype=torch.float64).reshape(3, 4).t()  # not contiguous
    ids = torch.tensor([1, 2, 3])
    bf = torch.ones(2, dtype=torch.bfloat16)
    err = ValueError("device-side assert, say")
    path = write_dump(tmp_path / "d.gtdump", scaled_sum, (x,), {"scale": 2.5, "extra": [ids, bf, "s"]}, err)
    d = load_dump(path)
    (x2,) = d.args
    assert x2.stride() == x.stride() and x2.dtype == x.dtype and torch.equal(x2, x)
    assert torch.equal(d.kwargs["extra"][0], ids) and d.kwargs["extra"][1].dtype == torch.bfloat16
    assert d.kwargs["scale"] == 2.5 and d.kwargs["extra"][2] == "s"
    assert [t["stride"] for t in d.tensors] == [[1, 4], [1], [1]] and d.tensors[0]["device"] == "cpu"
    assert d.error == "ValueError: device-side assert, say"
    assert d.target == f"{__name__}:scaled_sum" and d.resolve() is scaled_sum
    assert torch.equal(d.resolve()(*d.args, **d.kwargs), scaled_sum(x, scale=2.5, extra=[ids, bf, "s"]))
    assert "cpu" in d.rng and d.versions["torch"] == torch.__version__


def test_what_cannot_be_imported_is_kept_by_value_weights_included(tmp_path):
    lin = torch.nn.Linear(2, 2)
    offset = torch.tensor([5.0, 6.0])
    x = torch.ones(2)
    cases = ((lambda v: v + offset, "<lambda>"), (lin, "torch.nn.modules.linear.Linear"), (lin.forward, "bound"))
    for fn, says in cases:
        d = load_dump(write_dump(tmp_path / "d.gtdump", fn, (x,), {}))
        assert d.target is None and says in d.target_note and "saved by value" in d.target_note, d.target_note
        again = d.resolve()
        assert again is not fn and torch.equal(again(x), fn(x))  # the closure's tensor, the weights
    assert d.cwd == os.getcwd() and os.path.abspath(os.path.dirname(__file__)) in d.sys_path


def test_a_callable_that_cannot_be_pickled_says_why_and_what_to_do(tmp_path):
    import threading

    lock = threading.Lock()
    d = load_dump(write_dump(tmp_path / "d.gtdump", lambda v: lock and v, (torch.ones(2),), {}))
    assert d.target is None and d.by_value is None and "could not be saved" in d.target_note, d.target_note
    assert "make it importable" in d.target_note
    with pytest.raises(ValueError, match="cannot be rebuilt"):
        d.resolve()


def test_dump_on_error_writes_and_reraises_the_same_error(tmp_path):
    raised = []

    @dump_on_error(dir=tmp_path)
    def bad(x):
        raised.append(IndexError("index 7 is out of bounds"))
        raise raised[0]

    with pytest.raises(IndexError) as info:
        bad(torch.zeros(3))
    assert info.value is raised[0]
    (path,) = tmp_path.glob("*.gtdump")
    assert any(str(path) in n for n in getattr(info.value, "__notes__", [str(path)]))
    assert load_dump(path).error == "IndexError: index 7 is out of bounds"


def picky(x):
    """A module-level function that fails on negative input (for the debug= option)."""
    if bool((x < 0).any()):
        raise ValueError("negative input")
    return x * 2


def test_graphed_debug_option_dumps_a_failing_call_that_reruns(tmp_path):
    import graphtree

    g = graphtree.graphed(picky, debug=tmp_path)
    assert torch.equal(g(torch.ones(2)), torch.full((2,), 2.0))  # a good call writes nothing
    assert list(tmp_path.glob("*.gtdump")) == []
    with pytest.raises(ValueError, match="negative input") as info:
        g(torch.tensor([1.0, -1.0]))
    (path,) = tmp_path.glob("picky-*.gtdump")
    assert any(str(path) in n for n in getattr(info.value, "__notes__", [str(path)]))
    d = load_dump(path)
    assert d.target == f"{__name__}:picky" and d.error == "ValueError: negative input"
    with pytest.raises(ValueError, match="negative input"):
        d.resolve()(*d.args, **d.kwargs)  # what `graphtree debug rerun` does, eagerly
    with pytest.raises(ValueError, match="debug must be a folder"):
        graphtree.graphed(picky, debug=3)


def test_a_dump_over_its_limit_is_refused_and_nothing_is_written(tmp_path):
    with pytest.raises(DumpTooLarge, match="over its limit"):
        write_dump(tmp_path / "big.gtdump", scaled_sum, (torch.zeros(1024),), {}, limit_bytes=100)
    assert list(tmp_path.iterdir()) == []

    @dump_on_error(dir=tmp_path, limit_bytes=100)
    def bad(x):
        raise RuntimeError("the user's error")

    with pytest.raises(RuntimeError, match="the user's error"):  # the user's error still comes first
        bad(torch.zeros(1024))
    assert list(tmp_path.iterdir()) == []


def test_bad_options_are_refused():
    with pytest.raises(TypeError, match="callable"):
        dump_on_error(3)
    with pytest.raises(ValueError, match="limit_bytes"):
        dump_on_error(lambda: 0, limit_bytes=0)


WRITER = textwrap.dedent(
    """
    import sys, torch
    from graphtree.debug import write_dump
    path, n = sys.argv[1], 0
    while True:  # rewrite the same dump forever, alternating sizes, until killed
        n += 1
        write_dump(path, print, (torch.full((1 << (12 + n % 6),), float(n)),), {"n": n})
        print(n, flush=True)
    """
)


def test_a_writer_killed_at_any_moment_leaves_a_loadable_dump(tmp_path):
    script = tmp_path / "writer.py"
    script.write_text(WRITER)
    target = tmp_path / "out" / "loop.gtdump"
    rng = random.Random(0)
    loaded = 0
    for _ in range(8):
        proc = subprocess.Popen(
            [sys.executable, str(script), str(target)], stdout=subprocess.PIPE, text=True, env={**os.environ}
        )
        try:
            assert proc.stdout is not None
            proc.stdout.readline()  # at least one dump written
            time.sleep(rng.uniform(0.0, 0.3))
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
        assert proc.returncode == -signal.SIGKILL
        d = load_dump(target)  # the old dump or the new one, never a torn file
        n = d.kwargs["n"]
        assert torch.equal(d.args[0], torch.full((1 << (12 + n % 6),), float(n)))
        loaded += 1
        leftovers = [p for p in target.parent.iterdir() if p.suffix == ".tmp"]
        for p in leftovers:  # a kill mid-write leaves at most a temporary file, never the dump's name
            assert p.name.startswith(".loop.gtdump.")
    assert loaded == 8


def test_a_model_unreadable_when_it_fails_is_dumped_as_kept_at_its_first_call(tmp_path):
    # on a GPU, a sticky CUDA error leaves a model's weights unreadable at the moment of the dump;
    # here an attribute that cannot be pickled, set after the first call, stands for that
    import threading

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(2, 2)

        def forward(self, x):
            if getattr(self, "broken", None) is not None:
                raise RuntimeError("fails now")
            return self.lin(x)

    net = Net()
    step = dump_on_error(net, dir=tmp_path, snapshot=True)
    x = torch.ones(2)
    step(x)  # its first call: how to rebuild it is kept
    net.broken = threading.Lock()
    with pytest.raises(RuntimeError, match="fails now"):
        step(x)
    (path,) = tmp_path.glob("*.gtdump")
    d = load_dump(path)
    assert "as of its first call" in d.target_note and "could not be saved" in d.target_note, d.target_note
    assert torch.equal(d.resolve()(x), net.lin(x))


LATE = textwrap.dedent(
    """
    import sys, torch, graphtree
    double = graphtree.graphed(lambda x: x * 2, name="double", debug=sys.argv[1])
    for i in range(3):
        double(torch.full((4,), float(i)))
    raise RuntimeError("CUDA error: an illegal memory access was encountered")  # as the user's synchronize() says it
    """
)


def test_a_cuda_error_surfacing_outside_the_graphed_calls_still_gets_dumps_of_the_last_ones(tmp_path):
    # issue 30: a fault inside a replay that CUDA reports at the user's own synchronize() left no dump
    proc = subprocess.run(
        [sys.executable, "-c", LATE, str(tmp_path)], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "surfaced outside the graphed calls" in proc.stderr and "illegal memory access" in proc.stderr
    assert "a dump of the last call of `double`" in proc.stderr, proc.stderr[-3000:]  # a note on the traceback
    last, before = sorted(tmp_path.glob("double-*.gtdump"), key=lambda p: "-before" in p.name)
    assert torch.equal(load_dump(last).args[0], torch.full((4,), 2.0))  # the last call's inputs
    assert torch.equal(load_dump(before).args[0], torch.full((4,), 1.0)) and before.name.endswith("-before.gtdump")


def test_an_ordinary_error_outside_the_calls_writes_no_dump(tmp_path):
    script = LATE.replace("CUDA error: an illegal memory access was encountered", "an ordinary error")
    proc = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 1 and "an ordinary error" in proc.stderr
    assert list(tmp_path.glob("*.gtdump")) == [] and "surfaced outside" not in proc.stderr


def test_the_snapshots_of_a_dropped_graphed_function_are_not_kept_for_late_faults(tmp_path):
    import gc

    import graphtree
    from graphtree.debug import late

    gc.collect()
    before = len(late._watched)
    g = graphtree.graphed(lambda x: x + 1, debug=tmp_path)
    g(torch.ones(2))
    assert len(late._watched) == before + 1
    del g
    gc.collect()
    assert len(late._watched) == before


def test_a_graphed_model_is_dumped_as_the_model_it_wraps(tmp_path):
    import graphtree

    net = torch.nn.Linear(2, 2)
    for wrapped in (graphtree.graphed(net), dump_on_error(graphtree.graphed(net), dir=tmp_path)):
        d = load_dump(write_dump(tmp_path / "d.gtdump", wrapped, (torch.ones(2),), {}))
        assert "torch.nn.modules.linear.Linear" in d.target_note, d.target_note
        again = d.resolve()
        assert type(again) is torch.nn.Linear and torch.equal(again.weight, net.weight)  # re-run eagerly


@pytest.mark.skipif(not hasattr(sys, "monitoring"), reason="sys.monitoring: Python 3.12+ (the GPU image's)")
def test_a_cuda_error_the_caller_catches_outside_graphed_calls_gets_the_dumps_in_its_notes(monkeypatch):
    # Issue 45, item 5: the excepthook saw only errors nobody caught; a RAISE callback sees them where raised.
    from graphtree.debug import late

    class Snapshots:
        calls = 2

    snaps = Snapshots()
    written: list[RuntimeError] = []

    def dump(error: RuntimeError, _snaps: object) -> list[Path]:
        written.append(error)
        error.add_note("graphtree: a dump of the last call was written to d.gtdump")
        return [Path("d.gtdump")]

    late.watch(snaps, dump)

    def users_sync() -> None:  # (torch.cuda.synchronize() meeting a device-side assert)
        raise RuntimeError("CUDA error: device-side assert triggered")

    try:
        users_sync()
    except RuntimeError as e:
        caught = e
    assert written == [caught], written
    assert "d.gtdump" in "".join(caught.__notes__)
    try:
        raise RuntimeError("shape mismatch")  # not a CUDA error: left alone
    except RuntimeError:
        pass
    try:
        users_sync()  # a dead context raises the same error at every later call: dumped once
    except RuntimeError:
        pass
    assert len(written) == 1

    def inside_wrapper() -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    late.handled_inside(inside_wrapper.__code__)  # (as dump_on_error's wrapper is: it dumps itself)
    try:
        inside_wrapper()
    except RuntimeError:
        pass
    assert len(written) == 1
    del snaps


@pytest.mark.skipif(not hasattr(sys, "monitoring"), reason="sys.monitoring: Python 3.12+ (the GPU image's)")
def test_a_fault_a_graphed_call_dumped_is_not_dumped_again_when_raised_later():
    # (the producer of test_planted_faults_gpu.py: the fault dumped inside a call, then raised again at exit)
    from graphtree.debug import late

    class Snapshots:
        calls = 2

    snaps = Snapshots()
    written: list[RuntimeError] = []
    late.watch(snaps, lambda error, _snaps: written.append(error) or [Path("d.gtdump")])
    inside = RuntimeError("CUDA error: misaligned address")
    late.mark_dumped(inside)  # (what dump_failure does for a fault inside a call)
    try:
        raise RuntimeError("CUDA error: misaligned address")  # the same fault, at a later sync
    except RuntimeError:
        pass
    assert written == []
    del snaps


def test_a_replay_error_marked_dumped_marks_the_cuda_error_it_was_raised_from():
    # A graphed call dumps a GraphReplayError raised from the CUDA error; at exit the dead context
    # raises that CUDA error again, whose first line is the one to know (an H100 run dumped it again,
    # over the call's own dumps)
    from graphtree.debug import late

    try:
        try:
            raise RuntimeError("CUDA error: device-side assert triggered")
        except RuntimeError as cuda:
            raise RuntimeError("graphtree: the replay of lookup(...) failed") from cuda
    except RuntimeError as replay:
        late.mark_dumped(replay)
    assert "CUDA error: device-side assert triggered" in late._reported
