"""PyTorch's operator database through graphtree: every sample of every operator, graphed as users
call it, compared with eager (issue 44).

For each operator of ``op_db`` that runs on the device, in float32 and each of float16, bfloat16,
int64, bool and complex64 it supports, for each of its sample inputs (at most ``--max-samples``):

- **plain**: ``graphtree.graphed(lambda *a, **k: op(*a, **k))`` called four times (warm-up,
  recording, two replays) with fresh sample tensors of the same signature (the samples drawn again
  under another seed), each call compared with eager on a copy of the same sample;
- **grad**: the same with inputs that require grad (where the operator supports autograd): the
  outputs and the inputs' gradients of ``sum(outputs)``;
- **autocast**: float32 samples under ``torch.autocast(device, torch.bfloat16)``;
- **inplace**: the in-place variant (``add_``...) on a fresh copy of the input each call, compared
  by the input it wrote (counted apart);
- **raw**: the first plain sample of each dtype captured on a stream of its own with
  ``CUDAGraph.capture_begin(capture_error_mode="thread_local")`` and replayed once: the ceiling
  (what is capturable at all). The raw tries run after the operator's graphtree samples, and the
  process is checked after each: one that leaves it unusable is recorded as ``raw_not`` (the worker
  is replaced, the operator's other raw tries are not made, no crash is counted).

Eager runs twice per call, each on its own copy and from the same seed. Where the two results
differ (uninitialized outputs such as ``empty_like``, unseeded draws, kernels with atomics), the
sample's values are not comparable: each of its calls is compared by structure, shapes, dtypes and
devices only (the record's ``compared`` is ``metadata``, else ``values``). Random operators are
compared under the same seed (graphtree draws eager's numbers). Each sample is classified:
``replayed`` (equal to eager, and at least two calls replayed), ``eager`` (equal, run eagerly: the
reasons graphtree gave are collected), ``error_as_eager`` (graphtree raised what eager raised),
``wrong`` (differs from eager without an error) or ``crash`` (an error eager does not raise, a
process left unusable, a worker killed or timed out). Operators run in worker processes; a worker
that dies or is left unusable by a sample is replaced, and its operator counted as a crash.

    python benchmarks/conformance/opinfo_sweep.py --json conformance.json [--workers 4]
        [--ops add,mul] [--max-samples 4] [--modes plain,grad,autocast,inplace,raw] [--device cuda]

The summary JSON: ``device, torch, ops, samples, replayed, eager, error_as_eager, wrong, crash,
raw_capturable, raw_tried, in_place{samples, replayed, eager, wrong, crash}, skipped`` (top-level
counts over out-of-place samples of every mode; ``raw_*`` over raw tries), ``raw_pairs{raw_capturable,
replayed}`` (over the samples that had a raw try only: how many were raw-capturable, and how many of
those graphtree replayed), ``metadata_only`` (samples of every mode, in place included, compared by
metadata only), ``exact`` / ``inexact`` (samples, run or replayed equal to eager and where eager
reproduces its own bits, that graphtree matched bit for bit, or only within the tolerances: an
oracle beyond OpInfo's, counted, not failed; ``inexact_cases`` names the first 50), ``reasons``
(each eager reason, grouped, with its count), ``failures`` (every wrong
and crash case), ``op_seconds`` (the 10 slowest operators and their seconds), ``seconds`` and
``ops_not_run`` (past ``--budget``). The records (``--records``) hold one line per sample and one
``mode: "op"`` line per operator with its ``seconds``. ``benchmarks/gpu_session.sh conform`` adds
the ported CUDA-graph tests' counts (``ported_tests``).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

DTYPE_NAMES = ("float32", "float16", "bfloat16", "int64", "bool", "complex64")
MODES = ("plain", "grad", "autocast", "inplace", "raw")
CALLS = 4  # warm-up, recording, two replays
OP_TIMEOUT_S = 120.0
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# --- comparing one call with eager -----------------------------------------------------------------
def _tensors(x: Any) -> list[Any]:
    import torch
    from torch.utils._pytree import tree_flatten

    return [t for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor)]


def _twin(t: Any) -> Any:
    """A copy of tensor ``t`` that is the same view of a copy of its whole storage (an operator that
    reads the storage, ``as_strided`` with an offset, sees the same memory), a leaf like ``t``; for a
    view of a leaf that requires grad (OpInfo's ``make(shape).transpose(1, 2)``), the same view of a
    twin of that leaf, so that both sides' gradients are taken with respect to the same kind of
    tensor (:func:`_grad_leaves`)."""
    import torch

    base = t._base
    if t.requires_grad and not t.is_leaf and base is not None and base.is_leaf and base.requires_grad:
        return _twin(base).as_strided(t.shape, t.stride(), t.storage_offset())
    if t.layout is not torch.strided or t.is_nested or t.is_conj() or t.is_neg() or t.device.type == "meta":
        return t.detach().clone().requires_grad_(t.requires_grad)
    storage = t.detach().untyped_storage().clone()
    copy = torch.empty(0, dtype=t.dtype, device=t.device).set_(storage, t.storage_offset(), t.shape, t.stride())
    return copy.requires_grad_(t.requires_grad)


def _own_leaves(x: Any) -> Any:
    """``x`` with each tensor that requires grad and is a leaf viewing another leaf's memory (OpInfo's
    attention samples: ``make(shape).transpose(1, 2)``, detached and made to require grad again)
    replaced by a leaf of its own memory: autograd routes such a tensor's gradient to the other leaf,
    so that gradients taken with respect to it are None, graphed or not, while its twin's are not."""
    import torch
    from torch.utils._pytree import tree_map

    def own(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.requires_grad and t.is_leaf and t._base is not None:
            return _twin(t)
        return t

    return tree_map(own, x)


def _copy(x: Any) -> Any:
    import torch
    from torch.utils._pytree import tree_map

    return tree_map(lambda t: _twin(t) if isinstance(t, torch.Tensor) else t, x)


def same(got: Any, want: Any) -> str | None:
    """None when ``got`` equals ``want`` as OpInfo tests compare (``assert_close``'s tolerances for
    the dtype, NaNs equal), else what differs."""
    import torch
    from torch.utils._pytree import tree_flatten

    g, gs = tree_flatten(got)
    w, ws = tree_flatten(want)
    if gs != ws:
        return f"structure {gs} != {ws}"
    for a, b in zip(g, w):
        if isinstance(b, torch.Tensor):
            if not isinstance(a, torch.Tensor):
                return f"{type(a).__name__} where eager gives a tensor"
            try:
                torch.testing.assert_close(a, b, equal_nan=True, check_device=True)
            except AssertionError as e:
                return str(e).strip().splitlines()[0][:200]
        elif a != b and not (a != a and b != b):  # (NaN == NaN here)
            return f"{a!r} != {b!r}"
    return None


def exact(got: Any, want: Any) -> str | None:
    """None when every tensor of ``got`` equals ``want``'s exactly (no tolerance; NaNs equal), else
    what differs: where a replay's bits differ from eager's within the OpInfo tolerances."""
    import torch
    from torch.utils._pytree import tree_flatten

    for a, b in zip(tree_flatten(got)[0], tree_flatten(want)[0]):
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            try:
                torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True, check_device=True)
            except AssertionError as e:
                return str(e).strip().splitlines()[0][:200]
    return None


