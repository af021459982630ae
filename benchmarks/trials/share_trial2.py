"""Device trial: (1) IPC events as graph record/wait nodes, cross-process ordering; (2) replay cost
by number of wait nodes; (3) decode-loop producer CPU decomposition (no consumer)."""
import statistics, sys, time, uuid
import torch
import torch.multiprocessing as mp

ROUNDS = 12

def consumer(rd_handle, wr_handle, buf, q, back):
    torch.cuda.init()
    rd = torch.cuda.Event.from_ipc_handle(0, rd_handle)
    wr = torch.cuda.Event.from_ipc_handle(0, wr_handle)
    s = torch.cuda.current_stream()
    res = []
    for r in range(2 * ROUNDS):
        expect = q.get()
        s.wait_event(wr)                      # the producer's in-graph record of the last version
        torch.cuda._sleep(30_000_000)         # ~15-20 ms of GPU time before reading
        copy = buf.clone()
        rd.record(s)                          # the read is done (the producer's graph waits on it)
        back.put("recorded")
        res.append((expect, float(copy[0]), float(copy[-1])))
    torch.cuda.synchronize()
    back.put(("res", res))

def med(f, k=3000):
    xs = []
    for _ in range(k):
        t = time.perf_counter(); f(); xs.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    return statistics.median(xs) * 1e6

def part12():
    torch.cuda.init()
    buf = torch.zeros(1 << 22, device="cuda")
    counter = torch.zeros((), device="cuda")
    rd = torch.cuda.Event(interprocess=True, external=True); rd.record()
    wr = torch.cuda.Event(interprocess=True, external=True); wr.record()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        buf.add_(0); torch.cuda.synchronize()
    graphs = {}
    for with_wait in (True, False):
        g = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(g):
                st = torch.cuda.current_stream()
                if with_wait:
                    st.wait_event(rd)
                counter.add_(1)
                buf.copy_(counter.expand_as(buf))
                wr.record(st)
        except Exception as e:
            print("capture failed (wait=%s): %r" % (with_wait, e)); return
        graphs[with_wait] = g
    print("1. captured: wait node + record node of IPC events; handles", len(bytes(rd.ipc_handle())))
    ctx = mp.get_context("spawn")
    q, back = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=consumer, args=(bytes(rd.ipc_handle()), bytes(wr.ipc_handle()), buf, q, back))
    p.start()
    value = 0
    for with_wait in (True, False):
        for r in range(ROUNDS):
            graphs[with_wait].replay(); value += 1
            q.put(value)             # consumer: wait on wr, sleep, read, record rd
            assert back.get(timeout=60) == "recorded"
            graphs[with_wait].replay(); value += 1   # overwrite: must wait for the read (wait node)
            torch.cuda.synchronize()
    item = back.get(timeout=120)
    p.join(60)
    res = item[1]
    for with_wait, part in ((True, res[:ROUNDS]), (False, res[ROUNDS:])):
        ok = sum(1 for e, a, b in part if a == e and b == e)
        print("2. wait node=%s: %d of %d reads saw their version whole; sample %s" % (with_wait, ok, len(part), part[:2]))
    # 3. replay CPU cost by number of wait nodes
    x = torch.zeros(16, device="cuda")
    for k in (0, 1, 4, 16, 62):
        evs = [torch.cuda.Event(interprocess=True, external=True) for _ in range(k)]
        for e in evs: e.record()
        rec = torch.cuda.Event(interprocess=True, external=True)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            st = torch.cuda.current_stream()
            for e in evs: st.wait_event(e)
            x.add_(1)
            if k >= 0: rec.record(st)
        g.replay(); torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(2000): g.replay()
        torch.cuda.synchronize()
        rate = (time.perf_counter() - t) / 2000 * 1e6
        print("3. %2d wait nodes + 1 record node: replay CPU %.2f us (median), %.2f us per replay in a stream of 2000" % (k, med(g.replay), rate))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        x.add_(1)
    plain = torch.cuda.Event(interprocess=True)
    st = torch.cuda.current_stream()
    print("3. plain graph: replay %.2f us; replay + CPU IPC record %.2f us" % (med(g.replay), med(lambda: (g.replay(), plain.record(st)))))

