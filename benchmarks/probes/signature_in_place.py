"""What finding a call's fast hit costs the host: the key built and looked up, against the call's
arguments compared in place with the last hit's key.

A replay hit (``graphtree/_native/fast_replay.cpp``, ``fast_call``) builds the call's signature
(``keys.cpp``'s ``signature``: a tuple of ``(shape, dtype, stride)`` tuples and ``(type, value)``
pairs), packs it with the device and the thread's tree into a key, and looks that key up in the
callable's dict of hits: some six allocations, a deep hash and, on a hit, a deep compare with the
stored key. A call that repeats the last hit's signature could instead be read against that hit's
parts in place, allocating nothing. This probe builds (``torch.utils.cpp_extension.load_inline``, ~1 min)
the helpers' own ``signature``, taken from ``keys.cpp`` with its CUDA-device check relaxed so that
CPU tensors stand in, a ``key_lookup`` that does what ``fast_call`` does with it, and ``same``,
the in-place compare, and prints ns per call of each above an empty call of the same arguments.
It needs no GPU: the work measured is the host's. Run::

    PYTHONPATH=. python benchmarks/probes/signature_in_place.py [--json out.json]

Not measured: what keeping the last hit valid would cost (a pointer and a flag the hits' owner
clears when it drops one), and floats keyed as device scalars (``floats_keyed``), which an
in-place compare would take as matching any float at those positions.
"""

from __future__ import annotations

import argparse
import functools
import json
import pathlib
import platform
import timeit

import torch
from torch.utils.cpp_extension import load_inline

from graphtree.tree.readable import PLAIN_TYPES

_KEYS = pathlib.Path(__file__).resolve().parents[2] / "graphtree" / "_native" / "keys.cpp"
_CUDA_ONLY = "if (d < 0 || (device != -2 && d != device))"

_PROBE = r"""
PyObject* key_lookup(PyObject*, PyObject* const* a, Py_ssize_t) {  // (hits, args, plain, tree_id)
  PyObject* sig_args[2] = {a[1], a[2]};
  PyObject* sig = signature(nullptr, sig_args, 2);
  if (sig == nullptr || sig == Py_None) return sig;
  PyObject* key = PyTuple_Pack(3, PyTuple_GET_ITEM(sig, 0), PyTuple_GET_ITEM(sig, 1), a[3]);
  Py_DECREF(sig);
  if (key == nullptr) return nullptr;
  PyObject* hit = PyDict_GetItemWithError(a[0], key);
  Py_DECREF(key);
  if (hit == nullptr) {
    if (PyErr_Occurred()) return nullptr;
    Py_RETURN_NONE;
  }
  return Py_NewRef(hit);
}

// same(args, parts) -> bool: the arguments read against a signature's parts, allocating nothing.
PyObject* same(PyObject*, PyObject* const* a, Py_ssize_t) {
  PyObject* call = a[0];
  PyObject* parts = a[1];
  const Py_ssize_t n = PyTuple_GET_SIZE(call);
  if (PyTuple_GET_SIZE(parts) != n) Py_RETURN_FALSE;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* x = PyTuple_GET_ITEM(call, i);
    PyObject* p = PyTuple_GET_ITEM(parts, i);
    if (THPVariable_CheckExact(x)) {
      if (PyTuple_GET_SIZE(p) != 3) Py_RETURN_FALSE;
      const at::Tensor& t = THPVariable_Unpack(x);
      if (t.layout() != c10::kStrided || t.unsafeGetTensorImpl()->has_symbolic_sizes_strides() || t.is_conj() ||
          t.is_neg() || PyTuple_GET_ITEM(p, 1) != reinterpret_cast<PyObject*>(torch::getTHPDtype(t.scalar_type())))
        Py_RETURN_FALSE;
      const auto sizes = t.sizes();
      const auto strides = t.strides();
      PyObject* shape = PyTuple_GET_ITEM(p, 0);
      PyObject* stride = PyTuple_GET_ITEM(p, 2);
      if (PyTuple_GET_SIZE(shape) != static_cast<Py_ssize_t>(sizes.size())) Py_RETURN_FALSE;
      for (size_t k = 0; k < sizes.size(); ++k) {
        if (PyLong_AsLongLong(PyTuple_GET_ITEM(shape, k)) != sizes[k] ||
            PyLong_AsLongLong(PyTuple_GET_ITEM(stride, k)) != strides[k])
          Py_RETURN_FALSE;
      }
    } else {
      if (PyTuple_GET_SIZE(p) != 2 || PyTuple_GET_ITEM(p, 0) != reinterpret_cast<PyObject*>(Py_TYPE(x)))
        Py_RETURN_FALSE;
      const int equal = PyObject_RichCompareBool(PyTuple_GET_ITEM(p, 1), x, Py_EQ);
      if (equal < 0) return nullptr;
      if (!equal) Py_RETURN_FALSE;
    }
  }
  Py_RETURN_TRUE;
}

PyObject* empty(PyObject*, PyObject* const*, Py_ssize_t) { Py_RETURN_NONE; }

PyMethodDef methods[] = {
    {"signature", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(signature)), METH_FASTCALL, ""},
    {"key_lookup", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(key_lookup)), METH_FASTCALL, ""},
    {"same", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(same)), METH_FASTCALL, ""},
    {"empty", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(empty)), METH_FASTCALL, ""},
    {nullptr, nullptr, 0, nullptr}};
}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  for (PyMethodDef* d = methods; d->ml_name != nullptr; ++d) {
    m.attr(d->ml_name) = pybind11::reinterpret_steal<pybind11::object>(PyCFunction_New(d, nullptr));
  }
}
"""


