"""CPU tests of the scenarios' control flow, with the CUDA-only pieces faked.

The GPU parts (CUDA graphs, CUDA events, torch.compile's cudagraph trees, the allocator) are
replaced by CPU stand-ins, so these tests check what the scenarios do with their contenders:
one row set per contender and scenario, failures recorded while the run goes on, correctness
compared against eager, a document that validates. Real numbers need the GPU test.
"""

from __future__ import annotations

import itertools
import sys
import time

import pytest
import torch

from graphtree.bench import contenders, kit, scenarios, timing
from graphtree.bench import share as bench_share
from graphtree.bench.harness import Progress, render_table, to_json, validate_json
from graphtree.demo.gpt import GPTConfig


class _FakeHandGraph:
    """Runs ``fn`` on static buffers each call, like a replay would (no CUDA needed)."""

    def __init__(self, fn, *example_args, pool=None, warmup=1, clone_inputs=True):
        self.fn = fn
        self.inputs = [a.clone() if clone_inputs else a for a in example_args]
        self.output = fn(*self.inputs)

    def __call__(self, *args):
        for static, a in zip(self.inputs, args):
            if a.data_ptr() != static.data_ptr():
                static.copy_(a)
        self.output.copy_(self.fn(*self.inputs))
        return self.output


def _fake_share_measure(steps, **sizes):
    """The figures graphtree.bench.share.measure returns, made up (it needs a GPU and processes)."""
    lat = bench_share._summary_us([400e-6 + k * 5e-6 for k in range(40)])  # the real summary's shape
    base = {"producer_cpu_per_step_us": 80.0, "producer_wall_per_step_us": 150.0}
    return [
        {"way": "none", **base, "copied_bytes_per_step": 0},
        {
            "way": "graphtree.share",
            **base,
            "copied_bytes_per_step": 0,
            "producer_cpu_over_none_us": 9.0,
            "publish_us": 30.0,
            "producer_waits": 3,
            "publish_overhead_us": 1.5,
            "publish_overhead_rounds_us": [1.0, 2.0],
            "consumer_latency_us": lat,
            "versions_read": 40,
            "tokens_equal": True,
            "attach_first_ms": 300.0,
            "attach_cached_ms": 0.8,
        },
        {
            "way": "mp-queue",
            **base,
            "copied_bytes_per_step": 4096,
            "consumer_latency_us": lat,
            "versions_read": 40,
            "tokens_equal": True,
        },
    ]


@pytest.fixture
def fake_gpu(monkeypatch):
    """Fake the CUDA-only calls; returns the list the fake compiler logs its calls to."""
    reserved = itertools.count(0, 2**21)
    compiled: list[str] = []
    monkeypatch.setattr(kit, "DEVICE", "cpu")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda *a, **k: next(reserved))
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda *a, **k: [])
    monkeypatch.setattr(contenders.gc, "collect", lambda *a: 0)  # a full collection is slow
    monkeypatch.setattr(timing, "calibrate_spin", lambda *a, **k: 1e9)
    monkeypatch.setattr(bench_share, "measure", _fake_share_measure)

    def gpu_time(fn, spin_cycles=0):
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    monkeypatch.setattr(timing, "gpu_time", gpu_time)
    monkeypatch.setattr(contenders, "HandGraph", _FakeHandGraph)

    def compile_fn(name, fn, dynamic=None):
        compiled.append(name)
        if name == "compile-cudagraphs":
            raise RuntimeError("backend failed\nlong details")
        return fn  # "compiled" = eager

    monkeypatch.setattr(contenders, "compile_fn", compile_fn)
    return compiled


