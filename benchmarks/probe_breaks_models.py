"""What breakable recordings make of real models (issue 26), before tests are written for them.

For each model (random weights): eager output, then ``graphed(model, max_break_values=8)`` called
several times; prints whether outputs equal eager, graphtree's stats (replays, recordings for new
values, eager runs with their reasons) and the time per call of each. Models: torchvision's Faster
R-CNN (eval, two images), a Llama without a cache (two prompt lengths), timm's ResNet-18 as the
control (no host reads). Run on a GPU::

    python benchmarks/probe_breaks_models.py
"""

from __future__ import annotations

from typing import Any

import torch

import graphtree
from graphtree.bench.timing import wall_per_call


def _same(a: Any, b: Any) -> bool:
    la, lb = torch.utils._pytree.tree_leaves(a), torch.utils._pytree.tree_leaves(b)
    return len(la) == len(lb) and all(
        torch.allclose(x, y, rtol=1e-3, atol=1e-3) if isinstance(x, torch.Tensor) else x == y for x, y in zip(la, lb)
    )


def probe(name: str, model: torch.nn.Module, inputs: list[tuple[Any, ...]], kwargs: dict[str, Any]) -> None:
    graphtree.reset()
    with torch.inference_mode():
        want = [model(*a, **kwargs) for a in inputs]
        g = graphtree.graphed(model, max_break_values=8)
        same = True
        for _ in range(3):
            for a, w in zip(inputs, want):
                graphtree.mark_step()
                same &= _same(g(*a, **kwargs), w)
        eager_t = wall_per_call(lambda: [model(*a, **kwargs) for a in inputs], 5, sync=torch.cuda.synchronize)
        graph_t = wall_per_call(
            lambda: [(graphtree.mark_step(), g(*a, **kwargs)) for a in inputs], 5, sync=torch.cuda.synchronize
        )
    s = graphtree.stats()
    print(f"{name}: equal to eager: {same}; eager {eager_t * 1e3:.2f} ms, graphtree {graph_t * 1e3:.2f} ms per round")
    print(f"  {s}")
    for reason, n in s.eager.items():
        print(f"  eager x{n}: {reason[:300]}")


def main() -> None:
    torch.manual_seed(0)
    try:
        import torchvision

        det = torchvision.models.detection.fasterrcnn_resnet50_fpn(weights=None, weights_backbone=None).cuda().eval()
        imgs = [(list(torch.rand(2, 3, 320, 320, device="cuda").unbind(0)),)]
        probe("Faster R-CNN", det, imgs, {})
    except Exception as e:  # noqa: BLE001 - report and go on
        print("Faster R-CNN:", type(e).__name__, e)
    try:
        from graphtree.bench.breaks import llama as bench_llama  # the breaks scenario's Llama

        llama = bench_llama(seed=0)
        ids = [(torch.randint(1, 1024, (2, n), device="cuda"),) for n in (16, 24)]
        probe("Llama, no cache", llama, ids, {"use_cache": False})
    except Exception as e:  # noqa: BLE001
        print("Llama:", type(e).__name__, e)
    try:
        import timm

        net = timm.create_model("resnet18", pretrained=False).cuda().eval()
        probe("timm ResNet-18", net, [(torch.rand(8, 3, 224, 224, device="cuda"),)], {})
    except Exception as e:  # noqa: BLE001
        print("ResNet-18:", type(e).__name__, e)


if __name__ == "__main__":
    main()
