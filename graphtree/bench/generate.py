"""The ``generate`` scenario: Hugging Face ``generate()`` with a static KV cache, per contender.

A randomly initialised ``LlamaForCausalLM`` (nothing downloaded; transformers is an optional
extra: without it the scenario reports one "not applicable" row and a hint) decodes greedily
with ``cache_implementation="static"``. Contenders replace ``model.forward``:

- ``eager``: the model as it is;
- ``graphtree``: ``model.forward = graphtree.graphed(model.forward)``;
- ``compile-reduce-overhead``: ``model.forward = torch.compile(model.forward, mode="reduce-overhead")``;
- ``hf-default``: what ``generate()`` does by itself (no ``disable_compile``): with a static cache it
  compiles the decode steps with ``torch.compile`` as its ``CompileConfig`` says, and runs the
  prefill uncompiled. What a user of Hugging Face runs otherwise; always in the scenario.
- ``graphtree-hf-compile`` (with ``graphtree``): the forward graphed and ``disable_compile=False``:
  HF compiles the decode step as it decides, without inductor's CUDA graphs, and graphtree graphs
  the compiled forward (``graphtree.tree.hf_compile``, issue 46).

Each contender keeps the compiled call HF stores on the model (``_compiled_call``) to itself: HF
reuses the stored one for an unchanged config, which would hand one contender's compiled step to
the other.

Four cases: ``fresh cache`` (what ``generate()`` does by default: a new ``StaticCache`` per call;
graphtree moves it into the memory of the decode step's recording, one device copy, instead of
recording again: ``graphtree.tree.adoption``), ``one cache`` (one ``StaticCache`` passed as
``past_key_values`` and reset between calls: every decode step replays), ``padded batch of 4``
(four prompts left-padded to one length, with their attention mask, fresh caches) and ``sampling``
(top-k 50, top-p 0.9, temperature 0.8, the seed set before each call).
``compile-reduce-overhead`` runs in a Python process of its own (:func:`in_own_process`), with
inductor's static CUDA launcher off (``TORCHINDUCTOR_USE_STATIC_CUDA_LAUNCHER=0`` unless set): on an
H100 (torch 2.11) the static launcher segfaulted on its first ``generate()`` with a fresh cache, in
a process of its own too, and took the benchmark down with it. Triton's own launcher raises
instead (``TypeError: Pointer argument must be either uint64 or have data_ptr method``), which
fails that case's row and leaves the ``one cache`` case to run. A process that dies is a failed row
naming the signal; the others' rows stand.

Reported: time per generated token (a whole ``generate()`` call / tokens), the first call's time
(warm-up and recording), for graphtree the share of decode steps that replayed, and graphtree's
time per token over HF's default's (``vs_hf_default``). Tokens are compared with eager's.

Example::

    rows = run_generate(ctx)   # from graphtree.bench.scenarios
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from functools import partial
from typing import TYPE_CHECKING, Any

import torch

import graphtree
from graphtree.bench import timing
from graphtree.bench.contenders import COMPILED, EAGER, GRAPHTREE, reset_all
from graphtree.bench.harness import Result, failed, interleaved, results_from_json

if TYPE_CHECKING:
    from graphtree.bench.kit import Ctx

SCENARIO = "generate"
REDUCE_OVERHEAD = "compile-reduce-overhead"
HF_DEFAULT = "hf-default"
GRAPHTREE_HF_COMPILE = "graphtree-hf-compile"
APPLICABLE = (EAGER, GRAPHTREE, REDUCE_OVERHEAD)
ONLY = "GRAPHTREE_BENCH_GENERATE_ONLY"
"""Set in the process :func:`in_own_process` starts: the one contender that process runs."""


def tiny_llama(hidden: int, layers: int, vocab: int, max_positions: int) -> Any:
    """A randomly initialised ``LlamaForCausalLM`` on the GPU, in eval mode (seed 0)."""
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 128),
        max_position_embeddings=max_positions,
    )
    torch.manual_seed(0)
    model: torch.nn.Module = transformers.LlamaForCausalLM(cfg)  # (typed as a module: HF's `to` wrapper confuses mypy)
    return model.to("cuda").eval()


def _new_step_each_call(compiled: Callable[..., Any]) -> Callable[..., Any]:
    """What a user of ``mode="reduce-overhead"`` does when ``generate()`` keeps a forward's outputs
    past the next call (cudagraph trees raise "accessing tensor output of CUDAGraphs that has been
    overwritten", and say to mark a step): ``torch.compiler.cudagraph_mark_step_begin()`` first."""

    def forward(*args: Any, **kwargs: Any) -> Any:
        torch.compiler.cudagraph_mark_step_begin()
        return compiled(*args, **kwargs)

    return forward


def _compiled_graphs() -> int:
    """Graphs torch.compile has made in this process so far (0 when dynamo was never imported)."""
    import sys

    utils = sys.modules.get("torch._dynamo.utils")
    return int(utils.counters["stats"]["unique_graphs"]) if utils is not None else 0


def generate_cases(ids: torch.Tensor, cache: Any) -> dict[str, tuple[torch.Tensor, dict[str, Any], str]]:
    """Each case's prompt, ``generate()`` arguments and note: ``ids`` a prompt of one row, ``cache``
    the ``StaticCache`` the ``one cache`` case keeps. The padded batch repeats the prompt four times,
    row r left-padded with r pad tokens (id 0) and masked so."""
    rows = 4
    padded = ids.repeat(rows, 1)
    mask = torch.ones_like(padded)
    for r in range(rows):
        padded[r, :r] = 0
        mask[r, :r] = 0
    sampling = {"do_sample": True, "top_k": 50, "top_p": 0.9, "temperature": 0.8}
    return {
        "fresh cache": (ids, {"cache_implementation": "static"}, "greedy, batch 1"),
        "one cache": (ids, {"past_key_values": cache}, "greedy, batch 1"),
        "padded batch of 4": (
            padded,
            {"cache_implementation": "static", "attention_mask": mask},
            "greedy, 4 prompts left-padded",
        ),
        "sampling": (
            ids,
            {"cache_implementation": "static", **sampling},
            "sampled (top-k 50, top-p 0.9, temperature 0.8), batch 1",
        ),
    }


def _disable_compile(name: str, hf_setting: Any) -> Any:
    """What ``generate(disable_compile=...)`` gets for contender ``name``: HF's own setting for HF's
    default, False for graphtree's twin that keeps HF's compile, True for the others."""
    if name == HF_DEFAULT:
        return hf_setting
    return name != GRAPHTREE_HF_COMPILE


class HFCompiledCalls:
    """The compiled call HF stores on ``model`` (``_compiled_call``, ``_last_compile_config``), kept
    per contender: HF reuses the stored one for an unchanged config, which would hand one
    contender's compiled decode step to another.

    Example::

        calls = HFCompiledCalls(model)
        with calls.of("hf-default"):
            model.generate(ids)
    """

    _ATTRS = ("_compiled_call", "_last_compile_config")

    def __init__(self, model: Any) -> None:
        self._model = model
        self._kept: dict[str, dict[str, Any]] = {}

    @contextlib.contextmanager
    def of(self, name: str) -> Iterator[None]:
        """Inside: ``model`` holds ``name``'s compiled call (none at first); after: kept for ``name``."""
        m = self._model
        self._take()
        for a, v in self._kept.get(name, {}).items():
            setattr(m, a, v)
        try:
            yield
        finally:
            self._kept[name] = self._take()

    def _take(self) -> dict[str, Any]:
        """Remove the compiled call stored on the model, and return it."""
        stored = self._model.__dict__
        return {a: stored.pop(a) for a in self._ATTRS if a in stored}


def run_generate(ctx: Ctx) -> list[Result]:
    """Time per generated token of ``generate()`` for each applicable contender, both cases."""
    cfg = ctx.cfg
    results: list[Result] = []
    # HF's own way, always, and compiled before reduce-overhead: both compile the model's forward,
    # whose code dynamo caches once per process (the second to compile meets the first's recompiles)
    applicable = [n for n in cfg.contenders if n in APPLICABLE]
    only = os.environ.get(ONLY)
    names = [only] if only else [n for n in applicable if n != REDUCE_OVERHEAD] + [HF_DEFAULT]
    if GRAPHTREE in names:
        names.append(GRAPHTREE_HF_COMPILE)
    own_process = [] if only else [n for n in applicable if n == REDUCE_OVERHEAD]
    for n in cfg.contenders:
        if n not in APPLICABLE:
            results.append(Result(SCENARIO, "all", n, "time_per_token", None, "s", note="not applicable to generate()"))
    try:
        import transformers
    except ImportError:
        for n in [*names, *own_process]:
            results.append(
                Result(
                    SCENARIO,
                    "all",
                    n,
                    "time_per_token",
                    None,
                    "s",
                    note="transformers is not installed (pip install 'graphtree[hf]'): scenario skipped",
                )
            )
        ctx.log("generate: transformers is not installed: skipped")
        return results
    quick = cfg.quick
    model = tiny_llama(
        hidden=128 if quick else 512, layers=2 if quick else 8, vocab=1024 if quick else 32000, max_positions=256
    )
    tokens = 16 if quick else 64
    ids = torch.randint(0, model.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0)).cuda()
    model.generation_config.pad_token_id = 0  # (the padded batch's)
    original = model.forward
    # graphed(model.forward) turns HF's own compile off in the model's generation config (two graph
    # systems on one forward): HF's default gets the setting back for its own calls
    hf_disable_compile = model.generation_config.disable_compile
    forwards: dict[str, Callable[..., Any]] = {EAGER: original, HF_DEFAULT: original}
    for name in names:
        if name == GRAPHTREE:
            forwards[name] = graphtree.graphed(original, name="LlamaForCausalLM.forward")
        elif name == GRAPHTREE_HF_COMPILE:
            forwards[name] = graphtree.graphed(original, name="LlamaForCausalLM.forward (HF's compile)")
        elif name == REDUCE_OVERHEAD:
            forwards[name] = _new_step_each_call(torch.compile(original, mode="reduce-overhead"))
    cache = transformers.StaticCache(config=model.config, max_cache_len=ids.shape[1] + tokens)
    hf_calls = HFCompiledCalls(model)
    for case, (case_ids, extra, case_note) in generate_cases(ids, cache).items():
        kw = {"max_new_tokens": tokens, "min_new_tokens": tokens, "do_sample": False, "disable_compile": True, **extra}

        def generate(name: str, kw: dict[str, Any] = kw, case_ids: Any = case_ids) -> torch.Tensor:
            model.forward = forwards[name]
            if "past_key_values" in kw:
                kw["past_key_values"].reset()
            if kw.get("do_sample"):
                torch.manual_seed(0)  # (each contender draws from the same seed)
            # HF's default compiles by itself, and graphtree's twin with HF's compile kept; everyone
            # else passes disable_compile=True
            call_kw = {**kw, "disable_compile": _disable_compile(name, hf_disable_compile)}
            try:
                with hf_calls.of(name):
                    return model.generate(case_ids, **call_kw)
            finally:
                model.forward = original

        expected = generate(EAGER)
        first: dict[str, float] = {}
        equal: dict[str, bool] = {}
        compiled: dict[str, int] = {}
        for name in names:
            try:
                if name in (*COMPILED, HF_DEFAULT, GRAPHTREE_HF_COMPILE):  # slow: a spent budget fails this row only
                    ctx.budget.check(f"{name} in generate/{case}")
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                out = generate(name)
                torch.cuda.synchronize()
                first[name] = time.perf_counter() - t0
                equal[name] = bool(torch.equal(out, expected))
                if name == HF_DEFAULT:  # that HF did compile (it is silent about it)
                    compiled[case] = _compiled_graphs()
            except Exception as exc:  # noqa: BLE001 - a contender that fails is reported, the others go on
                results.append(failed(SCENARIO, case, name, exc, "time_per_token"))
                ctx.log(f"generate: {case}: {name} FAILED: {exc}")
        ok = [n for n in names if n in first]
        t = interleaved(
            {n: partial(generate, n) for n in ok},
            repeats=3 if quick else 5,
            warmup=1,
            timer=timing.per_unit(partial(timing.wall_per_call, calls=1, sync=torch.cuda.synchronize), tokens),
            stop=ctx.budget.expired,
            min_repeats=2,
        )
        # One more call of each graphtree contender, untimed: its own counts (graphtree's counters are
        # the process's, and both graphtree contenders' calls were interleaved above)
        steady: dict[str, tuple[Any, Any]] = {}
        for name in ok:
            if name in (GRAPHTREE, GRAPHTREE_HF_COMPILE):
                before = graphtree.stats()
                generate(name)
                steady[name] = (before, graphtree.stats())
        medians = {}
        for name in ok:
            s = t.summary(name)
            if s is None:
                results.append(failed(SCENARIO, case, name, t.errors.get(name, "NoSamples"), "time_per_token"))
                continue
            medians[name] = s["median"]
            extra_info: dict[str, Any] = {"first_call_s": first[name]}
            if name == HF_DEFAULT:
                extra_info["dynamo_graphs_so_far"] = compiled.get(case, 0)
            note = f"{tokens} tokens per generate(), {case_note}"
            if name in steady:  # (in a call after the timed ones: one prefill, then tokens - 1 decode steps)
                before, after = steady[name]
                extra_info["replayed_decode_share"] = (after.replays - before.replays) / (tokens - 1)
                extra_info["recordings"] = after.recordings - before.recordings
                extra_info["adopted"] = after.adopted - before.adopted  # fresh caches moved in, not recorded
                extra_info["eager"] = dict(after.eager)
                share = extra_info["replayed_decode_share"]
                note += f"; {share:.0%} of decode steps replayed in a call after the timed ones"
            results.append(
                Result(
                    SCENARIO,
                    case,
                    name,
                    "time_per_token",
                    s["median"],
                    "s",
                    equal_to_eager=equal[name],
                    stats=s,
                    note=note,
                    extra=extra_info,
                )
            )
            results.append(
                Result(
                    SCENARIO,
                    case,
                    name,
                    "first_call_s",
                    first[name],
                    "s",
                    note="the first generate(): warm-up, recording or compiling included",
                )
            )
        for ours in (GRAPHTREE, GRAPHTREE_HF_COMPILE):
            if ours in medians and HF_DEFAULT in medians:
                results.append(
                    Result(
                        SCENARIO,
                        case,
                        ours,
                        "vs_hf_default",
                        medians[ours] / medians[HF_DEFAULT],
                        "x",
                        note=f"{ours}'s time per token over HF's default generate()'s (below 1: faster)",
                    )
                )
        ctx.log(f"generate: {case}: per token: " + " | ".join(f"{n} {v * 1e3:.3f} ms" for n, v in medians.items()))
    reset_all()
    for name in own_process:
        results += in_own_process(name, ctx)
    return results


