"""A differential fuzz of the paths real code takes (issue 24, behaviour 7): random sequences of
calls over several graphed functions, with random shapes and dtypes, outputs held past their
step, ``mark_step``, autocast / grad / inference-mode toggles, four threads at once and
exceptions injected into warm-ups and recordings. Every output is compared with eager execution
of the same call under the same settings, and every output held past its step either still
equals eager or raises graphtree's error.

Each thread runs a loop of a few random kinds of step (and now and then a new one), so that
recordings replay as they do in real loops. It prints one line,
``FUZZ calls=... wrong=... stale_reads=... injected=... replays=... eager=...``:
``wrong`` (silently wrong values) must be 0, and so must ``other_errors`` (an exception that is
neither an injected one nor graphtree's stale-output error).
"""

from __future__ import annotations

import contextlib
import random
import threading
import traceback

import torch

import graphtree
from graphtree.tree import manager

DEV = "cuda"
THREADS = 4
CALLS_PER_THREAD = 1300  # 5200 calls in all


class Injected(Exception):
    """Raised from inside a graphed function on cue."""


class _Cue(threading.local):
    armed = False


cue = _Cue()


def _raise_if_armed():
    if cue.armed:
        cue.armed = False
        raise Injected("injected")


def _affine(x, w):
    _raise_if_armed()
    return torch.relu(x @ w) + 1


def _pair(x, y):
    _raise_if_armed()
    return x * y, (x - y).sin()


def _noisy(x):
    _raise_if_armed()
    return torch.nn.functional.dropout(x, 0.0) + x.cos()  # dropout with p=0 keeps it comparable


class _Mlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(64, 64)
        self.b = torch.nn.Linear(64, 64)

    def forward(self, x):
        _raise_if_armed()
        return self.b(torch.relu(self.a(x)))


_AMBIENT = [
    ("plain", contextlib.nullcontext),
    ("bf16", lambda: torch.autocast("cuda", dtype=torch.bfloat16)),
    ("fp16", lambda: torch.autocast("cuda", dtype=torch.float16)),
    ("no_grad", torch.no_grad),
    ("inference", torch.inference_mode),
]


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    if got.dtype != want.dtype or got.shape != want.shape:
        return False
    tol = 0 if want.dtype == torch.float32 else 1e-2
    return torch.allclose(got.float(), want.float(), rtol=tol, atol=tol)


def _program(seed: int, counts: dict[str, int], lock: threading.Lock) -> None:
    rng = random.Random(seed)
    gen = torch.Generator(device=DEV).manual_seed(seed)
    mlp = _Mlp().to(DEV).eval()
    fns = {
        "affine": (graphtree.graphed(_affine), _affine),
        "pair": (graphtree.graphed(_pair), _pair),
        "noisy": (graphtree.graphed(_noisy), _noisy),
        "mlp": (graphtree.graphed(mlp), mlp),
    }
    shapes = {
        "affine": [(8, 64), (16, 64)],
        "pair": [(4, 32), (4, 32, 2)],
        "noisy": [(128,), (8, 8)],
        "mlp": [(2, 64), (8, 64)],
    }
    dtypes = [torch.float32, torch.float32, torch.bfloat16]
    w = {dt: torch.randn(64, 64, device=DEV, generator=gen).to(dt) for dt in (torch.float32, torch.bfloat16)}
    held: list[tuple[torch.Tensor, torch.Tensor]] = []
    local = dict.fromkeys(("calls", "wrong", "stale_reads", "equal_reads", "injected", "other_errors"), 0)

    def random_step() -> tuple[str, list[tuple[str, tuple[int, ...], torch.dtype]]]:
        calls = []
        for _ in range(rng.randint(1, 4)):
            name = rng.choice(list(fns))
            dt = rng.choice(dtypes) if name in ("pair", "noisy") else torch.float32
            calls.append((name, rng.choice(shapes[name]), dt))
        return rng.choice(_AMBIENT)[0], calls

    # a training or serving loop repeats a few kinds of step: most steps are one of these, so
    # their recordings replay; the rest are new sequences (a branch recorded, or eager)
    loop = [random_step() for _ in range(6)]
    while local["calls"] < CALLS_PER_THREAD:
        if rng.random() < 0.9:
            graphtree.mark_step()
        ambient_name, calls = rng.choice(loop) if rng.random() < 0.85 else random_step()
        ambient = dict(_AMBIENT)[ambient_name]  # thread-local switches (TF32 is process-wide:
        # toggled here it would change another thread's call between its eager run and its graphed one)
        for name, shape, dt in calls:
            graphed_fn, eager_fn = fns[name]
            if name == "affine":
                args = (torch.randn(*shape, device=DEV, generator=gen), w[torch.float32])
            elif name == "pair":
                args = tuple(torch.randn(*shape, device=DEV, generator=gen).to(dt) for _ in range(2))
            else:
                args = (torch.randn(*shape, device=DEV, generator=gen).to(dt),)
            inject = rng.random() < 0.01
            local["calls"] += 1
            try:
                with ambient():
                    expected = eager_fn(*[a.clone() for a in args])
                    cue.armed = inject
                    out = graphed_fn(*args)
            except Injected:
                local["injected"] += 1
                continue
            except Exception as e:  # noqa: BLE001 - counted: must stay 0
                local["other_errors"] += 1
                print("OTHER", name, ambient_name, repr(e)[:300], traceback.format_exc()[-2500:], flush=True)
                continue
            finally:
                cue.armed = False
            outs = out if isinstance(out, tuple) else (out,)
            exps = expected if isinstance(expected, tuple) else (expected,)
            for o, e in zip(outs, exps, strict=True):
                if not _same(o, e):
                    local["wrong"] += 1
                    print("WRONG", name, ambient_name, shape, dt, o.dtype, e.dtype, flush=True)
                elif rng.random() < 0.2:
                    held.append((o, e))
        if held and rng.random() < 0.5:
            o, e = held.pop(rng.randrange(len(held)))
            try:
                ok = _same(o, e)
            except RuntimeError as err:
                if "graphtree" not in str(err):
                    local["other_errors"] += 1
                else:
                    local["stale_reads"] += 1
            else:
                local["equal_reads" if ok else "wrong"] += 1
    local["replays"] = manager.tree_for(0).counters.replays
    eager = manager.tree_for(0).counters.eager
    local["eager"] = sum(eager.values())
    for reason, n in eager.most_common(3):
        print(f"EAGER thread {seed}: {n} x {reason[:200]}", flush=True)
    with lock:
        for k, v in local.items():
            counts[k] = counts.get(k, 0) + v


def test_random_programs_in_four_threads_with_ambient_toggles_match_eager(capsys):
    counts: dict[str, int] = {}
    lock = threading.Lock()
    errors: list[str] = []

    def run(seed):
        try:
            _program(seed, counts, lock)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(repr(e)[:500])

    threads = [threading.Thread(target=run, args=(s,)) for s in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=900)
    with capsys.disabled():  # the figures show without -s
        print("\nFUZZ " + " ".join(f"{k}={v}" for k, v in sorted(counts.items())), flush=True)
    assert not errors, errors
    assert counts["calls"] >= 5000, counts
    assert counts["wrong"] == 0 and counts["other_errors"] == 0, counts
    assert counts["replays"] > counts["calls"] // 3, counts  # the loop's steps recur: their graphs replay
