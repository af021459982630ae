"""PyTorch's CUDA-graph tests of ``test/test_cuda.py`` (pytorch/pytorch at 000e43cd), ported to
graphtree (issue 44): a graphed function called as users call it (warm-up, recording, replays) in
place of ``torch.cuda.graph``; each original name kept. Written in the eleventh session from a
reading of the file; run on an H100 (torch 2.11) in the twelfth session, where they found the bugs
fixed then (concurrent replays on two streams, checkpoint's RNG state, unpinned copies) and test bugs
(eager oracles of another configuration, a scaler that had scaled nothing).

| original                                                  | here                                       |
| --------------------------------------------------------- | ------------------------------------------ |
| test_graph_is_current_stream_capturing                    | ported: True in the capture only (a spy)   |
| test_graph_capture_simple                                 | ported                                     |
| test_graph_capture_oom                                    | ported: raised, the process stays usable   |
| test_repeat_graph_capture_cublas_workspace_memory         | ported: 100 graphed matmuls, memory flat   |
| test_graph_concurrent_replay                              | ported: replays on two streams in order    |
| test_graph_three_successive                               | ported: held outputs never overwritten     |
| test_graph_memory_stats_and_use_result_after_destroy_graph| ported: read after destroy, memory back    |
| test_graph_record_stream                                  | ported                                     |
| test_graph_cudnn_dropout                                  | ported                                     |
| test_graph_checkpoint_preserve_rng_state                  | ported: eager with the reason (RNG state)  |
| test_graph_manual_seed_mismatch_raises                    | ported: eager with the reason, or raises   |
| test_graph_make_graphed_callables                         | ported: the whole step graphed, amp on/off |
| test_graph_make_graphed_callables_parameterless_nograd_module | ported                                 |
| test_graph_make_graphed_callables_same_pool               | ported                                     |
| test_graph_optims_with_explicitly_capturable_param_groups | ported                                     |
| test_cuda_graph_error_options                             | ported: another thread allocates meanwhile |
| test_cuda_graph_raw_graph_reset_and_recapture             | ported: the in-place part                  |
| test_cuda_graph_tensor_item_not_allowed                   | ported: a host read, equal to eager        |
| test_unpinned_memory_use(_device_to_host)                 | ported                                     |
| TestCudaOptims.test_graph_optims                          | ported (a sample of the optimizers)        |
| TestCudaOptims.test_graph_scaling_fused_optimizers        | ported                                     |
| TestCudaOptims.test_graph_grad_scaling                    | ported: against an eager twin, each call   |
| test_graph_rng_functional, _distributions, _two_successive, test_graphsafe_set_get_rng_state | in test_random_gpu.py |

Not applicable: the raw CUDAGraph, allocator and pool APIs themselves:
test_accelerator_graph_simple, test_memory_stats_of_multiple_generators_and_graphs,
test_graph_capture_reset_recapture, test_graph_debugdump, test_graph_timing, test_graph_error,
test_graph_warn_if_has_zero_nodes, test_cuda_graph_raw_graph*,
test_cuda_graph_allocator_propagates_stream, TestBlockStateAbsorption,
TestCachingHostAllocatorCudaGraph's pinned-block tests, TestMemPool,
test_graph_external_wait_and_record
"""

from __future__ import annotations

import copy
import gc
import sys
import threading

import pytest
import torch
import torch.nn.functional as F

import graphtree
from graphtree.tree import manager

DEV = "cuda"

NOT_APPLICABLE = (  # the raw CUDAGraph, allocator and pool APIs themselves (see the table above)
    "test_accelerator_graph_simple", "test_memory_stats_of_multiple_generators_and_graphs",
    "test_graph_capture_reset_recapture", "test_graph_debugdump", "test_graph_timing", "test_graph_error",
    "test_graph_warn_if_has_zero_nodes", "test_cuda_graph_raw_graph_keep_graph_false", "test_cuda_graph_raw_graph",
    "test_cuda_graph_raw_graph_exec", "test_cuda_graph_allocator_propagates_stream", "TestBlockStateAbsorption",
    "TestCachingHostAllocatorCudaGraph (pinned blocks)", "TestMemPool", "test_graph_external_wait_and_record",
)  # fmt: skip


