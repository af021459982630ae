"""Exceptions raised by the user's own function reach the caller unchanged, and never kill the process.

Each scenario runs in a subprocess under a timeout: the bug this guards against was a C++ abort
(``uc >= 0 INTERNAL ASSERT FAILED`` in ``releasePool``, from ``~CUDAGraph``) long after the
exception had been caught, when the failed recording's graph was destroyed.
"""

import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.own_process  # all it checks runs in subprocesses (gpu_session.sh: `own`, `files`)

SCRIPT = textwrap.dedent(
    """
    import gc, itertools, sys, torch, graphtree

    kind, when = sys.argv[1], sys.argv[2]          # when: "warm-up" or "record" (call 1 or 2)
    raise_on = {"warm-up": 1, "record": 2}[when]
    # (a counter graphtree does not key: `calls["n"] += 1` would be a setting the code reads, a new
    # signature on every call, and no replay would advance it)
    calls = itertools.count(1)
    raised = []

    def f(x):
        n = next(calls)
        y = x * 2
        if n == raise_on:
            if kind == "value":
                e = ValueError("boom from user code")
            elif kind == "interrupt":
                e = KeyboardInterrupt()
            else:                                   # a real out-of-memory inside the call
                torch.empty(1 << 50, dtype=torch.uint8, device=x.device)
            raised.append(e)
            raise e
        return y + 1

    g = graphtree.graphed(f, name="f")
    x = torch.randn(256, device="cuda")
    expected = {"value": ValueError, "interrupt": KeyboardInterrupt, "oom": torch.OutOfMemoryError}[kind]
    for i in range(6):
        graphtree.mark_step()
        try:
            out = g(x)
        except BaseException as e:
            assert isinstance(e, expected), repr(e)
            assert not raised or e is raised[0], "not the same exception object"
            print("propagated", type(e).__name__, "on call", i + 1)
            continue
        assert torch.equal(out, x * 2 + 1), i
    s = graphtree.stats()
    print("stats:", s)
    assert s.replays >= 2, s                        # the tree stayed usable: it recorded and replays
    assert not s.eager, s.eager                     # the user's error did not turn graphing off
    del out
    gc.collect()
    graphtree.reset()
    gc.collect()
    torch.cuda.synchronize()
    print("clean exit")
    """
)


@pytest.mark.parametrize("when", ["warm-up", "record"])
@pytest.mark.parametrize("kind", ["value", "interrupt", "oom"])
def test_user_exceptions_propagate_and_the_process_exits_cleanly(kind, when, tmp_path):
    script = tmp_path / "user_error.py"
    script.write_text(SCRIPT)
    try:
        proc = subprocess.run(
            [sys.executable, str(script), kind, when],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"hung: {e.stdout!r} {e.stderr!r}")
    out = proc.stdout + proc.stderr
    print(out[-3000:])
    assert proc.returncode == 0, out[-3000:]
    assert "terminate called" not in out and "INTERNAL ASSERT" not in out
    assert "propagated" in proc.stdout and "clean exit" in proc.stdout
