"""Issue 27's acceptance table: Hugging Face ``generate()`` per token, graphtree against HF's own default
and eager, for Llama, Mistral, Qwen2 and GPT-2 configs (random weights), at batch 1 and a left-padded
batch of 4, greedy and with seeded sampling, in one process.

Ways, each a whole ``generate()`` with a static cache (HF's default cache for compiling):

- ``eager``: ``disable_compile=True``, a fresh cache per call;
- ``hf-default``: what ``generate()`` does by itself (compiles the decode step);
- ``graphtree fresh``: ``model.forward`` graphed, a fresh cache per call (HF's default);
- ``graphtree kept``: ``model.forward`` graphed, one ``StaticCache`` passed and reset per call.

Per row: ms per token (median of ``--repeats`` calls after the first two, taken in rounds that time
every way once, in a rotating order), the first and second calls' seconds,
the ratio to ``hf-default``, and whether the tokens equal eager's (sampling: each call seeded the
same). Models are 8 layers, d=512 (``--small``: 2 layers, d=64, for a smoke run); 32 new tokens.
Run on a GPU::

    python benchmarks/generate_matrix.py [--repeats 3] [--families llama,gpt2] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import torch

import graphtree

TOKENS = 32
FAMILIES = ("llama", "mistral", "qwen2", "gpt2")


def _model(family: str, small: bool, device: str) -> Any:
    import transformers

    d, layers, vocab = (64, 2, 256) if small else (512, 8, 32000)
    torch.manual_seed(0)
    if family == "gpt2":
        model = transformers.GPT2LMHeadModel(
            transformers.GPT2Config(vocab_size=vocab, n_positions=256, n_embd=d, n_layer=layers, n_head=max(1, d // 64))
        )
    else:
        sizes = {
            "vocab_size": vocab,
            "hidden_size": d,
            "intermediate_size": 2 * d,
            "num_hidden_layers": layers,
            "num_attention_heads": max(1, d // 64),
            "num_key_value_heads": max(1, d // 128),
            "max_position_embeddings": 256,
        }
        kinds = {
            "llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig),
            "mistral": (transformers.MistralForCausalLM, transformers.MistralConfig),
            "qwen2": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config),
        }
        cls, config = kinds[family]
        model = cls(config(**sizes))
    model.generation_config.pad_token_id = 0
    return model.to(device).eval()


def _inputs(batch: int, vocab: int, device: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, vocab, (batch, 12), generator=g)
    mask = torch.ones_like(ids)
    for row, pad in enumerate((0, 3, 6, 9)[:batch]):  # left padding
        ids[row, :pad] = 0
        mask[row, :pad] = 0
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device)}


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def run(families: list[str], repeats: int, small: bool, device: str, save: Any = None) -> list[dict[str, Any]]:
    """The table's rows; ``save(rows)`` after each family (a run cut short keeps what it measured)."""
    import transformers

    rows: list[dict[str, Any]] = []
    for family in families:
        model = _model(family, small, device)
        original = model.forward
        hf_disable = model.generation_config.disable_compile
        graphed = graphtree.graphed(original, name=f"{family}.forward")
        for batch in (1, 4):
            inputs = _inputs(batch, model.config.vocab_size, device)
            kept = transformers.StaticCache(config=model.config, max_cache_len=inputs["input_ids"].shape[1] + TOKENS)
            for mode in ("greedy", "sampling"):
                base = {"max_new_tokens": TOKENS, "min_new_tokens": TOKENS, "do_sample": mode == "sampling"}
                ways = {
                    "eager": (original, {"cache_implementation": "static", "disable_compile": True}),
                    "hf-default": (original, {"cache_implementation": "static", "disable_compile": hf_disable}),
                    "graphtree fresh": (graphed, {"cache_implementation": "static", "disable_compile": True}),
                    "graphtree kept": (graphed, {"past_key_values": kept, "disable_compile": True}),
                }
                found = _measure(model, ways, inputs, base, kept, repeats, device, graphed)
                hf = found.get("hf-default", {}).get("ms_per_token")
                for way, r in found.items():
                    if hf and "ms_per_token" in r:
                        r["vs_hf_default"] = r["ms_per_token"] / hf
                    row = {"family": family, "batch": batch, "mode": mode, "way": way, **r}
                    rows.append(row)
                    print(_line(row), flush=True)
        if save is not None:
            save(rows)
        graphtree.reset()
        torch._dynamo.reset()  # (each family compiles its own forward: no recompile limits shared)
    return rows