def _replays() -> int:
    return manager.tree_for(0).counters.replays


def _calls(fn, make_args, n=4):
    outs = []
    for i in range(n):
        graphtree.mark_step()
        out = fn(*make_args(i))
        outs.append(out.clone() if isinstance(out, torch.Tensor) else out)
    return outs


def test_graph_is_current_stream_capturing(monkeypatch):
    # What the function's call of torch.cuda.is_current_stream_capturing() answers, seen by a spy on
    # torch's function. (A list the function itself appends to would grow on warm-ups only: graphtree
    # takes that for bookkeeping a replay would skip and runs the function eagerly, with the reason.)
    seen = []
    capturing = torch.cuda.is_current_stream_capturing

    def spy():
        answer = capturing()
        if sys._getframe(1).f_code is fn.__code__:  # (the function's calls, not torch's own)
            seen.append(answer)
        return answer

    def fn(x):
        assert torch.cuda.is_current_stream_capturing() in (True, False)
        return x + 1

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", spy)

    g = graphtree.graphed(fn)
    x = torch.zeros(4, device=DEV)
    for _ in range(4):
        graphtree.mark_step()
        torch.testing.assert_close(g(x), x + 1)
        assert not capturing()
    s = graphtree.stats()
    assert not s.eager and s.replays == 2, s
    assert seen[-1] is True and not any(seen[:-1]), seen  # the warm-up, then the capture; replays run no Python


def test_graph_capture_simple():
    def fn(a):
        b = a
        for _ in range(10):
            b = b + 1
        return b

    g = graphtree.graphed(fn)
    before = _replays()
    for i in range(5):
        graphtree.mark_step()
        a = torch.full((1000,), float(i), device=DEV)
        assert g(a).sum().item() == 1000 * (i + 10)
    assert _replays() - before >= 3


def test_graph_capture_oom():
    g = graphtree.graphed(lambda x: torch.zeros(2**40, device=DEV) + x)
    with pytest.raises(RuntimeError, match="out of memory"):
        g(torch.ones(1, device=DEV))
    ok = graphtree.graphed(lambda x: x * 2)
    for _ in range(3):
        graphtree.mark_step()
        torch.testing.assert_close(ok(torch.ones(8, device=DEV)), torch.full((8,), 2.0, device=DEV))


def test_repeat_graph_capture_cublas_workspace_memory():
    a, b = torch.rand(1024, 512, device=DEV), torch.rand(512, 64, device=DEV)
    torch.mm(a, b)
    torch.cuda.synchronize()
    # (the process's own reserved memory, where torch's test reads the device's: other processes on
    # the GPU count there; cuBLAS's workspaces come from torch's allocator, so they show here too.
    # Cached blocks are emptied first, as torch.cuda.graph does at each capture of torch's test: a
    # dropped graphed function's pool goes back to the allocator, cached until emptied or needed.)
    torch.cuda.empty_cache()
    used_before = torch.cuda.memory_reserved()
    for _ in range(100):
        g = graphtree.graphed(torch.mm)
        for _ in range(3):
            graphtree.mark_step()
            g(a, b)
        del g
    gc.collect()
    graphtree.mark_step()  # (the last one's recordings go at its tree's next step)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    grown = torch.cuda.memory_reserved() - used_before
    assert grown < 0.1 * 2**30, grown / 2**20