def _source() -> str:
    """keys.cpp's ``int_tuple`` and ``signature``, CPU tensors let through, and the probe's functions."""
    keys = _KEYS.read_text()
    body = keys[keys.index("PyObject* int_tuple(") : keys.index("// object_state(obj")]
    if _CUDA_ONLY not in body:
        raise SystemExit(f"keys.cpp's signature no longer checks its device as `{_CUDA_ONLY}`: update this probe")
    body = body.replace(
        _CUDA_ONLY,
        "d = 0;  // (the probe's CPU tensors stand in for one device's)\n      if (device != -2 && d != device)",
    )
    head = [  # (load_inline puts torch/extension.h first)
        "#include <torch/csrc/DynamicTypes.h>",
        "#include <torch/csrc/autograd/python_variable.h>",
        "#include <c10/util/SmallVector.h>",
        "",
        "namespace {",
    ]
    return "\n".join(head) + "\n" + body + _PROBE


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=1_000_000, help="calls a repeat (default 1,000,000)")
    parser.add_argument("--repeats", type=int, default=5, help="repeats; the fastest is kept (default 5)")
    parser.add_argument("--json", help="write the figures here too")
    args = parser.parse_args()
    m = load_inline("signature_in_place", cpp_sources=_source(), extra_cflags=["-O2", "-DNDEBUG"])  # (as the helpers)
    plain = PLAIN_TYPES  # (the tuple graphtree passes the helpers' signature)
    tree_id = id(object())
    cases = {
        "one tensor": (torch.zeros(4, 8),),
        "a tensor, an int and a float": (torch.zeros(4, 8), 3, 0.5),
        "three tensors": (torch.zeros(4, 8), torch.zeros(8), torch.zeros(2, 3, 4)),
    }
    figures: dict[str, dict[str, float]] = {}
    host = platform.processor() or platform.machine()
    print(f"ns a call above an empty C call of the same arguments ({host}, torch {torch.__version__})")
    for label, call in cases.items():
        sig = m.signature(call, plain)
        hits = {(sig[0], sig[1], tree_id): "hit"}
        if m.key_lookup(hits, call, plain, tree_id) != "hit" or m.same(call, sig[0]) is not True:
            raise SystemExit(f"{label}: the probe's functions do not find the hit")
        other = (torch.zeros(4, 9), *call[1:])
        if m.same(other, sig[0]) is not False:
            raise SystemExit(f"{label}: `same` took another shape for the hit's")
        ways = {
            "empty": functools.partial(m.empty, call, plain),
            "signature": functools.partial(m.signature, call, plain),
            "signature, key, lookup": functools.partial(m.key_lookup, hits, call, plain, tree_id),
            "in place": functools.partial(m.same, call, sig[0]),
        }
        ns = {
            w: min(timeit.repeat(f, number=args.calls, repeat=args.repeats)) / args.calls * 1e9 for w, f in ways.items()
        }
        figures[label] = {w: ns[w] - ns["empty"] for w in ways if w != "empty"} | {"empty call": ns["empty"]}
        print(f"  {label:30s} " + "  ".join(f"{w} {v:.0f}" for w, v in figures[label].items()))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps({"torch": torch.__version__, "ns": figures}, indent=1))


if __name__ == "__main__":
    main()
