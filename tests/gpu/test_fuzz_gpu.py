"""Random programs of graphed calls, checked against eager: outputs held or dropped, fed back in,
steps marked or automatic, several functions and a module in one tree.

The invariant under test: every output the program still holds is either exactly what eager
execution gave for the same inputs, or raises a ``RuntimeError`` from graphtree when read (it
belonged to a step that ended). Never a silently wrong value, never an allocator error.
"""

import random

import pytest
import torch

import graphtree

DEV = "cuda"


def _single(x):
    return x * 2 + 1


def _pair(x, y):
    return x + y, x * y


def _chain(x):
    return (x.sin() * 3).cos()


class _Mlp(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(64, 64)

    def forward(self, x):
        return torch.relu(self.a(x))


class _Held:
    """An output the program keeps, with what eager execution gave for it."""

    def __init__(self, value: torch.Tensor, expected: torch.Tensor) -> None:
        self.value = value
        self.expected = expected

    def check(self) -> str:
        try:
            v = self.value.clone()
        except RuntimeError as e:
            if "graphtree" not in str(e):
                raise AssertionError(f"a stale output raised something else: {e}") from e
            return "stale"
        torch.testing.assert_close(v, self.expected, rtol=0, atol=0)
        return "equal"


def _stale(t: torch.Tensor) -> bool:
    try:
        t.view(-1)[:1].clone()
    except RuntimeError:
        return True
    return False


def _templates(rng: random.Random, names: list[str]) -> list[list[tuple[str, list[int]]]]:
    """A few step shapes to repeat, so that paths recur and replay: each call is a function and,
    for each input, -1 (a fresh tensor) or the index of an earlier output of the step to feed in."""
    out = []
    for _ in range(5):
        calls: list[tuple[str, list[int]]] = []
        n_outs = 0
        for _ in range(rng.randint(1, 5)):
            name = rng.choice(names)
            n_in = 2 if name == "pair" else 1
            ins = [rng.randrange(n_outs) if n_outs and rng.random() < 0.4 else -1 for _ in range(n_in)]
            calls.append((name, ins))
            n_outs += 2 if name == "pair" else 1
        out.append(calls)
    return out


def _run_program(seed: int, manual_steps: bool, n_steps: int = 120) -> dict[str, int]:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    mlp = _Mlp().to(DEV).eval()
    fns = {
        "single": (graphtree.graphed(_single), _single),
        "pair": (graphtree.graphed(_pair), _pair),
        "chain": (graphtree.graphed(_chain), _chain),
        "mlp": (graphtree.graphed(mlp), mlp),
    }
    templates = _templates(rng, list(fns))
    held: list[_Held] = []  # outputs the program keeps across steps (they may go stale)
    seen = {"equal": 0, "stale": 0, "calls": 0}
    for _ in range(n_steps):
        if manual_steps:
            graphtree.mark_step()
        step_outs: list[torch.Tensor] = []  # this step's outputs, held until the step ends
        for name, ins in rng.choice(templates):
            graphed_fn, eager_fn = fns[name]
            # Without mark_step(), calling a function twice in a template starts a step: outputs
            # from before it are stale, and a fresh tensor stands in for them.
            args = [torch.randn(8, 64, device=DEV) if i < 0 or _stale(step_outs[i]) else step_outs[i] for i in ins]
            expected = eager_fn(*[a.clone() for a in args])
            out = graphed_fn(*args)
            seen["calls"] += 1
            outs = out if isinstance(out, tuple) else (out,)
            exps = expected if isinstance(expected, tuple) else (expected,)
            for o, e in zip(outs, exps):
                h = _Held(o, e)
                assert h.check() == "equal"  # just returned: always valid
                if rng.random() < 0.3:
                    held.append(h)  # kept past the step: read later, stale or equal
            # drop or keep this call's outputs for the rest of the step (feeding needs them: a
            # dropped one is replaced by its clone, which graphtree copies like any input)
            step_outs.extend(o if rng.random() < 0.6 else o.clone() for o in outs)
            del out, outs, o
        if held and rng.random() < 0.5:
            held.pop(rng.randrange(len(held)))
        if held and rng.random() < 0.5:
            seen[held[rng.randrange(len(held))].check()] += 1
    for h in held:
        seen[h.check()] += 1
    return seen


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("manual_steps", [False, True], ids=["auto_steps", "mark_step"])
def test_random_programs_match_eager(seed, manual_steps):
    with torch.no_grad():
        seen = _run_program(seed, manual_steps)
    st = graphtree.stats()
    assert seen["calls"] > 200
    assert st.replays > seen["calls"] // 2, st  # the steps recur: most calls replay
    assert seen["equal"] + seen["stale"] > 10  # outputs kept past their step were read again