def in_own_process(name: str, ctx: Ctx) -> list[Result]:
    """Run contender ``name`` of this scenario in a fresh ``python -m graphtree bench`` (with eager
    as its reference) and return its rows, or one failed row saying how that process ended.

    Its share of the budget is what is left of this scenario's. Example::

        rows = in_own_process("compile-reduce-overhead", ctx)
    """
    left = int(ctx.budget.part_deadline - ctx.budget.clock())
    if left < 20:
        return [failed(SCENARIO, "all", name, "NoSamples: time budget spent", "time_per_token")]
    with tempfile.TemporaryDirectory(prefix="graphtree-bench-") as out:
        cmd = [sys.executable, "-m", "graphtree", "bench", "--scenarios", SCENARIO, "--contenders", name]
        cmd += ["--budget", str(left), "--out", out, *(["--quick"] if ctx.cfg.quick else [])]
        ctx.log(f"generate: {name} in a process of its own ({left} s)")
        try:
            proc = subprocess.run(
                cmd, check=False, env=_own_env(name), capture_output=True, text=True, timeout=left + 60
            )
        except subprocess.TimeoutExpired:
            return [
                failed(SCENARIO, "all", name, f"TimeoutExpired: its process ran past {left + 60} s", "time_per_token")
            ]
        path = os.path.join(out, "bench.json")
        if not os.path.exists(path):
            why = f"ProcessDied: its process {exit_reason(proc.returncode)} before writing results"
            tail = [line for line in proc.stderr.splitlines() if line.strip()][-1:]
            ctx.log(f"generate: {name}: {why}" + (f" (last line: {tail[0][:200]})" if tail else ""))
            return [failed(SCENARIO, "all", name, why, "time_per_token")]
        with open(path) as f:
            rows = [r for r in results_from_json(json.load(f)) if r.contender == name]
    for r in rows:
        r.note = f"{r.note}; run in a process of its own" if r.note else "run in a process of its own"
    return rows


def _own_env(name: str) -> dict[str, str]:
    """The environment of contender ``name``'s own process: it alone runs, and inductor launches
    its kernels through Triton's launcher unless the caller chose (the module docstring says why)."""
    return {"TORCHINDUCTOR_USE_STATIC_CUDA_LAUNCHER": "0", **os.environ, ONLY: name}


def exit_reason(returncode: int) -> str:
    """How a process ended, in words: ``"was killed by SIGSEGV"``, ``"exited with status 1"``."""
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with status {returncode}"