def same_metadata(got: Any, want: Any) -> str | None:
    """None when ``got`` has ``want``'s structure and each of its tensors ``want``'s shape, dtype and
    device (what is compared where eager does not reproduce its own values), else what differs."""
    import torch
    from torch.utils._pytree import tree_flatten

    g, gs = tree_flatten(got)
    w, ws = tree_flatten(want)
    if gs != ws:
        return f"structure {gs} != {ws}"
    for a, b in zip(g, w):
        if isinstance(a, torch.Tensor) != isinstance(b, torch.Tensor):
            return f"{type(a).__name__} where eager gives {type(b).__name__}"
        for what in ("shape", "dtype", "device") if isinstance(b, torch.Tensor) else ():
            if getattr(a, what) != getattr(b, what):
                return f"{what} {getattr(a, what)} != {getattr(b, what)}"
    return None


def _run(
    fn: Callable[..., Any], args: tuple, kwargs: dict, seed: int | None, result: Callable[[Any, tuple], Any]
) -> tuple[Any, Exception | None]:
    """``result`` of one call of ``fn`` (after ``torch.manual_seed(seed)`` unless None), or what it raised."""
    import torch

    try:
        if seed is not None:
            torch.manual_seed(seed)
        return result(fn(*args, **kwargs), args), None
    except Exception as e:  # noqa: BLE001 - classified by the caller
        return None, e


