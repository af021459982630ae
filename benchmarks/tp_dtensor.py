"""A decoder parallelised with ``torch.distributed.tensor.parallel`` (issue 48, item 2; the ``tp``
scenario of ``graphtree bench`` is the same workload, :mod:`graphtree.bench.tp`): each decode
step eager, graphed by graphtree and captured by hand, on every GPU of the machine under torchrun.

The model: token embedding, ``--layers`` residual MLP blocks whose up-projection is
``ColwiseParallel`` and down-projection ``RowwiseParallel`` (DTensor parameters; each block ends in
an all-reduce), a final norm and a replicated LM head; greedy decoding of ``--tokens`` tokens at
batch 1. Parameters are DTensors: graphtree either records their dispatch or runs the step eagerly
with a reason that names it, which the output reports. Rank 0 prints one JSON row per contender::

    torchrun --nproc-per-node 4 benchmarks/tp_dtensor.py [--layers 8] [--d-model 1024] [--tokens 64]
        [--json out.json]

``--device cpu`` runs eager and graphtree over gloo (a dry run: graphtree runs CPU calls eagerly).
"""

from __future__ import annotations

import argparse

import torch.distributed as dist

from graphtree.bench.ranks import report, start
from graphtree.bench.tp import DecodeArgs, decode_rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--d-model", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--contenders", default="eager,graphtree,hand")
    p.add_argument("--device", default="cuda")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    rank, world, device = start(a.device)
    args = DecodeArgs(a.layers, a.d_model, a.vocab, a.tokens)
    rows = decode_rows(a.contenders.split(","), args, device, world)
    head = {"layers": a.layers, "d_model": a.d_model, "tokens": a.tokens}
    report(rows, head, device, world, rank, a.json)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
