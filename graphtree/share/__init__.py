"""graphtree.share: zero-copy GPU tensors across processes of one user (being built).

A :class:`Publisher` allocates tensors in shareable GPU memory (an IPC-enabled CUDA memory pool,
through NVIDIA's ``cuda.core``) and serves them by name; :func:`attach` maps them into another
process as torch tensors on the same memory. Handles travel only over a Unix-domain socket whose
peer's uid the kernel vouches for. Not built yet: versions with inter-process events, graph
outputs written into shared memory, a re-created consumer context, the benchmark (``DESIGN.md``).

Example::

    # producer                                        # consumer
    pub = graphtree.share.Publisher("decoder")         shared = graphtree.share.attach("decoder")
    x = pub.publish("x", torch.ones(4, device="cuda")) print(shared["x"])
"""

from graphtree.share._memory import ShareUnavailableError
from graphtree.share._rendezvous import RefusedError
from graphtree.share.consumer import Attached, attach
from graphtree.share.producer import Publisher

__all__ = ["Attached", "Publisher", "RefusedError", "ShareUnavailableError", "attach"]