def classify(
    graphed: Callable[..., Any],
    eager: Callable[..., Any],
    calls: list[tuple[tuple, dict]],
    seeded: bool,
    replays: Callable[[], int],
    reasons: Callable[[], list[str]],
    result: Callable[[Any, tuple], Any] = lambda out, args: out,
    comparable: bool = True,
) -> dict[str, Any]:
    """Call ``graphed`` and ``eager`` on each of ``calls`` (eager first, twice, each on its own copy and
    from the same seed), compare, and classify the sample. Where eager's two results differ on any call,
    eager does not reproduce its own values (uninitialized outputs, unseeded draws, atomics): the
    sample's calls are compared by structure, shapes, dtypes and devices only (``compared``:
    ``metadata``, else ``values``). ``result(out, args)``: what is compared (the output; for an in-place
    variant, the input it wrote). ``replays()``: replays so far; ``reasons()``: eager reasons so far.
    ``comparable=False``: the operator's values are never compared (:data:`UNINITIALIZED`)."""
    before = replays()
    by_values = comparable
    value_diff: str | None = None  # the first call whose values differ: wrong unless by_values turns False
    eager_exact = True  # eager reproduced its own bits on every call so far
    bits_diff: str | None = None  # the first call equal within tolerance but not bit for bit

    def done(outcome: str, reason: str) -> dict[str, Any]:
        if by_values and value_diff is not None:  # a call whose values differ came first
            outcome, reason = "wrong", value_diff
        out = {"outcome": outcome, "reason": reason, "compared": "values" if by_values else "metadata"}
        if by_values and eager_exact and outcome in ("replayed", "eager"):
            out["exact"] = bits_diff is None  # (an oracle beyond OpInfo's tolerances: counted, not failed)
            if bits_diff is not None:
                out["inexact"] = bits_diff
        return out

    for k, (args, kwargs) in enumerate(calls):
        seed = k if seeded else None
        want, eager_error = _run(eager, _copy(args), kwargs, seed, result)
        if eager_error is None and by_values:
            again, again_error = _run(eager, _copy(args), kwargs, seed, result)
            by_values = again_error is None and same(again, want) is None
            eager_exact = eager_exact and by_values and exact(again, want) is None
            del again
        got, graphed_error = _run(graphed, args, kwargs, seed, result)
        if eager_error is not None and graphed_error is not None:
            if type(graphed_error) is type(eager_error) or isinstance(graphed_error, type(eager_error)):
                return done("error_as_eager", f"{type(eager_error).__name__}")
            return done("crash", f"call {k}: {type(graphed_error).__name__}: {graphed_error}"[:300])
        if graphed_error is not None:
            return done("crash", f"call {k}: {type(graphed_error).__name__}: {graphed_error}"[:300])
        if eager_error is not None:
            return done("wrong", f"call {k}: eager raised {type(eager_error).__name__}, graphtree not")
        diff = same_metadata(got, want)
        if diff is not None:
            return done("wrong", f"call {k}: {diff}")
        if by_values and value_diff is None:
            diff = same(got, want)
            value_diff = f"call {k}: {diff}" if diff is not None else None
            if diff is None and eager_exact and bits_diff is None:
                bits = exact(got, want)
                bits_diff = f"call {k}: {bits}" if bits is not None else None
        del got, want
    if by_values and value_diff is not None:
        return done("wrong", value_diff)
    if replays() - before >= 2:
        return done("replayed", "")
    return done("eager", "; ".join(sorted(set(reasons())))[:300] or "not replayed")


