"""Pieces of the graphed writer's call on the bench's decode step, alternating rounds."""
import statistics, time, uuid
import torch, graphtree, graphtree.share as share
from graphtree import _native
from graphtree.bench.share import _model
from graphtree.share.channel import GraphedWriter

_native.wait(600)
model = _model(2, 256, 32000, 1)
rounds, calls = 30, 200
pieces = {"next": [], "_call": [], "_publish": []}

def timed_call(self, *args, **kwargs):
    ch = self.channel
    t0 = time.perf_counter()
    kwargs[self._out] = ch.next(timeout=self._timeout)
    t1 = time.perf_counter()
    s = ch._writing
    result = self._call(*args, **kwargs)
    t2 = time.perf_counter()
    ch._publish(s, ch.version + 1)
    t3 = time.perf_counter()
    pieces["next"].append(t1 - t0); pieces["_call"].append(t2 - t1); pieces["_publish"].append(t3 - t2)
    return result

with torch.no_grad():
    b, vocab, dtype = model.batch, model.cfg.vocab, model.wte.weight.dtype
    tokens = torch.zeros(b, 1, dtype=torch.long, device="cuda")
    pos = torch.zeros((), dtype=torch.long, device="cuda")
    step = graphtree.graphed(model.decode_step)
    own = [graphtree.mark_static(torch.empty(b, vocab, dtype=dtype, device="cuda")) for _ in range(3)]
    pub = share.Publisher(f"diag-{uuid.uuid4().hex[:8]}")
    ch = pub.channel("logits", (b, vocab), dtype, slots=3)
    publish = ch.graphed(model.decode_step, timeout=60)
    variants = {
        "A step out=own": lambda i: step(tokens, pos, out=own[i % 3]),
        "B publish": lambda i: publish(tokens, pos),
        "C publish._call out=slot": lambda i: publish._call(tokens, pos, out=ch.buffers[i % 3]),
        "P publish, timed pieces": lambda i: timed_call(publish, tokens, pos),
    }
    stream = torch.cuda.current_stream()
    res = {k: [] for k in variants}
    for r in range(rounds):
        for k, f in variants.items():
            xs = []
            for i in range(calls):
                t = time.perf_counter(); f(i); xs.append(time.perf_counter() - t); stream.synchronize()
            res[k].append(statistics.median(xs[calls // 10:]))
    print(torch.cuda.get_device_name(), torch.__version__)
    for k, v in res.items():
        print(f"{k:28s} median of round medians {statistics.median(v)*1e6:7.2f} us, lowest {min(v)*1e6:7.2f}")
    for k, v in pieces.items():
        print(f"  piece {k:10s} median {statistics.median(v)*1e6:6.2f} us")
    print(graphtree.stats())
