"""graphtree.share: zero-copy GPU tensors across processes of one user.

A :class:`Publisher` allocates tensors in shareable GPU memory (an IPC-enabled CUDA memory pool,
through NVIDIA's ``cuda.core``) and serves them by name; :func:`attach` maps them into another
process as torch tensors on the same memory. A channel (``Publisher.channel``) publishes versions
of a tensor, ordered on the GPU by version cells in shared host memory that the producer's GPU
writes and the consumer's GPU waits for: a reader never sees a half-written version. Handles
travel only over a Unix-domain socket whose peer's uid the kernel vouches for.
What holds, what was measured and what does not hold yet: ``DESIGN.md``.

Example::

    # producer                                        # consumer (another process)
    pub = graphtree.share.Publisher("decoder")         shared = graphtree.share.attach("decoder")
    x = pub.publish("x", torch.ones(4, device="cuda")) print(shared["x"])
    ch = pub.channel("y", (4,))                        with shared.channel("y").read() as frame:
    ch.next().fill_(1.0); ch.commit()                      print(frame.version, frame.tensor)
"""

from graphtree.share._memory import ShareUnavailableError
from graphtree.share._rendezvous import RefusedError
from graphtree.share.consumer import Attached, attach
from graphtree.share.producer import Publisher

__all__ = ["Attached", "Publisher", "RefusedError", "ShareUnavailableError", "attach"]
