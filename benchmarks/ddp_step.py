"""A data-parallel training step under torchrun (issue 48; the ``ddp`` scenario of ``graphtree bench``
is the same workload, :mod:`graphtree.bench.ddp`): eager DDP (or FSDP2) against graphtree's
recording of the whole step and against PyTorch's documented whole-network capture by hand.

Every rank trains its own copy of one model (same initial weights), on batches of its own, with
``DistributedDataParallel`` and ``SGD`` (momentum): the step is ``zero_grad``, forward, the loss,
``backward()`` (DDP's bucketed all-reduces) and ``step()``. Contenders, one after another:

- ``eager``: the step as written;
- ``graphtree``: ``graphtree.graphed(step)``, the same function;
- ``hand``: the step captured by hand as PyTorch's CUDA-graph notes describe it for DDP (warm-up
  iterations on a side stream, at least 11 so that DDP has rebuilt its buckets, then
  ``torch.cuda.graph`` around the whole step; the batch copied into static inputs);
- ``eager_again``: eager once more, whether eager reproduces its own losses bit for bit (where it
  does not, as with attention kernels whose backward adds in any order, unequal bits say nothing:
  ``losses_max_abs_diff_to_eager`` tells noise from a wrong result).

DDP is made on a side stream, as those notes ask, for every contender alike.

Per contender: the median time per step (back-to-back steps, synchronised every ``--round``
steps), the first three steps' time, each step's loss compared with eager's bit for bit (with
``torch.use_deterministic_algorithms``), and graphtree's replayed fraction. Rank 0 prints a JSON
row per contender and writes them with ``--json``::

    torchrun --nproc-per-node 4 benchmarks/ddp_step.py [--model gpt|resnet18|mlp] [--steps 100]
        [--batch 8] [--wrap ddp|fsdp2] [--json out.json]

``--wrap fsdp2``: FSDP2's ``fully_shard`` per block instead of DDP (issue 48, item 3: whether the
step is recorded, or runs eagerly with a reason naming what stops it, is the finding).

On a machine without GPUs, ``--device cpu`` runs the eager and graphtree contenders over gloo (a
dry run of the script: graphtree runs CPU calls eagerly).
"""

from __future__ import annotations

import argparse

import torch.distributed as dist

from graphtree.bench.ddp import StepArgs, step_rows
from graphtree.bench.ranks import report, start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="gpt", help="gpt, resnet18 or mlp")
    p.add_argument("--batch", type=int, default=8, help="samples per GPU")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--round", type=int, default=10, help="steps between synchronisations when timed")
    p.add_argument("--contenders", default="eager,graphtree,hand,eager_again", help="eager_again: eager once more")
    p.add_argument("--wrap", default="ddp", choices=("ddp", "fsdp2"), help="DistributedDataParallel or FSDP2")
    p.add_argument("--device", default="cuda")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    rank, world, device = start(a.device)
    args = StepArgs(a.model, a.wrap, a.batch, a.steps, a.round)
    rows = step_rows(a.contenders.split(","), args, device, rank)
    head = {"model": a.model, "wrap": a.wrap, "batch_per_rank": a.batch, "steps": a.steps}
    report(rows, head, device, world, rank, a.json)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
