"""Say where a CUDA error that surfaces at a graph replay came from, and how to find the kernel.

A fault inside a CUDA graph (an illegal address, a device-side assert) is reported by CUDA at
the next call that touches the GPU, with no kernel and no Python line; the context is then dead.
When that call is graphtree's own replay (its input copy or its graph launch), graphtree knows
which recording it was replaying and which graph ran before it, and says so:
:func:`explain` turns the error into a :class:`GraphReplayError` that names both, keeps the
original as ``__cause__``, and tells the user how to re-run the call eagerly to name the kernel.

Example::

    try:
        out = node.replay(leaves, n)
    except RuntimeError as e:
        if is_cuda_error(e):
            raise explain(e, recording="step(float32[4, 8])", previous=None, debug_dir=None) from e
        raise
"""

from __future__ import annotations

import re

_CUDA_ERROR = re.compile(
    r"CUDA error|cudaError|CUDA_ERROR|illegal memory access|illegal address|device-side assert"
    r"|unspecified launch failure|misaligned address|cudaMemcpyAsync of an input failed",
    re.IGNORECASE,
)


class GraphReplayError(RuntimeError):
    """A CUDA error surfaced while graphtree replayed a recording (the original is ``__cause__``)."""


def is_cuda_error(exc: BaseException) -> bool:
    """Whether ``exc`` is an error CUDA reported (torch's ``RuntimeError``/``AcceleratorError``
    "CUDA error: ...", the runtime's names), not a Python error of graphtree's or the user's."""
    if not isinstance(exc, RuntimeError) or isinstance(exc, GraphReplayError):
        return False
    return bool(_CUDA_ERROR.search(str(exc)))


def explain(
    exc: BaseException, *, recording: str, previous: str | None, debug_dir: str | None, during: str | None = None
) -> GraphReplayError:
    """A :class:`GraphReplayError` for CUDA error ``exc`` raised while replaying ``recording``.

    ``previous`` names the recording replayed last before it, if any (CUDA reports a graph's
    fault at the next call, which may be this one); ``debug_dir`` is the folder of
    ``graphed(..., debug=...)``, where the failing call's dumps go; ``during`` replaces
    "while replaying the recording of RECORDING" when the error came before the replay.
    """
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if during is None:
        where = f"the graph replayed before it, {previous}, or this one" if previous else "this graph"
    else:  # this graph never ran
        where = f"the graph replayed before it, {previous}" if previous else "GPU work launched before it"
    lines = [
        f"graphtree: a CUDA error surfaced {during or f'while replaying the recording of {recording}'}: {first}",
        f"CUDA reports a fault inside a graph at the next call that touches the GPU, naming no kernel: "
        f"it came from {where}, or from GPU work launched since. The CUDA context is unusable now; "
        "restart the process.",
    ]
    if debug_dir is not None:
        lines.append(
            f"The dumps of this call and of the call before it (their inputs, copied before each call) are "
            f"written to {debug_dir}; re-run them eagerly to name the kernel and the Python line: "
            "graphtree debug rerun <dump>"
        )
    else:
        lines.append(
            "To name the kernel and the Python line: graph the function with graphtree.graphed(fn, debug=DIR) "
            "and reproduce, then re-run the dump eagerly with `graphtree debug rerun DIR/<dump>`; or call the "
            "function itself (`graphed_fn.fn`) with CUDA_LAUNCH_BLOCKING=1 set."
        )
    return GraphReplayError("\n".join(lines))
