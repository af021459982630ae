"""The ``breaks`` scenario: models that read values on the host (issue 26), per call.

Three ways to run each: ``eager``; ``graphtree, breaks off`` (``max_break_values=0``: a host read
sends the signature to eager, with the reason, as before breaks); ``graphtree`` with its default
``max_break_values=8`` (the read ends a graph segment and its value picks the next). Hand-written graphs and
``torch.compile`` get "not applicable" rows: neither takes a host read inside the graph. The inputs
alternate so that every data-dependent branch is taken; each call is checked against eager.
No peer with marked ops (vLLM's, SGLang's breakable graphs, meta-pytorch's piecewise graphs) is
pip-installable as a library for arbitrary callables, so none runs here. The Faster R-CNN case is
graphed whole: graphtree graphs its parts (``graphtree.tree.parts``), breaks on or off.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from graphtree.bench import kit, timing
from graphtree.bench.contenders import compare, reset_all, snapshot
from graphtree.bench.harness import Result, interleaved
from graphtree.bench.kit import MIN_REPEATS, TOL_MLP, Ctx, Rounds, line, merge_checks, not_run, randn, timing_rows
from graphtree.bench.workloads import MLP

EAGER, WHOLE, BREAKS = "eager", "graphtree, breaks off", "graphtree"
ON = 8  # max_break_values of the breaks contender


def _branchy(d: int, seed: int) -> Callable[[torch.Tensor], torch.Tensor]:
    trunk, left, right = (MLP(d, 4 * d, 2, seed=seed + i).to(kit.DEVICE) for i in range(3))

    def fn(x: torch.Tensor) -> torch.Tensor:
        h = trunk(x)
        return left(h) if h.mean() > 0 else right(h)  # a bool read on the host picks the head

    return fn


def _moe(d: int, experts: int, seed: int) -> Callable[[torch.Tensor], torch.Tensor]:
    gate = MLP(d, d, 1, seed=seed).to(kit.DEVICE)
    blocks = [MLP(d, 4 * d, 1, seed=seed + 1 + e).to(kit.DEVICE) for e in range(experts)]

    def fn(x: torch.Tensor) -> torch.Tensor:
        choice = gate(x)[..., :experts].argmax(-1)
        out = torch.zeros_like(x)
        for e, block in enumerate(blocks):
            picked = choice == e
            if picked.any():  # an expert runs only when a token chose it
                out = out + picked.unsqueeze(-1) * block(x)
        return out

    return fn


def llama(seed: int) -> torch.nn.Module:
    """The case's Llama (4 layers, d_model 256, vocab 1024, random weights), in eval mode on the
    benchmark's device; ``benchmarks/probe_breaks_models.py`` probes the same one."""
    import transformers  # only when this case runs

    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=1024,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    model: torch.nn.Module = transformers.LlamaForCausalLM(cfg)  # (typed as a module: HF's `to` wrapper confuses mypy)
    return model.to(kit.DEVICE).eval()


def _llama(seed: int) -> Callable[[torch.Tensor], torch.Tensor]:
    model = llama(seed)
    return lambda ids: model(ids, use_cache=False).logits


