"""What a module's parameter address check costs on a GPU host: in a tight loop, where its cache
lines stay in the core's caches, against between graph replays, as a graphed call meets it.

A graphed module's replay checks that each parameter's data is where the recording read it
(``_native.addresses_unchanged``, ``graphtree/_native/DESIGN.md``). On the H100 host the 100
checks of ``per_call.py``'s module cost ~1 µs a call, ~10 ns a parameter, for ~44 instructions
each. If the tight loop is much cheaper than the same check between replays, the cost is the
cache lines each check loads, not its instructions. ``--variants`` also builds (with
``torch.utils.cpp_extension.load_inline``, ~1 min) two copies of the check's loop, one as the
helpers have it and one that first prefetches every line the loop will load (each tensor's Python
object and its ``TensorImpl``'s first three lines, from the packed pointers, then, those loads under
way, its ``StorageImpl``'s), and times both between replays. Prints ns per parameter for each.
Run on a GPU machine::

    PYTHONPATH=. python benchmarks/probes/param_check_cache.py [--params 100] [--variants] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from graphtree import _native
from graphtree.tree.node import statics_packed


def _median_ns(fn: Callable[[], object], calls: int, repeats: int) -> float:
    """The median over ``repeats`` of the ns a call of ``fn`` took, ``calls`` calls a repeat."""
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter_ns() - start) / calls)
    return statistics.median(times)


_VARIANTS = r"""
#include <torch/extension.h>
#include <torch/csrc/autograd/python_variable.h>
#include <cstring>

static inline uint64_t packed_at(const char* p, Py_ssize_t k) {
  uint64_t v;
  std::memcpy(&v, p + k * 8, 8);
  return v;
}

template <bool kPrefetch>
static bool check(PyObject* tensors, PyObject* expected) {
  const Py_ssize_t n = PyList_GET_SIZE(tensors);
  const char* want = PyBytes_AS_STRING(expected);
  PyObject* const* items = PySequence_Fast_ITEMS(tensors);
  if (kPrefetch) {  // (the objects and TensorImpls first; then, those loads under way, each StorageImpl)
    for (Py_ssize_t i = 0; i < n; ++i) {
      const char* impl = reinterpret_cast<const char*>(packed_at(want, 2 * i));
      __builtin_prefetch(items[i]);
      __builtin_prefetch(impl);
      __builtin_prefetch(impl + 64);
      __builtin_prefetch(impl + 128);
    }
    for (Py_ssize_t i = 0; i < n; ++i) {
      auto* impl = reinterpret_cast<c10::TensorImpl*>(packed_at(want, 2 * i));
      const char* storage = reinterpret_cast<const char*>(impl->unsafe_storage().unsafeGetStorageImpl());
      __builtin_prefetch(storage);
      __builtin_prefetch(storage + 32);
    }
  }
  for (Py_ssize_t i = 0; i < n; ++i) {
    auto* packed = reinterpret_cast<c10::TensorImpl*>(packed_at(want, 2 * i));
    if (THPVariable_Unpack(items[i]).unsafeGetTensorImpl() != packed) return false;
    c10::StorageImpl* storage = packed->unsafe_storage().unsafeGetStorageImpl();
    if (storage == nullptr) return false;
    char* data = static_cast<char*>(storage->mutable_data());
    void* have = packed->is_empty() ? nullptr : data + packed->itemsize() * packed->storage_offset();
    if (reinterpret_cast<uint64_t>(have) != packed_at(want, 2 * i + 1)) return false;
  }
  return true;
}

bool plain(py::list tensors, py::bytes expected) { return check<false>(tensors.ptr(), expected.ptr()); }
bool prefetched(py::list tensors, py::bytes expected) { return check<true>(tensors.ptr(), expected.ptr()); }
"""


def _variants() -> object:
    """The check's loop as the helpers have it, and with a prefetch pass first (see the module)."""
    from torch.utils.cpp_extension import load_inline

    return load_inline(
        "param_check_variants",
        cpp_sources=_VARIANTS,
        functions=["plain", "prefetched"],
        extra_cflags=["-O3", "-DNDEBUG"],
    )


def measure(params: int, calls: int, repeats: int, variants: bool = False) -> dict[str, float]:
    """ns per call of each loop, and of the check per parameter, tight and between replays."""
    native = _native.wait(600)
    if native is None or not hasattr(native, "addresses_unchanged"):
        raise SystemExit(f"no native helpers: {_native.status()}")
    module = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(16)) for _ in range(params)]).cuda()
    ps = list(module)
    packed = statics_packed(ps)
    check = native.addresses_unchanged
    assert check(ps, packed) is True
    x = torch.randn(1024, device="cuda")
    static_x = x.clone()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        (static_x * 2 + 1).sin()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        (static_x * 2 + 1).sin()

    def replay() -> None:
        static_x.copy_(x)
        g.replay()

    def replay_then_check() -> None:
        static_x.copy_(x)
        g.replay()
        check(ps, packed)

    empty: list[torch.Tensor] = []
    nothing = statics_packed(empty)
    out = {
        "check, tight": _median_ns(lambda: check(ps, packed), calls, repeats),
        "check of none, tight": _median_ns(lambda: check(empty, nothing), calls, repeats),
        "replay": _median_ns(replay, calls, repeats),
        "replay then check": _median_ns(replay_then_check, calls, repeats),
    }
    out["per parameter, tight"] = (out["check, tight"] - out["check of none, tight"]) / params
    between = out["replay then check"] - out["replay"] - out["check of none, tight"]
    out["per parameter, between replays"] = between / params
    if variants:
        v = _variants()
        assert v.plain(ps, packed) and v.prefetched(ps, packed)
        for name in ("plain", "prefetched"):
            fn = getattr(v, name)

            def then(fn: Callable[..., bool] = fn) -> None:
                static_x.copy_(x)
                g.replay()
                fn(ps, packed)

            out[f"replay then {name} loop"] = _median_ns(then, calls, repeats)
            out[f"{name} loop, tight"] = _median_ns(lambda fn=fn: fn(ps, packed), calls, repeats)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=100)
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--variants", action="store_true", help="also time the loop with a prefetch pass")
    parser.add_argument("--json", help="also write the figures here")
    a = parser.parse_args(argv)
    out = measure(a.params, a.calls, a.repeats, a.variants)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {a.params} parameters")
    for k, v in out.items():
        print(f"  {k:34s} {v:9.1f} ns")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, **out}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