# --- one operator, in a worker -------------------------------------------------------------------
def _seeded(op: Any) -> bool:
    import torch

    tag = getattr(torch.Tag, "nondeterministic_seeded", None)
    fn = getattr(op, "aten_name", None)
    packet = getattr(torch.ops.aten, fn, None) if isinstance(fn, str) else None
    tags = {t for name in (packet.overloads() if packet is not None else ()) for t in getattr(packet, name).tags}
    return tag in tags or "dropout" in op.name or op.name.startswith(("rand", "normal", "bernoulli", "multinomial"))


UNINITIALIZED = frozenset({"empty", "empty_like", "empty_permuted", "empty_strided", "new_empty", "new_empty_strided"})
"""Operators whose outputs are uninitialized memory: compared by metadata only, as OpInfo's own tests
skip them ("Expected: empty_like is not comparable"). Eager's two runs can agree by chance (the
allocator hands the same block back), which the twice-run check alone would take for values."""
NONDETERMINISTIC_GRAD = frozenset(
    {
        "nn.functional.scaled_dot_product_attention",
        "torch.ops.aten._flash_attention_forward",
        "torch.ops.aten._efficient_attention_forward",
    }
)
"""Operators whose backward accumulates with atomics (torch's docs: not deterministic unless
``torch.use_deterministic_algorithms(True)``): in grad mode their values are compared only where they
reproduce, which two eager runs agreeing does not prove (an H100 sweep: a third eager run, graphtree's
call running eagerly, differed). Their grad-mode samples are compared by metadata."""


def _samples(op: Any, device: str, dtype: Any, requires_grad: bool, max_samples: int) -> list[list[Any]]:
    """``max_samples`` samples, each drawn CALLS times under other seeds (same signatures, new values)."""
    import torch

    draws = []
    for seed in range(CALLS):
        torch.manual_seed(1000 + seed)
        it = op.sample_inputs(device, dtype, requires_grad=requires_grad)
        draws.append([s for _, s in zip(range(max_samples), it)])
    out = []
    for i in range(len(draws[0])):
        group = [d[i] for d in draws if i < len(d)]
        shapes = {tuple((tuple(t.shape), t.dtype) for t in _tensors((s.input, s.args, s.kwargs))) for s in group}
        out.append(group if len(shapes) == 1 else group[:1] * CALLS)  # (a sample of another shape: the same again)
    return out


def _stats() -> tuple[Callable[[], int], Callable[[], list[str]]]:
    import graphtree

    return (lambda: graphtree.stats().replays), (lambda: list(graphtree.stats().eager))


def sweep_op(op: Any, device: str, modes: tuple[str, ...], max_samples: int) -> Iterator[dict[str, Any]]:
    """Every sample record of one operator (see the module's docstring)."""
    import torch

    import graphtree

    replays, reasons = _stats()
    seeded = _seeded(op)
    raw_tries: list[tuple[dict[str, Any], Callable[..., Any], tuple[tuple, dict]]] = []
    supported = {str(d).removeprefix("torch.") for d in op.supported_dtypes(device)}
    for dname in (d for d in DTYPE_NAMES if d in supported):
        dtype = getattr(torch, dname)
        base = {"op": op.name, "variant": op.variant_test_name, "dtype": dname}
        plans: list[tuple[str, bool]] = [("plain", False)]
        if "grad" in modes and op.supports_autograd and dtype.is_floating_point:
            plans.append(("grad", True))
        if "autocast" in modes and dname == "float32" and device == "cuda":
            plans.append(("autocast", False))
        if "inplace" in modes and op.inplace_variant is not None:
            plans.append(("inplace", False))
        for mode, grad in plans:
            try:
                groups = _samples(op, device, dtype, grad, max_samples)
            except Exception as e:  # noqa: BLE001 - the database's own sample code failed: not graphtree's
                yield {**base, "mode": mode, "sample": -1, "outcome": "skipped", "reason": f"samples: {e}"[:200]}
                continue
            for i, group in enumerate(groups):
                graphtree.reset()
                calls = [_own_leaves(((s.input, *s.args), dict(s.kwargs))) for s in group]
                fn = op.inplace_variant if mode == "inplace" else op.op
                graphed = graphtree.graphed(lambda *a, _fn=fn, **k: _fn(*a, **k), name=f"{op.name}.{mode}")
                result: Callable[[Any, tuple], Any] = (
                    (lambda out, args: args[0]) if mode == "inplace" else _with_grads(grad)
                )
                if mode == "inplace":  # a fresh copy of the input each call (the caller's tensor is written)
                    calls = [((a[0].detach().clone(), *a[1:]), k) for a, k in calls]
                ctx = torch.autocast(device, torch.bfloat16) if mode == "autocast" else _nothing()
                with ctx:
                    comparable = op.name not in UNINITIALIZED and not (grad and op.name in NONDETERMINISTIC_GRAD)
                    rec = classify(graphed, fn, calls, seeded, replays, reasons, result, comparable)
                yield {**base, "mode": mode, "sample": i, **rec}
                if "raw" in modes and mode == "plain" and i == 0 and device == "cuda":
                    raw_tries.append(({**base, "mode": "raw", "sample": i}, fn, calls[0]))
                if not _healthy(device):
                    raise SystemExit(3)  # the worker is replaced; the operator counts as a crash
    # The ceilings last: a raw capture that leaves the process unusable then costs no graphtree result.
    yield from raw_ceilings(raw_tries, seeded, device)


