"""graphtree.share: zero-copy GPU tensors and graph outputs across processes (being built).

Only the trusted channel that carries memory handles exists so far
(:mod:`graphtree.share._rendezvous`, CPU-tested); the public publish/attach API and the GPU
memory export/import are not built yet. ``DESIGN.md`` beside this file has the plan.
"""

__all__: list[str] = []