def test_graph_concurrent_replay():
    size = 1_000_000

    def f(t, v):
        return (t.clone() + v) + (t.clone() + v)

    def five(a, v):
        b = a.clone()
        for _ in range(5):
            b = f(b, v)
        return b

    g0, g1 = graphtree.graphed(lambda a: five(a, 1)), graphtree.graphed(lambda a: five(a, 2))
    a = torch.ones(size, device=DEV)
    s0, s1 = torch.cuda.Stream(), torch.cuda.Stream()
    for _ in range(4):
        graphtree.mark_step()
        torch.cuda.synchronize()
        with torch.cuda.stream(s0):
            torch.cuda._sleep(1000000)
            s1.wait_stream(s0)
            b = g0(a)
        with torch.cuda.stream(s1):
            c = g1(a)
        torch.cuda.current_stream().wait_stream(s0)
        torch.cuda.current_stream().wait_stream(s1)
        assert b.sum().item() == size * 94
        assert c.sum().item() == size * 156


def test_graph_three_successive():
    size = 1000
    a = torch.ones(size, device=DEV)
    fn0 = graphtree.graphed(lambda x: (lambda b: (b + 1, b + 2))(x.clone()))
    fn1 = graphtree.graphed(lambda c: c + 3)
    fn2 = graphtree.graphed(lambda d: d + 4)
    for order in ("012", "012", "021", "021", "021"):
        graphtree.mark_step()
        c, d = fn0(a)
        if order == "012":
            e, f = fn1(c), fn2(d)
        else:
            f, e = fn2(d), fn1(c)
        del c
        assert e.sum().item() == 5 * size and f.sum().item() == 7 * size, order


def test_graph_memory_stats_and_use_result_after_destroy_graph():
    numel = 2621568

    def fn(a):
        b = a.clone()
        for _ in range(5):
            b = b.clone() + 1
        return b

    a = torch.ones(numel, device=DEV)
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()["active_bytes.all.current"]
    g = graphtree.graphed(fn)
    for _ in range(4):
        graphtree.mark_step()
        b = g(a)
    del g  # the graphed function destroyed: its last output is still the caller's (until the next step,
    gc.collect()  # graphtree's contract, as cudagraph trees': a held output is read, or cloned, before it)
    assert b.sum().item() == 6 * numel
    del b
    graphtree.reset()
    gc.collect()
    torch.cuda.empty_cache()
    grown = torch.cuda.memory_stats()["active_bytes.all.current"] - before
    assert grown <= 2**20, grown  # all given back (but a block's rounding)


def test_graph_record_stream():
    potential_problem = torch.zeros(3, device=DEV)
    s0 = torch.cuda.Stream()
    with torch.cuda.stream(s0):
        potential_problem.record_stream(s0)
        torch.cuda._sleep(50_000_000)
        potential_problem.fill_(1.0)
    del potential_problem
    s2 = torch.cuda.Stream()

    def fn(a):
        b = a.clone()
        s2.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s2):
            b.fill_(1.0)
            b.record_stream(s2)
        torch.cuda.current_stream().wait_stream(s2)
        del b
        return a * 2

    g = graphtree.graphed(fn)
    for _ in range(3):
        graphtree.mark_step()
        torch.testing.assert_close(g(torch.ones(3, device=DEV)), torch.full((3,), 2.0, device=DEV))
    torch.zeros(3, device=DEV)
    torch.cuda.synchronize()


def test_graph_cudnn_dropout():
    model = torch.nn.LSTM(512, 512, 2, dropout=0.5).to(DEV)
    x = torch.ones(100, 192, 512, device=DEV)
    g = graphtree.graphed(model)
    with torch.no_grad():
        for _ in range(3):
            graphtree.mark_step()
            out, (h, _) = g(x)
            assert out.shape == (100, 192, 512) and h.shape == (2, 192, 512)
            model(x)  # eager calls in between


def test_graph_checkpoint_preserve_rng_state():
    from torch.utils.checkpoint import checkpoint

    def fn(x):
        return x * torch.sigmoid(torch.randn(1, device=DEV))

    def step():
        x = torch.ones(1, device=DEV, requires_grad=True)
        y = checkpoint(fn, x, use_reentrant=False, preserve_rng_state=True)
        return torch.autograd.grad(y, x)[0]

    torch.manual_seed(42)
    want = step()
    g = graphtree.graphed(step)
    for _ in range(4):
        graphtree.mark_step()
        torch.manual_seed(42)
        assert torch.equal(g(), want)
    # (a recording cannot stash and restore the generator's state where eager does: eager, with why)
    assert any("get_rng_state" in r for r in graphtree.stats().eager), graphtree.stats()