def part3(steps=400):
    import graphtree
    from graphtree import _native
    _native.start(); print("native:", _native.wait(120) is not None)
    from graphtree.demo.gpt import GPTConfig, TinyGPT
    import graphtree.share as share
    cfg = GPTConfig(n_layer=2, n_head=4, d_model=256, vocab=32000, max_seq=256)
    model = TinyGPT(cfg, batch=1).to("cuda").eval()
    pub = share.Publisher("trial-" + uuid.uuid4().hex[:6])
    ch = pub.channel("logits", (1, 32000), torch.float32, slots=3)
    plain = [torch.zeros(1, 32000, device="cuda") for _ in range(3)]
    for b in ch.buffers + plain: graphtree.mark_static(b)
    host = torch.zeros(8, dtype=torch.int64).pin_memory()
    class CAI:
        def __init__(s, ptr): s.__cuda_array_interface__ = {"shape": (8,), "typestr": "<i8", "data": (ptr, False), "strides": None, "version": 2}
    try:
        cells = torch.as_tensor(CAI(host.data_ptr()), device="cuda")
    except Exception as e:
        print("host-mapped view refused:", repr(e)); cells = None
    counter = torch.zeros(1, dtype=torch.int64, device="cuda")
    def step_mark(tokens, pos, out, cell):
        r = model.decode_step(tokens, pos, out=out)
        counter.add_(1)
        cell.copy_(counter)
        return r
    if cells is not None:
        views = [cells[i:i+1] for i in range(3)]
        for t in views: graphtree.mark_static(t)
    torch.set_grad_enabled(False)
    for way in ("none", "out-plain", "share-noconsumer", "out-plain+mark", "none", "out-plain", "share-noconsumer", "out-plain+mark"):
        if way.endswith("mark") and cells is None: continue
        graphtree.reset(); model.reset_cache()
        step = graphtree.graphed(step_mark if way.endswith("mark") else model.decode_step)
        tokens = torch.zeros(1, 1, dtype=torch.long, device="cuda"); pos = torch.zeros((), dtype=torch.long, device="cuda")
        cpu, parts = [], []
        stream = torch.cuda.current_stream()
        for v in range(1, steps + 1):
            if v % 256 == 0: pos.zero_()
            t0 = time.perf_counter()
            graphtree.mark_step()
            if way == "none":
                logits = step(tokens, pos); t1 = t2 = time.perf_counter()
            elif way == "out-plain":
                logits = step(tokens, pos, out=plain[v % 3]); t1 = t2 = time.perf_counter()
            elif way == "out-plain+mark":
                logits = step(tokens, pos, out=plain[v % 3], cell=views[v % 3]); t1 = t2 = time.perf_counter()
            else:
                b = ch.next(); t1 = time.perf_counter()
                logits = step(tokens, pos, out=b); t2 = time.perf_counter()
                ch.commit()
            t3 = time.perf_counter()
            tokens = logits.argmax(-1, keepdim=True); pos += 1
            cpu.append(time.perf_counter() - t0); parts.append((t1 - t0, t2 - t1, t3 - t2))
            stream.synchronize()
        m = lambda xs: statistics.median(xs[50:]) * 1e6
        if way.endswith("mark"): print("   host cells after the loop:", host[:3].tolist(), "(expect the last three step numbers)", str(graphtree.stats())[:300])
        print("4. %-17s producer CPU/step %.1f us; pieces (mark+next | step | commit) %.1f | %.1f | %.1f" % (way, m(cpu), m([p[0] for p in parts]), m([p[1] for p in parts]), m([p[2] for p in parts])))
    pub.close()

if __name__ == "__main__":
    print("#", torch.cuda.get_device_name(), torch.__version__)
    if "12" in sys.argv[1:] or len(sys.argv) == 1: part12()
    if "3" in sys.argv[1:] or len(sys.argv) == 1: part3()