def _written(out: Any, args: tuple) -> Any:
    """What an in-place call is compared by: the input it wrote."""
    return args[0]


def _with_grads(grad: bool) -> Callable[[Any, tuple], Any]:
    """What a grad-mode call is compared by: its outputs and the inputs' gradients of their sum."""
    if not grad:
        return lambda out, args: out

    def outputs_and_grads(out: Any, args: tuple) -> Any:
        import torch

        leaves = _grad_leaves(args)
        outs = [o for o in _tensors(out) if o.requires_grad and (o.is_floating_point() or o.is_complex())]
        if not outs or not leaves:
            return out
        total = sum(o.real.sum() if o.is_complex() else o.sum() for o in outs)
        grads = torch.autograd.grad(total, leaves, allow_unused=True)
        return (_copy(out), [g if g is not None else torch.zeros(()) for g in grads])

    return outputs_and_grads


def _grad_leaves(args: Any) -> list[Any]:
    """The tensors a grad-mode call's gradients are taken with respect to: each argument that requires
    grad, or, for a view of a leaf that does, that leaf (once each, in order)."""
    out: dict[int, Any] = {}
    for t in _tensors(args):
        if not t.requires_grad:
            continue
        base = t._base
        leaf = base if not t.is_leaf and base is not None and base.is_leaf and base.requires_grad else t
        out.setdefault(id(leaf), leaf)
    return list(out.values())


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


class Unusable(Exception):
    """A raw capture left the worker's process unusable (recorded as ``raw_not``; the worker is replaced)."""


def raw_ceilings(
    tries: list[tuple[dict[str, Any], Callable[..., Any], tuple[tuple, dict]]], seeded: bool, device: str
) -> Iterator[dict[str, Any]]:
    """The raw record of each of ``tries`` (record's start, operator, call). The process is checked after
    each: a try that leaves it unusable is ``raw_not`` with that reason, and raises ``Unusable`` (the
    tries after it are not made)."""
    for rec, fn, call in tries:
        raw = raw_capture(fn, call, seeded)
        if not _healthy(device):
            why = f"the raw capture left the process unusable ({raw['outcome']}: {raw['reason']})"[:300]
            yield {**rec, **raw, "outcome": "raw_not", "reason": why}
            raise Unusable(why)
        yield {**rec, **raw}


def _end_capture(g: Any, s: Any) -> None:
    """End a capture that a failure left open on stream ``s`` (an open capture poisons the process).
    Never raises: what it cannot mend, ``_healthy`` finds right after the raw try."""
    import torch

    try:
        with torch.cuda.stream(s):
            if torch.cuda.is_current_stream_capturing():
                g.capture_end()  # (an invalidated capture ends, then raises)
    except Exception:  # noqa: BLE001 - see the docstring
        pass