def test_graph_manual_seed_mismatch_raises():
    def fn(x):
        torch.cuda.manual_seed(1)
        return x + torch.rand_like(x)

    torch.manual_seed(0)
    g = graphtree.graphed(fn)
    x = torch.zeros(16, device=DEV)
    for _ in range(3):
        graphtree.mark_step()
        got = g(x)
        assert torch.equal(got, fn(x))  # (each call reseeds: the same numbers)
    stats = graphtree.stats()
    assert stats.replays == 0 or not stats.eager, stats  # eager with a reason, or recorded as eager's


@pytest.mark.parametrize("amp", [False, True])
def test_graph_make_graphed_callables(amp):
    torch.manual_seed(5)
    n, d_in, h, d_out = 640, 4096, 2048, 1024
    model = torch.nn.Sequential(
        torch.nn.Linear(d_in, h), torch.nn.Dropout(0.1), torch.nn.Linear(h, h), torch.nn.Dropout(0.2),
        torch.nn.Linear(h, h), torch.nn.Dropout(0.1), torch.nn.Linear(h, d_out), torch.nn.Dropout(0.2),
    ).to(DEV)  # fmt: skip
    control = copy.deepcopy(model)
    data = [(torch.randn(n, d_in, device=DEV), torch.randn(n, d_out, device=DEV)) for _ in range(10)]

    def make_step(m):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)

        def step(x, y):
            opt.zero_grad(set_to_none=False)
            with torch.autocast("cuda", enabled=amp):
                loss = F.mse_loss(F.relu(m(x)), y)
            loss.backward()
            opt.step()
            return loss.detach()

        return step

    losses = {}
    for label, fn in (("control", make_step(control)), ("graphed", graphtree.graphed(make_step(model)))):
        torch.manual_seed(5)
        losses[label] = []
        for x, y in data:
            graphtree.mark_step()
            losses[label].append(fn(x, y).item())
    assert losses["graphed"] == losses["control"]
    for p, q in zip(model.parameters(), control.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
    assert graphtree.stats().replays >= 7, graphtree.stats()


@pytest.mark.parametrize("amp,cache", [(False, False), (True, False), (True, True)])
def test_graph_make_graphed_callables_parameterless_nograd_module(amp, cache):
    n = 640

    def parameterless(inputs):
        x = inputs["x"]
        idx = torch.arange(n, device=DEV).view(-1, 1).repeat(1, x.size(1))
        return {"output": torch.gather(x, 0, idx)}

    g = graphtree.graphed(parameterless)
    for i in range(10):
        graphtree.mark_step()
        inputs = {"x": torch.rand(n, 4096, device=DEV) + i, "unused_input": torch.randn(n, 2048, device=DEV)}
        with torch.autocast("cuda", enabled=amp, cache_enabled=cache):
            got = g(inputs)["output"]
            assert torch.equal(got, parameterless(inputs)["output"])


def test_graph_make_graphed_callables_same_pool():
    torch.manual_seed(0)
    models = [
        torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 128)).to(DEV)
        for _ in range(3)
    ]
    graphed = [graphtree.graphed(copy.deepcopy(m)) for m in models]
    for _ in range(4):
        graphtree.mark_step()
        for m, g in zip(models, graphed):
            x = torch.randn(64, 32, device=DEV)
            y, yg = m(x), g(x)
            y.norm().backward()
            yg.norm().backward()
            torch.testing.assert_close(yg, y)
            for p, q in zip(m.parameters(), g.parameters()):
                assert p.data_ptr() != q.data_ptr()
                torch.testing.assert_close(q.grad, p.grad)
            m.zero_grad()
            g.zero_grad()