class _Detector(torch.nn.Module):
    """torchvision's Faster R-CNN (random weights, eval) on a batch tensor of images. Its own code
    uploads host lists and filters boxes by value, so graphtree graphs it in parts
    (``graphtree.tree.parts``): the backbone and the RPN head replay, the rest runs eagerly."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        import torchvision  # only when this case runs

        torch.manual_seed(seed)
        detector = torchvision.models.detection.fasterrcnn_resnet50_fpn(weights=None, weights_backbone=None)
        self.detector = detector.to(kit.DEVICE).eval()

    def forward(self, images: torch.Tensor) -> Any:
        return self.detector(list(images.unbind(0)))


def _cases(cfg: kit.BenchConfig) -> list[tuple[str, Any, list[torch.Tensor]]]:
    d = cfg.mlp_d
    signs = [1, -1, 1, -1]
    xs = [randn(cfg.branch_batch, cfg.mlp_tokens, d, seed=700 + i).abs() * s for i, s in enumerate(signs)]
    gen = kit.gen(800)
    ids = [torch.randint(1, 1024, (2, 32), generator=gen).to(kit.DEVICE) for _ in range(4)]
    images = [torch.rand(2, 3, 320, 320, generator=gen).to(kit.DEVICE) for _ in range(2)] * 2
    return [
        ("MLP, a bool picks the head", partial(_branchy, d, 31), xs),
        ("mixture of 4 experts, routed by the data", partial(_moe, d, 4, 41), xs),
        ("Llama (4 layers), no cache", partial(_llama, 51), ids),
        ("Faster R-CNN, two 320x320 images (in parts)", partial(_Detector, 61), images),
    ]


def _contender(name: str, fn: Callable[[torch.Tensor], torch.Tensor]) -> tuple[Callable[[torch.Tensor], Any], Any]:
    if name == EAGER:
        return fn, None
    import graphtree

    g = graphtree.graphed(fn, max_break_values=ON if name == BREAKS else 0)
    return g, graphtree.mark_step


def run_breaks(ctx: Ctx) -> list[Result]:
    """Wall time per call of models that read values on the host, eager vs graphtree without and
    with breakable recordings; every call of every contender checked against eager.

    Example::

        rows = run_breaks(ctx)
    """
    cfg = ctx.cfg
    results: list[Result] = []
    sync = torch.cuda.synchronize
    names = [n for n in (EAGER, WHOLE, BREAKS) if (BREAKS if n == WHOLE else n) in cfg.contenders]
    for n in cfg.contenders:
        if n not in names:
            note = "not applicable: a host read inside a graph is what this scenario is about"
            results.append(Result("breaks", "all", n, "wall_per_call", None, "s", note=note))
    for case, make, inputs in _cases(cfg):
        try:
            fn = make()
            refs = [snapshot(fn(x)) for x in inputs]
        except Exception as exc:  # noqa: BLE001 - a case that cannot be built (no transformers) is skipped
            not_run(results, ctx, "breaks", case, names, "wall_per_call", exc)
            continue
        calls: dict[str, Callable[[], Any]] = {}
        checks: dict[str, dict[str, Any]] = {}
        said: dict[str, str] = {}  # what graphtree did in each contender's checked calls
        keep = []
        for name in names:
            reset_all()
            f, step = _contender(name, fn)
            seen = []
            for _ in range(3):  # warm-up, recording, and every value's recording, then replays
                for x, ref in zip(inputs, refs):
                    if step is not None:
                        step()
                    seen.append(compare(f(x), ref, **TOL_MLP))
            checks[name] = merge_checks(seen)
            if name != EAGER:
                said[name] = _said()
            cycle = itertools.cycle(inputs)
            calls[name] = partial(_one, f, step, cycle)
            keep.append(f)
        rounds = Rounds(repeats=cfg.overhead_repeats, warmup=1, stop=ctx.budget.expired, min_repeats=MIN_REPEATS)
        t = interleaved(calls, timer=partial(timing.wall_per_call, calls=len(inputs) * 4, sync=sync), **rounds)
        first = len(results)
        med = timing_rows(results, "breaks", case, "wall_per_call", t, checks, TOL_MLP, note=_NOTE)
        for row in results[first:]:
            if row.contender in said:
                row.note += f"; {said[row.contender]}"
        ctx.log(line(f"breaks: {case}: wall/call", med) + "".join(f"\n  {k}: {v}" for k, v in said.items()))
        del calls, keep, fn
        reset_all()
    return results


def _one(f: Callable[[torch.Tensor], Any], step: Any, inputs: Any) -> Any:
    if step is not None:
        step()
    return f(next(inputs))


_NOTE = "synced wall time per call, the inputs alternating branches"


def _said() -> str:
    """What graphtree did in the checked calls: replays, recordings for new values, eager runs."""
    import graphtree

    s = graphtree.stats()
    eager = "; ".join(f"{n}x {r[:160]}" for r, n in s.eager.items()) or "none"
    return f"{s.replays} replays, {s.recordings} recordings ({s.values} for new values), eager runs: {eager}"
