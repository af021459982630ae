"""Does a graphed HF model with SDPA attention give eager's logits bit for bit? (eighteenth session)

transformers 5.17's ``is_tracing()`` includes ``torch.cuda.is_current_stream_capturing()``, and with
SDPA attention ``masking_utils._ignore_causal_mask_sdpa`` skips the causal mask only when not
tracing: eagerly a prefill runs SDPA with ``is_causal=True`` and no mask, a decode step with no mask;
in a capture both get an explicit mask, so another attention kernel. A test comparing a graphed
Llama's logits with eager's bitwise failed so on the H100 (``docs/gpu-notes.md``, eighteenth session).

This probe measures, for a tiny Llama (SDPA) at batch 1 and a left-padded batch of three, with
``generate()`` on a static cache, greedy:

- ``as is``: graphtree as it ships;
- ``capture hidden``: transformers' capture check patched to say False, so the mask decisions are
  eager's; their ``padding_mask.all()`` then reads the device in the capture, which graphtree
  records per value (``tree/breaks.py``).

For each: every step's logits against eager's (bitwise, or the largest difference), the tokens, what
graphtree did (recordings, replays, recordings for new values read, eager reasons), and ms per token
(median of five ``generate()`` calls after two). Run on a GPU::

    python benchmarks/probes/hf_sdpa_capture.py [--json out.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from collections.abc import Iterator
from typing import Any

import torch

import graphtree
from graphtree.bench.generate import tiny_llama

NEW = 16


@contextlib.contextmanager
def _capture_hidden() -> Iterator[None]:
    """transformers' capture check says False (its mask decisions are then eager's)."""
    from transformers.utils import import_utils

    real = import_utils.is_cuda_stream_capturing
    import_utils.is_cuda_stream_capturing = lambda: False
    try:
        yield
    finally:
        import_utils.is_cuda_stream_capturing = real


def _inputs(batch: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(1, 256, (batch, 7), generator=g)
    mask = torch.ones_like(ids)
    for row in range(1, batch):  # left padding on every row but the first
        ids[row, : 2 * row] = 0
        mask[row, : 2 * row] = 0
    return {"input_ids": ids.cuda(), "attention_mask": mask.cuda()}


def _generate(model: Any, inputs: dict[str, torch.Tensor]) -> Any:
    return model.generate(
        **inputs,
        max_new_tokens=NEW,
        do_sample=False,
        cache_implementation="static",
        output_logits=True,
        return_dict_in_generate=True,
        pad_token_id=0,
        disable_compile=True,
    )


def _ms_per_token(model: Any, inputs: dict[str, torch.Tensor]) -> float:
    times = []
    for i in range(7):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        _generate(model, inputs)
        torch.cuda.synchronize()
        if i >= 2:
            times.append((time.perf_counter() - t0) * 1e3 / NEW)
    return statistics.median(times)


def _compare(want: Any, got: Any) -> dict[str, Any]:
    diffs = [(a.float() - b.float()).abs().max().item() for a, b in zip(want.logits, got.logits, strict=True)]
    return {
        "tokens_equal": torch.equal(want.sequences, got.sequences),
        "steps_bitwise": sum(torch.equal(a, b) for a, b in zip(want.logits, got.logits, strict=True)),
        "steps": len(diffs),
        "max_abs_diff": max(diffs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    rows = []
    with torch.inference_mode():
        for batch in (1, 3):
            inputs = _inputs(batch)
            eager = tiny_llama(256, 4, 256, 128)
            want = _generate(eager, inputs)
            eager_ms = _ms_per_token(eager, inputs)
            for way in ("as is", "capture hidden"):
                graphtree.reset()
                model = tiny_llama(256, 4, 256, 128)
                model.forward = graphtree.graphed(model.forward)
                with _capture_hidden() if way == "capture hidden" else contextlib.nullcontext():
                    for _ in range(3):  # warm-up, recording, replays
                        got = _generate(model, inputs)
                    ms = _ms_per_token(model, inputs)
                s = graphtree.stats()
                row = {
                    "batch": batch,
                    "way": way,
                    **_compare(want, got),
                    "ms_per_token": round(ms, 3),
                    "eager_ms_per_token": round(eager_ms, 3),
                    "recordings": s.recordings,
                    "replays": s.replays,
                    "values": s.values,
                    "eager": dict(s.eager),
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