def raw_capture(fn: Callable[..., Any], call: tuple[tuple, dict], seeded: bool) -> dict[str, Any]:
    """Whether the sample can be captured at all: a warm-up and a ``CUDAGraph`` capture on a stream of its
    own (``thread_local`` error mode, a failed capture ended), one replay, compared with eager as
    ``classify`` does (by metadata where eager's two runs differ): ``raw_capturable`` / ``raw_not``."""
    import torch

    args, kwargs = call
    static = _copy(args)
    s = g = None
    try:
        s, g = torch.cuda.Stream(), torch.cuda.CUDAGraph()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn(*_copy(static), **kwargs)
        torch.cuda.synchronize()
        with torch.cuda.stream(s):  # (restores the current stream whatever fn does)
            g.capture_begin(capture_error_mode="thread_local")
            try:
                out = fn(*static, **kwargs)
            except BaseException:
                _end_capture(g, s)
                raise
            g.capture_end()
        seed = 0 if seeded else None
        if seeded:
            torch.manual_seed(0)
        g.replay()
        torch.cuda.synchronize()
        want, error = _run(fn, _copy(args), kwargs, seed, lambda o, a: o)
        if error is not None:
            raise error
        again, again_error = _run(fn, _copy(args), kwargs, seed, lambda o, a: o)
        by_values = again_error is None and same(again, want) is None
        diff = same(out, want) if by_values else same_metadata(out, want)
    except Exception as e:  # noqa: BLE001 - not capturable: the ceiling says so
        if s is not None:
            _end_capture(g, s)  # (a capture_end that failed before ending it)
        return {"outcome": "raw_not", "reason": f"{type(e).__name__}: {e}"[:200]}
    compared = "values" if by_values else "metadata"
    return {"outcome": "raw_capturable" if diff is None else "raw_not", "reason": diff or "", "compared": compared}


def _healthy(device: str) -> bool:
    """Whether the process can still run CUDA work: a sticky error, a capture left open or a side stream
    left current poisons it. Setting another seed raises while the current stream captures
    (``CUDAGeneratorImpl::set_current_seed``; the same seed would not), as the harness's seeding would."""
    if device != "cuda":
        return True
    import torch

    try:
        x = torch.randn(16, device=device)
        (x @ x).item()
        torch.cuda.synchronize()
        if torch.cuda.is_current_stream_capturing() or torch.cuda.current_stream() != torch.cuda.default_stream():
            return False
        seed = torch.cuda.initial_seed()
        torch.cuda.manual_seed(seed ^ 1)
        torch.cuda.manual_seed(seed)
        return True
    except Exception:  # noqa: BLE001 - poisoned
        return False


def worker(device: str, modes: tuple[str, ...], max_samples: int) -> int:
    """Read operator indices from stdin, write one JSON record per sample and ``DONE <index> <seconds>``
    (``DONE <index> <seconds> unusable``, then exit, where a raw capture left the process unusable)."""
    from torch.testing._internal.common_methods_invocations import op_db

    for line in sys.stdin:
        index = int(line)
        t0 = time.perf_counter()
        unusable = False
        try:
            for rec in sweep_op(op_db[index], device, modes, max_samples):
                print(json.dumps(rec), flush=True)
        except Unusable:
            unusable = True
        print(f"DONE {index} {time.perf_counter() - t0:.2f}{' unusable' if unusable else ''}", flush=True)
        if unusable:
            return 3  # the driver starts another worker
    return 0


# --- the driver ------------------------------------------------------------------------------------
def _selected(names: set[str] | None, device: str) -> list[int]:
    from torch.testing._internal.common_methods_invocations import op_db

    return [i for i, op in enumerate(op_db) if op.supported_dtypes(device) and (names is None or op.name in names)]