@pytest.mark.parametrize("name", ["Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adadelta", "RMSprop", "ASGD"])
@pytest.mark.parametrize("second_capturable", [True, False])
def test_graph_optims_with_explicitly_capturable_param_groups(name, second_capturable):
    cls = getattr(torch.optim, name)
    params = [torch.nn.Parameter(torch.ones(1, device=DEV)) for _ in range(2)]
    ref = [torch.nn.Parameter(torch.ones(1, device=DEV)) for _ in range(2)]
    opt = cls(
        [{"params": [params[0]], "capturable": True}, {"params": [params[1]], "capturable": second_capturable}], lr=0.1
    )
    # (eager with the same groups: a capturable group computes its step on the device, in other
    # roundings than a group that is not; RAdam's differ by 1e-5)
    ref_opt = cls(
        [{"params": [ref[0]], "capturable": True}, {"params": [ref[1]], "capturable": second_capturable}], lr=0.1
    )
    _steps_equal(opt, ref_opt, params, ref, seed=0)


def _steps_equal(opt, ref_opt, params, ref, seed, steps=6):
    """``opt.step`` graphed and ``ref_opt.step`` eager, each given the same gradients: equal parameters."""
    step = graphtree.graphed(opt.step)
    gen = torch.Generator(DEV).manual_seed(seed)
    for _ in range(steps):
        for p, r in zip(params, ref):
            gr = torch.randn(p.shape, device=DEV, generator=gen)
            p.grad, r.grad = gr.clone(), gr.clone()
        graphtree.mark_step()
        step()
        ref_opt.step()
    for p, r in zip(params, ref):
        torch.testing.assert_close(p, r)


def test_cuda_graph_error_options():
    def fn(x):
        y = torch.zeros(2000, device=DEV) + x
        return y + y + y

    stop = threading.Event()
    errors = []

    def allocate():
        s = torch.cuda.Stream()
        try:
            while not stop.is_set():
                with torch.cuda.stream(s):
                    ptr = torch.cuda.caching_allocator_alloc(1024, stream=s)
                    torch.cuda.caching_allocator_delete(ptr)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    t = threading.Thread(target=allocate)
    t.start()
    try:
        for k in range(20):
            g = graphtree.graphed(fn, name=f"f{k}")
            for _ in range(3):
                graphtree.mark_step()
                torch.testing.assert_close(g(torch.ones(2000, device=DEV)), torch.full((2000,), 3.0, device=DEV))
    finally:
        stop.set()
        t.join()
    assert not errors, errors


def test_cuda_graph_raw_graph_reset_and_recapture():
    x = torch.zeros(2000, device=DEV)

    def bump():
        x.add_(1.0)  # a closure's tensor written in place
        return x.sum()

    g = graphtree.graphed(bump)
    for i in range(1, 5):
        graphtree.mark_step()
        assert g().item() == 2000 * i
        assert torch.equal(x, torch.full((2000,), float(i), device=DEV))


def test_cuda_graph_tensor_item_not_allowed():
    torch.manual_seed(0)
    a, b = torch.rand(500, 500, device=DEV), torch.rand(500, 500, device=DEV)
    perm = torch.randint(0, 500, (500,), device=DEV)

    def my_func(a, b):
        idx = perm[0]
        a[0] *= b[idx]
        return a

    g = graphtree.graphed(my_func)
    for _ in range(4):
        graphtree.mark_step()
        a1, a2 = a.clone(), a.clone()
        torch.testing.assert_close(g(a1, b), my_func(a2, b))


@pytest.mark.parametrize("direction", ["to_device", "to_host"])
def test_unpinned_memory_use(direction):
    cpu = torch.empty(8)

    def fn(x):
        if direction == "to_device":
            x = x + x.new_zeros(8).copy_(cpu.fill_(1.0), non_blocking=True)
        else:
            cpu.copy_(x, non_blocking=True)
        return x * 2

    g = graphtree.graphed(fn)
    for _ in range(3):
        graphtree.mark_step()
        x = torch.ones(8, device=DEV)
        torch.testing.assert_close(g(x), fn(x.clone()))


