"""Handing each step's logits of a graphed decode loop to another process: graphtree.share
against a torch.multiprocessing queue of CUDA tensors and against pinned host copies.

    python benchmarks/share.py [--steps 200] [--vocab 32000] [--layers 2] [--d-model 256]

Prints one JSON object per way (producer CPU and wall time per step, consumer latency, bytes
copied per step, attach times); the method is in ``graphtree/bench/share.py``, which
``graphtree bench --scenarios share`` also runs. Needs a CUDA GPU.
"""

from graphtree.bench.share import main

if __name__ == "__main__":
    raise SystemExit(main())
