"""graphtree: safe, fast and observable CUDA graphs for ordinary PyTorch code.

Record any PyTorch callable as a tree of CUDA graphs that share one memory pool,
replay it at close to the cost of a raw ``CUDAGraph.replay()``, and never hand
back silently overwritten outputs.

Example::

    import graphtree, torch

    @graphtree.graphed
    def step(x, w):
        return torch.relu(x @ w)

    for batch in loader:
        graphtree.mark_step()          # a new iteration: earlier outputs may be reused
        y = step(batch.cuda(), weight)
    print(graphtree.stats())

Without CUDA every graphed callable simply runs eagerly.
"""

from graphtree import (
    debug,  # dumps, re-runs and doctor; also what graphed(fn, debug=dir) calls
    profile,  # a module you can call: graphtree.profile() (CUPTI loads on start)
)
from graphtree.tree.breaks import eager
from graphtree.tree.describe import describe
from graphtree.tree.graphed import GraphedCallable, graphed, mark_static
from graphtree.tree.graphed_module import GraphedModule
from graphtree.tree.manager import mark_step, reset, stats
from graphtree.tree.stats import Stats

__version__ = "0.1.0"


def __getattr__(name: str) -> object:
    """``graphtree.share`` is imported on first use: most programs never share a tensor."""
    if name == "share":
        import importlib

        return importlib.import_module("graphtree.share")
    raise AttributeError(f"module 'graphtree' has no attribute {name!r}")


__all__ = [
    "GraphedCallable",
    "GraphedModule",
    "Stats",
    "__version__",
    "debug",
    "describe",
    "eager",
    "graphed",
    "mark_static",
    "mark_step",
    "profile",
    "reset",
    "share",
    "stats",
]