def _measure(
    model: Any,
    ways: dict[str, tuple[Any, dict[str, Any]]],
    inputs: dict[str, torch.Tensor],
    base: dict[str, Any],
    kept: Any,
    repeats: int,
    device: str,
    graphed: Any,
) -> dict[str, dict[str, Any]]:
    """Each way's first and second calls, one way after another; then ``repeats`` rounds that time
    one call of every way each, in an order rotated every round (a drifting host weighs on all ways
    alike). What graphtree did is counted per call, so the two graphed ways are told apart."""
    original = model.forward
    want: list[torch.Tensor] = []
    found: dict[str, dict[str, Any]] = {}
    done: dict[str, dict[str, Any]] = {}

    def call(way: str) -> float:
        forward, kw = ways[way]
        model.forward = forward
        before = graphtree.stats()
        try:
            kept.reset()
            torch.manual_seed(2)  # sampling draws the same numbers in every way
            _sync(device)
            t0 = time.perf_counter()
            out = model.generate(**inputs, **base, **kw)
            _sync(device)
            dt = time.perf_counter() - t0
        finally:
            model.forward = original
        if not want:
            want.append(out)
        d = done.setdefault(way, {"equal": True, "calls": 0, "replays": 0, "recordings": 0, "eager": 0})
        d["equal"] = d["equal"] and bool(torch.equal(out, want[0]))
        d["calls"] += 1
        if forward is graphed:
            after = graphtree.stats()
            d["replays"] += after.replays - before.replays
            d["recordings"] += after.recordings - before.recordings
            d["eager"] += sum(after.eager.values()) - sum(before.eager.values())
        return dt

    live = []
    for way in ways:
        try:
            found[way] = {"first_s": call(way), "second_s": call(way), "times": []}
            live.append(way)
        except Exception as e:  # noqa: BLE001 - a way that fails is a row that says so
            found[way] = {"error": f"{type(e).__name__}: {e}"[:300]}
    for r in range(repeats):
        for way in live[r % len(live) :] + live[: r % len(live)]:
            if "error" in found[way]:
                continue
            try:
                found[way]["times"].append(call(way) / TOKENS)
            except Exception as e:  # noqa: BLE001
                found[way] = {"error": f"{type(e).__name__}: {e}"[:300]}
    for way in live:
        row = found[way]
        if "error" in row:
            continue
        times = row.pop("times")
        d = done[way]
        row.update(
            ms_per_token=statistics.median(times) * 1e3,
            equal=d["equal"],
            repeats_ms_per_token=[round(t * 1e3, 3) for t in times],
        )
        if ways[way][0] is graphed:  # what graphtree did for these calls: every forward, all of them
            row.update(replayed=d["replays"] / (d["calls"] * TOKENS), recordings=d["recordings"], eager=d["eager"])
    return found


def _line(r: dict[str, Any]) -> str:
    head = f"{r['family']:8s} b={r['batch']} {r['mode']:8s} {r['way']:16s}"
    if "error" in r:
        return f"{head} FAILED {r['error']}"
    ratio = f"{r['vs_hf_default']:.2f}x HF" if "vs_hf_default" in r else ""
    did = f"  replayed {r['replayed']:.0%}, {r['recordings']} rec., {r['eager']} eager" if "replayed" in r else ""
    each = "/".join(f"{t:.2f}" for t in r["repeats_ms_per_token"])
    return (
        f"{head} {r['ms_per_token']:7.3f} ms/token {ratio:>10s}  first {r['first_s']:6.2f} s"
        f" second {r['second_s']:5.2f} s"
        f"  tokens {'equal' if r['equal'] else 'DIFFER'}{did}  [{each}]"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--small", action="store_true", help="2-layer d=64 models (a smoke run)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    import transformers

    where = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    versions = {"device": where, "torch": torch.__version__, "transformers": transformers.__version__}

    def save(rows: list[dict[str, Any]]) -> None:
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"rows": rows, **versions}, f, indent=1)

    run(args.families.split(","), args.repeats, args.small, args.device, save)
    print(graphtree.stats())
    print("device:", where, "| torch", torch.__version__, "| transformers", transformers.__version__)


if __name__ == "__main__":
    main()