class _Worker:
    """A worker process and the operator it is on."""

    def __init__(self, argv: list[str]) -> None:
        env = dict(os.environ)  # the worker imports the graphtree this driver would (a checkout's, uninstalled)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_REPO, env.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, bufsize=1, env=env
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.err: collections.deque[str] = collections.deque(maxlen=20)
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._read_err, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    def _read_err(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.err.append(line.rstrip("\n"))

    def run(self, index: int, timeout: float) -> tuple[list[dict[str, Any]], str | None, float, bool]:
        """The records of operator ``index``, why the worker died or was killed (None: it finished), the
        operator's seconds (its ``DONE`` line's, else the time waited) and whether the worker must be
        replaced without blame (a raw capture left it unusable)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{index}\n")
        self.proc.stdin.flush()
        records: list[dict[str, Any]] = []
        t0 = time.monotonic()
        deadline = t0 + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                self.proc.kill()
                return records, f"timed out after {timeout:.0f} s", time.monotonic() - t0, False
            if line is None:
                self.proc.wait()
                tail = " | ".join(list(self.err)[-3:])[:300]
                why = f"worker exited with status {self.proc.returncode}: {tail}"
                return records, why, time.monotonic() - t0, False
            done = line.split()
            if done[:2] == ["DONE", str(index)]:  # DONE <index> <seconds> [unusable]
                return records, None, float(done[2]), done[3:] == ["unusable"]
            if line.startswith("{"):
                records.append(json.loads(line))

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()


def sweep(
    ops: list[int], argv: list[str], workers: int, timeout: float, budget: float | None = None
) -> tuple[list[dict[str, Any]], int]:
    """Run ``ops`` over ``workers`` worker processes (``argv`` starts one); replace a worker that dies.
    No operator is started after ``budget`` seconds; returns the records and how many were not run."""
    from torch.testing._internal.common_methods_invocations import op_db

    todo: queue.Queue[int] = queue.Queue()
    for i in ops:
        todo.put(i)
    out: list[dict[str, Any]] = []
    lock = threading.Lock()
    end = time.monotonic() + budget if budget is not None else None

    def drive() -> None:
        w = _Worker(argv)
        while end is None or time.monotonic() < end:
            try:
                index = todo.get_nowait()
            except queue.Empty:
                break
            records, died, seconds, unusable = w.run(index, timeout)
            op = op_db[index]
            name = {"op": op.name, "variant": op.variant_test_name, "dtype": "", "sample": -1}
            if died is not None:
                records.append({**name, "mode": "process", "outcome": "crash", "reason": died})
            # the operator's bookkeeping: its seconds (for op_seconds), not a sample
            records.append({**name, "mode": "op", "outcome": "done" if died is None else "died", "reason": "",
                            "seconds": round(seconds, 2)})  # fmt: skip
            if died is not None or unusable:
                w.close()
                w = _Worker(argv)
            with lock:
                out.extend(records)
        w.close()

    threads = [threading.Thread(target=drive) for _ in range(max(1, workers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out, todo.qsize()


def _sample_key(r: dict[str, Any]) -> tuple[str, str, str, int]:
    return r["op"], r["variant"], r["dtype"], r["sample"]


def summarize(
    records: list[dict[str, Any]], device: str, torch_version: str, seconds: float, not_run: int = 0
) -> dict[str, Any]:
    """The conformance JSON (see the module's docstring) from every record."""
    outer = [r for r in records if r["mode"] in ("plain", "grad", "autocast", "process")]
    inplace = [r for r in records if r["mode"] == "inplace"]
    count = collections.Counter(r["outcome"] for r in outer)
    icount = collections.Counter(r["outcome"] for r in inplace)
    reasons = collections.Counter(r["reason"] for r in records if r["outcome"] == "eager")
    # like for like: the samples that had a raw try (plain, sample 0 of each dtype), raw and graphtree
    raw_ok = {_sample_key(r) for r in records if r["mode"] == "raw" and r["outcome"] == "raw_capturable"}
    replayed_ok = {_sample_key(r) for r in records if r["mode"] == "plain" and r["outcome"] == "replayed"}
    timed = sorted((r for r in records if r["mode"] == "op"), key=lambda r: -r["seconds"])[:10]
    return {
        "device": device,
        "torch": torch_version,
        "ops": len({(r["op"], r["variant"]) for r in records if r["mode"] != "op"}),
        "samples": sum(count[k] for k in ("replayed", "eager", "error_as_eager", "wrong", "crash")),
        "replayed": count["replayed"],
        "eager": count["eager"],
        "error_as_eager": count["error_as_eager"],
        "wrong": count["wrong"] + icount["wrong"],
        "crash": count["crash"] + icount["crash"],
        "raw_capturable": sum(1 for r in records if r["outcome"] == "raw_capturable"),
        "raw_tried": sum(1 for r in records if r["mode"] == "raw"),
        "raw_pairs": {"raw_capturable": len(raw_ok), "replayed": len(raw_ok & replayed_ok)},
        "metadata_only": sum(1 for r in outer + inplace if r.get("compared") == "metadata"),
        # where eager reproduces its own bits: samples graphtree matched bit for bit, and those it
        # matched only within the OpInfo tolerances (not a failure; the first 50 named)
        "exact": sum(1 for r in outer + inplace if r.get("exact") is True),
        "inexact": sum(1 for r in outer + inplace if r.get("exact") is False),
        "inexact_cases": [
            {k: r[k] for k in ("op", "variant", "dtype", "mode", "inexact")}
            for r in outer + inplace
            if r.get("exact") is False
        ][:50],
        "in_place": {
            "samples": len(inplace),
            "replayed": icount["replayed"],
            "eager": icount["eager"],
            "wrong": icount["wrong"],
            "crash": icount["crash"],
        },
        "skipped": count["skipped"],
        "reasons": dict(reasons.most_common()),
        "failures": [r for r in records if r["outcome"] in ("wrong", "crash")],
        "op_seconds": {r["op"] + (f".{r['variant']}" if r["variant"] else ""): r["seconds"] for r in timed},
        "seconds": round(seconds, 1),
        "ops_not_run": not_run,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--ops", help="operator names, comma-separated (default: every one on the device)")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--max-samples", type=int, default=4)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--timeout", type=float, default=OP_TIMEOUT_S, help="seconds one operator may take")
    p.add_argument("--budget", type=float, help="start no operator after this many seconds (the summary says how many)")
    p.add_argument("--json", help="write the summary here")
    p.add_argument("--records", help="write every sample's record here (JSON lines)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    modes = tuple(m for m in a.modes.split(",") if m)
    if a.worker:
        return worker(a.device, modes, a.max_samples)
    import torch

    if a.device == "cuda" and not torch.cuda.is_available():
        print("the sweep needs a CUDA GPU (or --device cpu, where graphtree runs everything eagerly)")
        return 2
    names = set(a.ops.split(",")) if a.ops else None
    ops = _selected(names, a.device)
    argv_worker = [sys.executable, os.path.abspath(__file__), "--worker", "--device", a.device, "--modes", a.modes,
                   "--max-samples", str(a.max_samples)]  # fmt: skip
    t0 = time.perf_counter()
    records, not_run = sweep(ops, argv_worker, a.workers, a.timeout, a.budget)
    device = torch.cuda.get_device_name() if a.device == "cuda" else a.device
    res = summarize(records, device, torch.__version__, time.perf_counter() - t0, not_run)
    keys = ("ops", "samples", "replayed", "eager", "error_as_eager", "wrong", "crash", "raw_capturable", "raw_tried")
    print(f"{device}, torch {torch.__version__}: " + ", ".join(f"{k} {res[k]}" for k in keys))
    print(f"in place: {res['in_place']}; raw pairs: {res['raw_pairs']}; compared by metadata only: "
          f"{res['metadata_only']}; {res['seconds']} s; operators not run (budget): {not_run}")  # fmt: skip
    print("slowest operators (s): " + ", ".join(f"{k} {v}" for k, v in list(res["op_seconds"].items())[:5]))
    print(f"bit for bit where eager reproduces its bits: {res['exact']} exact, {res['inexact']} within tolerance only")
    for r in res["inexact_cases"][:10]:
        name = r["op"] + (f".{r['variant']}" if r["variant"] else "")
        print(f"  INEXACT {name} {r['dtype']} {r['mode']}: {r['inexact']}")
    for r in res["failures"][:30]:
        print(f"  {r['outcome'].upper():6} {r['op']}{'.' + r['variant'] if r['variant'] else ''} {r['dtype']} "
              f"{r['mode']} #{r['sample']}: {r['reason']}")  # fmt: skip
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=2)
    if a.records:
        with open(a.records, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