@pytest.mark.parametrize("name", ["Adam", "AdamW", "SGD", "RMSprop", "NAdam"])
def test_graph_optims(name):
    cls = getattr(torch.optim, name)
    kwargs = {"lr": 0.1, **({"betas": (0.9, 0.99)} if name in ("Adam", "AdamW") else {})}
    if name != "SGD":
        kwargs["capturable"] = True
    shapes = [(5, 5), (6, 6), ()]
    torch.manual_seed(0)
    params = [torch.randn(s, device=DEV, requires_grad=True) for s in shapes]
    ref = [p.detach().clone().requires_grad_() for p in params]
    opt, ref_opt = cls(params, **kwargs), cls(ref, **{k: v for k, v in kwargs.items() if k != "capturable"})
    _steps_equal(opt, ref_opt, params, ref, seed=1)


def test_graph_scaling_fused_optimizers():
    torch.manual_seed(0)
    params = [torch.randn(5, 5, device=DEV, requires_grad=True), torch.randn(6, 6, device=DEV, requires_grad=True)]
    ref = [p.detach().clone().requires_grad_() for p in params]
    opt = torch.optim.Adam(params, lr=0.1, fused=True, capturable=True)
    ref_opt = torch.optim.Adam(ref, lr=0.1, fused=True, capturable=True)
    scaler, ref_scaler = torch.amp.GradScaler(init_scale=128.0), torch.amp.GradScaler(init_scale=128.0)
    for s in (scaler, ref_scaler):  # (a scaler steps only after it has scaled a loss: its scale is made then)
        s.scale(torch.ones((), device=DEV))

    def step():
        scaler.step(opt)
        scaler.update()

    g = graphtree.graphed(step)
    gen = torch.Generator(DEV).manual_seed(2)
    for _ in range(6):
        for p, r in zip(params, ref):
            gr = torch.randn(p.shape, device=DEV, generator=gen) * 128.0
            p.grad, r.grad = gr.clone(), gr.clone()
        graphtree.mark_step()
        g()
        ref_scaler.step(ref_opt)
        ref_scaler.update()
    for p, r in zip(params, ref):
        torch.testing.assert_close(p, r)


def test_graph_grad_scaling():
    # torch's sequence of gradients and scales (an overflow halves the scale and skips the step),
    # from a graphed forward-backward, each call compared with an eager twin's (graphtree's warm-up
    # and recording are calls too: both run the same calls from the start)
    def make():
        weight = torch.ones(100, device=DEV, requires_grad=True)
        box = {"scaler": torch.amp.GradScaler(init_scale=4.0)}

        def forward_backward(x):
            if weight.grad is not None:
                weight.grad.zero_()
            loss = (weight.half() * x).sum()
            box["scaler"].scale(loss).backward()
            return loss.detach()

        return weight, box, torch.optim.SGD([weight], lr=0.1), forward_backward

    weight, box, opt, fn = make()
    twin_weight, twin_box, twin_opt, twin_fn = make()
    g = graphtree.graphed(fn)
    datas = [1.0, 1.0, 5.0, 20000.0, 5.0, 40000.0, 5.0]
    for i, data in enumerate(datas):
        graphtree.mark_step()
        x = torch.full((100,), data, device=DEV, dtype=torch.half)
        g(x)
        twin_fn(x.clone())
        assert torch.equal(weight.grad, twin_weight.grad), (
            i,
            data,
            weight.grad[:2],
            twin_weight.grad[:2],
            graphtree.stats(),
        )
        for b, o in ((box, opt), (twin_box, twin_opt)):
            b["scaler"].step(o)
            b["scaler"].update()
        assert box["scaler"].get_scale() == twin_box["scaler"].get_scale(), i
        assert torch.equal(weight, twin_weight), i
    # and the scales torch's test expects of the calls after the first two: an overflow halves it
    assert twin_box["scaler"].get_scale() == 1.0