def _tiny(**over):
    cfg = scenarios.BenchConfig.make(quick=True)
    small = dict(
        kernels=(1, 4),
        mm_rows=4,
        mm_dim=8,
        overhead_calls=2,
        overhead_repeats=2,
        overhead_warmup=1,
        gpt=GPTConfig(n_layer=1, n_head=2, d_model=16, vocab=32, max_seq=8),
        decode_batches=(1, 2),
        decode_steps=3,
        decode_check_steps=2,
        decode_repeats=2,
        decode_warmup=1,
        mem_buckets=(1, 2),
        mlp_d=8,
        mlp_hidden=16,
        mlp_layers=1,
        mlp_tokens=2,
        branch_batch=2,
        branch_iters=2,
        capture_buckets=3,
        capture_report=(1, 3),
        capture_d=8,
        capture_hidden=16,
        capture_layers=1,
        capture_tokens=2,
        capture_repeats=2,
        train_cases=("mlp",),
    )
    small.update(over)
    for k, v in small.items():
        setattr(cfg, k, v)
    return cfg


def test_all_scenarios_cover_every_contender_and_validate(fake_gpu, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # the generate rows below: as without it
    cfg = _tiny()
    rows = scenarios.run_scenarios(list(scenarios.SCENARIOS), cfg, Progress(quiet=True))
    meta = {
        "device": "fake",
        "torch": torch.__version__,
        "cuda": None,
        "python": "3",
        "date": "2025-01-01T00:00:00+00:00",
        "graphtree": "0",
        "command": "test",
        "duration_s": 1.0,
        "scenarios": list(scenarios.SCENARIOS),
        "contenders": list(cfg.contenders),
    }
    validate_json(to_json(rows, meta))  # includes: every scenario x contender has a row

    # the failing compile contender is reported in every scenario it applies to, with type and first line
    n_a = ("generate", "share", "breaks", "train")  # scenarios where it is not applicable
    bad = [r for r in rows if r.contender == "compile-cudagraphs" and r.scenario not in n_a]
    assert bad and all(not r.ok for r in bad)
    assert {r.error for r in bad} == {"RuntimeError: backend failed"}
    assert {r.scenario for r in bad} == set(scenarios.SCENARIOS) - set(n_a)
    # breaks: eager, graphtree with breaks off and on, each checked against eager on every call
    brk = [r for r in rows if r.scenario == "breaks" and r.case.startswith(("MLP", "mixture"))]
    assert {r.contender for r in brk} == {"eager", "graphtree, breaks off", "graphtree"}
    assert all(r.ok and r.value and r.equal_to_eager for r in brk), brk
    assert any("not applicable" in r.note for r in rows if r.scenario == "breaks" and r.contender == "handwritten")
    # share: graphtree.share is the graphtree row, the other ways are contenders of their own
    share = {(r.contender, r.metric): r for r in rows if r.scenario == "share"}
    assert share[("graphtree", "copied_per_step")].value == 0
    assert share[("graphtree", "producer_cpu_over_none")].value == pytest.approx(9e-6)
    assert share[("graphtree", "publish_overhead")].value == pytest.approx(1.5e-6)
    assert share[("graphtree", "producer_cpu_per_step")].note.startswith("3 of ")  # steps that waited
    assert share[("mp-queue", "copied_per_step")].value == 4 * 1024
    assert share[("graphtree", "consumer_latency")].stats["n"] == 40
    assert share[("eager", "producer_time_per_step")].note == "not a way to share"
    # generate() applies to eager, graphtree and reduce-overhead; without transformers it says so
    gen = {r.contender: r for r in rows if r.scenario == "generate"}
    want = {*cfg.contenders, "hf-default", "graphtree-hf-compile"}  # (graphtree's twin with HF's compile kept)
    assert set(gen) == want and all(r.ok and r.value is None for r in gen.values())
    assert "transformers is not installed" in gen["hf-default"].note  # HF's own way is always a contender
    assert "not applicable" in gen["handwritten"].note
    assert "transformers is not installed" in gen["graphtree"].note
    # ... and the others went on, with outputs equal to eager's
    for name in ("eager", "handwritten", "compile-reduce-overhead", "graphtree"):
        mine = [r for r in rows if r.contender == name and r.scenario != "train"]  # (train: below)
        assert mine and all(r.ok for r in mine), [r.error for r in mine if not r.ok]
        assert all(r.equal_to_eager is not False for r in mine)
    # train: eager and graphtree step alike (on the CPU, graphtree runs its step eagerly); the hand capture
    # and make_graphed_callables need a GPU and say so in failed rows
    train = {(r.contender, r.metric): r for r in rows if r.scenario == "train"}
    for name in ("eager", "graphtree", "graphtree-module"):
        assert all(train[(name, m)].ok for m in ("first_steps", "reserved", "wall_per_step")), train
    assert train[("graphtree", "wall_per_step")].equal_to_eager is True
    assert train[("graphtree-module", "wall_per_step")].equal_to_eager is True
    assert not train[("make_graphed_callables", "wall_per_step")].ok
    metrics = {(r.scenario, r.metric) for r in rows if r.ok}
    for expected in [
        ("overhead", "cpu_per_call"),
        ("overhead", "wall_per_call"),
        ("overhead", "gpu_time"),
        ("overhead", "compile_s"),
        ("decode", "time_per_token"),
        ("decode", "speedup"),
        ("memory", "graph_bytes"),
        ("capture", "record_s"),
        ("capture", "record_total_s"),
        ("branching", "vs_sum"),
        ("branching", "bytes_after_AB_ABp"),
    ]:
        assert expected in metrics, expected
    decode_cases = {r.case for r in rows if r.scenario == "decode" and r.metric == "time_per_token"}
    assert decode_cases == {"batch 1", "batch 2"}
    capture_cases = {r.case for r in rows if r.scenario == "capture" and r.metric == "record_s"}
    assert capture_cases == {"bucket 1", "bucket 3"}
    table = render_table(rows)
    assert "FAILED: RuntimeError: backend failed" in table


def test_spent_budget_skips_only_compiling(fake_gpu):
    cfg = _tiny(budget_s=0.0, contenders=("eager", "compile-reduce-overhead", "graphtree"), overhead_repeats=6)
    rows = scenarios.run_scenarios(["overhead", "memory"], cfg, Progress(quiet=True))
    skipped = [r for r in rows if r.contender == "compile-reduce-overhead"]
    assert skipped and all(not r.ok and r.error.startswith("BudgetExceeded") for r in skipped)
    assert fake_gpu == []  # never compiled
    for name in ("eager", "graphtree"):
        timed = [r for r in rows if r.contender == name and r.metric == "wall_per_call"]
        assert len(timed) == 2 and all(r.ok and r.value > 0 for r in timed)
        # the budget stops timing after the minimum number of measured rounds
        assert all(r.stats["n"] == scenarios.MIN_REPEATS < 6 for r in timed)


def test_crashing_scenario_is_reported_and_the_run_goes_on(fake_gpu, monkeypatch):
    def boom(ctx):
        raise ValueError("scenario bug")

    monkeypatch.setitem(scenarios.RUNNERS, "memory", boom)
    cfg = _tiny(contenders=("eager", "graphtree"))
    rows = scenarios.run_scenarios(["memory", "branching"], cfg, Progress(quiet=True))
    crashed = [r for r in rows if r.scenario == "memory"]
    assert len(crashed) == 2 and all(r.error == "ValueError: scenario bug" for r in crashed)
    assert any(r.scenario == "branching" and r.ok for r in rows)


def test_interrupt_keeps_rows_and_marks_the_rest(fake_gpu, monkeypatch):
    def stop(ctx):
        raise KeyboardInterrupt

    monkeypatch.setitem(scenarios.RUNNERS, "memory", stop)
    cfg = _tiny(contenders=("eager", "graphtree"))
    rows = scenarios.run_scenarios(["overhead", "memory", "branching"], cfg, Progress(quiet=True))
    assert any(r.scenario == "overhead" and r.ok for r in rows)
    later = [r for r in rows if r.scenario in ("memory", "branching")]
    assert len(later) == 4
    assert all(not r.ok and r.error.startswith(scenarios.INTERRUPTED) for r in later)


def _generate_ctx():
    from types import SimpleNamespace

    from graphtree.bench.harness import Budget

    budget = Budget(300, {"generate": 1})
    budget.begin("generate")
    logged: list[str] = []
    return SimpleNamespace(budget=budget, cfg=SimpleNamespace(quick=True), log=logged.append), logged


def test_a_contender_whose_own_process_dies_is_a_failed_row_naming_the_signal(monkeypatch):
    """reduce-overhead segfaulted inside torch on an H100 and took the whole benchmark with it: it
    runs in a process of its own, and that process dying is one failed row, not a lost run."""
    import subprocess

    from graphtree.bench import generate

    seen = {}

    def died(cmd, **kw):
        seen["cmd"], seen["env"] = cmd, kw["env"]
        return subprocess.CompletedProcess(cmd, -11, "", "Fatal Python error: Segmentation fault\n")

    monkeypatch.setattr(subprocess, "run", died)
    ctx, logged = _generate_ctx()
    (row,) = generate.in_own_process("compile-reduce-overhead", ctx)
    assert not row.ok and row.contender == "compile-reduce-overhead" and row.scenario == "generate"
    assert "killed by SIGSEGV" in row.error, row.error
    assert seen["env"][generate.ONLY] == "compile-reduce-overhead"
    # inductor's static launcher segfaulted (H100, torch 2.11): off in that process, unless the user chose
    assert seen["env"]["TORCHINDUCTOR_USE_STATIC_CUDA_LAUNCHER"] == "0"
    monkeypatch.setenv("TORCHINDUCTOR_USE_STATIC_CUDA_LAUNCHER", "1")
    generate.in_own_process("compile-reduce-overhead", ctx)
    assert seen["env"]["TORCHINDUCTOR_USE_STATIC_CUDA_LAUNCHER"] == "1"
    assert seen["cmd"][seen["cmd"].index("--contenders") + 1] == "compile-reduce-overhead" and "--quick" in seen["cmd"]
    assert any("Segmentation fault" in m for m in logged), logged


def test_a_contender_run_in_its_own_process_brings_back_its_rows_only(monkeypatch):
    import json
    import os
    import subprocess

    from graphtree.bench import generate
    from graphtree.bench.harness import Result

    def ran(cmd, **kw):
        out = cmd[cmd.index("--out") + 1]
        rows = [
            Result("generate", "fresh cache", "eager", "time_per_token", 5e-3, "s"),
            Result(
                "generate", "fresh cache", "compile-reduce-overhead", "time_per_token", 2e-3, "s", equal_to_eager=True
            ),
        ]
        with open(os.path.join(out, "bench.json"), "w") as f:
            json.dump({"results": [r.to_dict() for r in rows]}, f)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(subprocess, "run", ran)
    ctx, _ = _generate_ctx()
    (row,) = generate.in_own_process("compile-reduce-overhead", ctx)
    assert row.ok and row.value == 2e-3 and row.equal_to_eager is True
    assert "process of its own" in row.note
    assert generate.exit_reason(1) == "exited with status 1" and generate.exit_reason(-9) == "was killed by SIGKILL"


def test_hfs_compiled_call_is_kept_per_contender_not_handed_from_one_to_the_other():
    """HF reuses the compiled call it stored on the model for an unchanged config: graphtree's twin
    stored by one contender would have run as HF's default's compiled step (issue 46's bench)."""
    from types import SimpleNamespace

    from graphtree.bench.generate import HFCompiledCalls

    model = SimpleNamespace()
    calls = HFCompiledCalls(model)
    with calls.of("graphtree-hf-compile"):
        assert not hasattr(model, "_compiled_call")
        model._compiled_call, model._last_compile_config = "twin", "config"
    assert not hasattr(model, "_compiled_call")
    with calls.of("hf-default"):
        assert not hasattr(model, "_compiled_call")  # (HF compiles its own)
        model._compiled_call, model._last_compile_config = "hf's", "config"
    with calls.of("graphtree-hf-compile"):
        assert model._compiled_call == "twin"
    with calls.of("hf-default"):
        assert model._compiled_call == "hf's" and model._last_compile_config == "config"


def test_generate_runs_its_four_cases_for_each_contender_with_eagers_tokens(monkeypatch):
    """The scenario's plumbing on the CPU (graphtree runs CPU calls eagerly, compiles are identities):
    every case (fresh cache, one cache, a padded batch of four, sampling) has a row per contender,
    graphtree's twin with HF's compile kept included, and each has eager's tokens."""
    pytest.importorskip("transformers")
    import transformers

    from graphtree.bench import generate

    def cpu_llama(hidden, layers, vocab, max_positions):
        cfg = transformers.LlamaConfig(
            vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=max_positions,
        )  # fmt: skip
        torch.manual_seed(0)
        return transformers.LlamaForCausalLM(cfg).eval()

    monkeypatch.setattr(generate, "tiny_llama", cpu_llama)
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *a, **k: self)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(torch, "compile", lambda fn=None, **kw: fn)
    ctx, _logged = _generate_ctx()
    ctx.cfg.contenders = ("eager", "graphtree")
    rows = [r for r in generate.run_generate(ctx) if r.metric == "time_per_token"]
    cases = ["fresh cache", "one cache", "padded batch of 4", "sampling"]
    got = {(r.case, r.contender): r for r in rows}
    for case in cases:
        for name in ("eager", "graphtree", "hf-default", "graphtree-hf-compile"):
            row = got[(case, name)]
            assert row.ok, (case, name, row.error)
            assert row.equal_to_eager is True, (case, name)


def test_the_ddp_and_tp_scenarios_make_valid_rows_and_a_plot_in_a_world_of_one(tmp_path, monkeypatch):
    """The scenarios of several ranks on the CPU, over gloo, in a world of one (graphtree runs CPU
    calls eagerly): every contender's row, eager's reproducibility in its extra, a valid document and
    the two panels of a ranked run."""
    import types

    import torch.distributed as dist

    from graphtree.bench import ddp, tp
    from graphtree.bench.harness import validate_json
    from graphtree.bench.plot import RANK_PANELS, panel_data

    monkeypatch.setattr(ddp, "cases", lambda quick: [ddp.StepArgs("mlp", "ddp", batch=4, steps=6, round=2)])
    monkeypatch.setattr(tp, "decode_args", lambda quick: tp.DecodeArgs(layers=1, d_model=32, vocab=64, tokens=5))
    names = ("eager", "compile-reduce-overhead", "graphtree")
    ctx = types.SimpleNamespace(cfg=types.SimpleNamespace(quick=True, contenders=names), log=lambda m: None)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    try:
        with torch.no_grad():  # (as run_scenarios runs them: the training step turns grad on itself)
            rows = ddp.run_ddp(ctx) + tp.run_tp(ctx)
    finally:
        dist.destroy_process_group()
    assert not torch.are_deterministic_algorithms_enabled()  # (the step's setting does not outlive it)
    by = {(r.scenario, r.contender): r for r in rows}
    for scenario in ("ddp", "tp"):
        assert by[(scenario, "compile-reduce-overhead")].note == f"not applicable to {scenario}"
        for name in ("eager", "graphtree"):
            row = by[(scenario, name)]
            assert row.ok and row.value > 0 and row.equal_to_eager is True, row
    assert by[("ddp", "eager")].extra["eager_reproduces_itself"] is True
    assert by[("ddp", "graphtree")].extra["eager_reasons"] == {"no CUDA": 6}
    meta = {"device": "cpu", "torch": torch.__version__, "cuda": None, "python": "3", "date": "2026-11-27"}
    meta.update(graphtree="0", command="test", duration_s=1.0, scenarios=["ddp", "tp"], contenders=list(names))
    doc = to_json(rows, meta)
    validate_json(doc)
    for scenario, metric, *_ in RANK_PANELS:
        cases, contenders, _values = panel_data(doc, scenario, metric)
        assert cases and {"eager", "graphtree"} <= set(contenders), (scenario, cases, contenders)
