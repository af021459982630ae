// graphtree's native helpers: the per-call loops of the replay fast path that cost 70-100 ns per
// tensor in Python, and its input copy (see DESIGN.md beside this file). Built on first use by
// torch.utils.cpp_extension.load (graphtree/_native/__init__.py); everything here has a Python
// twin that graphtree uses until the build is ready, or when it cannot be built.
//
// Only exact torch.Tensor and nn.Parameter objects are read here: a tensor subclass may override
// attribute access through __torch_function__, so any other object makes a function return None
// and the caller takes its Python path.

#include <Python.h>

#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/autograd/python_variable.h>

#include <ATen/Context.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/DefaultDtype.h>
#include <c10/core/StorageImpl.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/SmallVector.h>

#include <dlfcn.h>

#ifdef GRAPHTREE_CUDA
#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <ATen/cuda/CUDAGraph.h>
#include <ATen/ops/from_blob.h>
#include <torch/csrc/Generator.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/csrc/utils/pybind.h>

#include <memory>

#include <algorithm>
#include <mutex>
#endif

#include <cstdint>
#include <cstring>
#include <unordered_set>

#define GT_CONCAT_(a, b) a##b
#define GT_CONCAT(a, b) GT_CONCAT_(a, b)
#define GT_STR_(a) #a
#define GT_STR(a) GT_STR_(a)

namespace {

// The data address of tensor object t into *out; false with a Python error set when t is not a
// tensor (TypeError with message not_a_tensor) or has no storage (RuntimeError).
bool tensor_address(PyObject* t, const char* not_a_tensor, void** out) {
  if (!THPVariable_CheckExact(t) && PyObject_IsInstance(t, THPVariableClass) != 1) {
    PyErr_Clear();
    PyErr_SetString(PyExc_TypeError, not_a_tensor);
    return false;
  }
  try {
    *out = THPVariable_Unpack(t).data_ptr();
  } catch (const std::exception& e) {  // a tensor without storage: no address to compare
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return false;
  }
  return true;
}

// ptrs_equal(tensors, ptrs, idx) -> bool: tensors[i].data_ptr() == ptrs[i] for every i in idx.
// The arguments are lists or tuples; the same contract as torch's
// _tensors_data_ptrs_at_indices_equal, without a pybind11 cast per item.
PyObject* ptrs_equal(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 3) {
    PyErr_SetString(PyExc_TypeError, "ptrs_equal(tensors, ptrs, idx) takes 3 arguments");
    return nullptr;
  }
  for (Py_ssize_t k = 0; k < 3; ++k) {
    if (!PyList_Check(args[k]) && !PyTuple_Check(args[k])) {
      PyErr_SetString(PyExc_TypeError, "ptrs_equal: tensors, ptrs and idx must be lists or tuples");
      return nullptr;
    }
  }
  // Lists or tuples, checked above: their items are read in place.
  const Py_ssize_t nt = PySequence_Fast_GET_SIZE(args[0]);
  const Py_ssize_t np = PySequence_Fast_GET_SIZE(args[1]);
  const Py_ssize_t ni = PySequence_Fast_GET_SIZE(args[2]);
  PyObject** t_items = PySequence_Fast_ITEMS(args[0]);
  PyObject** p_items = PySequence_Fast_ITEMS(args[1]);
  PyObject** i_items = PySequence_Fast_ITEMS(args[2]);
  for (Py_ssize_t k = 0; k < ni; ++k) {
    const Py_ssize_t i = PyLong_AsSsize_t(i_items[k]);
    if (i == -1 && PyErr_Occurred()) return nullptr;
    if (i < 0 || i >= nt || i >= np) {
      PyErr_SetString(PyExc_IndexError, "ptrs_equal: index out of range");
      return nullptr;
    }
    void* want = PyLong_AsVoidPtr(p_items[i]);
    if (want == nullptr && PyErr_Occurred()) return nullptr;
    void* have = nullptr;
    if (!tensor_address(t_items[i], "ptrs_equal: expected a tensor", &have)) return nullptr;
    if (have != want) Py_RETURN_FALSE;
  }
  Py_RETURN_TRUE;
}

// addresses_unchanged(tensors: list, expected: bytes) -> bool: tensors[i].data_ptr() equals the
// i-th native-endian uint64 of expected, for every i. The check of a module's parameters and
// buffers on every replay: the expected addresses are packed once, at the recording, so a call
// converts no Python ints.
PyObject* addresses_unchanged(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2 || !PyList_Check(args[0]) || !PyBytes_Check(args[1])) {
    PyErr_SetString(PyExc_TypeError, "addresses_unchanged(tensors: list, expected: bytes)");
    return nullptr;
  }
  PyObject* tensors = args[0];
  const Py_ssize_t n = PyList_GET_SIZE(tensors);
  if (PyBytes_GET_SIZE(args[1]) != n * static_cast<Py_ssize_t>(sizeof(uint64_t))) Py_RETURN_FALSE;
  const char* expected = PyBytes_AS_STRING(args[1]);
  for (Py_ssize_t i = 0; i < n; ++i) {
    uint64_t want;
    std::memcpy(&want, expected + i * sizeof(uint64_t), sizeof(uint64_t));
    void* have = nullptr;
    PyObject* t = PyList_GET_ITEM(tensors, i);
    if (!tensor_address(t, "addresses_unchanged: expected a list of tensors", &have)) return nullptr;
    if (reinterpret_cast<uint64_t>(have) != want) Py_RETURN_FALSE;
  }
  Py_RETURN_TRUE;
}

// weak_unchanged(refs: bytes, expected: bytes) -> bool: each packed weak reference (a
// StorageImpl* that UntypedStorage._weak_ref() returned) is still alive with its data at the
// address packed at the same index of expected. The check of the tensors a recording reads from
// outside (globals, closures, an optimizer's state) on every replay; its Python twin makes a
// storage object per reference to read its address.
PyObject* weak_unchanged(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2 || !PyBytes_Check(args[0]) || !PyBytes_Check(args[1]) ||
      PyBytes_GET_SIZE(args[0]) != PyBytes_GET_SIZE(args[1])) {
    PyErr_SetString(PyExc_TypeError, "weak_unchanged(refs: bytes, expected: bytes) of equal lengths");
    return nullptr;
  }
  const Py_ssize_t n = PyBytes_GET_SIZE(args[0]) / static_cast<Py_ssize_t>(sizeof(uint64_t));
  const char* refs = PyBytes_AS_STRING(args[0]);
  const char* expected = PyBytes_AS_STRING(args[1]);
  for (Py_ssize_t i = 0; i < n; ++i) {
    uint64_t ref, want;
    std::memcpy(&ref, refs + i * sizeof(uint64_t), sizeof(uint64_t));
    std::memcpy(&want, expected + i * sizeof(uint64_t), sizeof(uint64_t));
    auto* impl = reinterpret_cast<c10::StorageImpl*>(ref);
    if (impl == nullptr || c10::raw::weak_intrusive_ptr::use_count(impl) == 0) Py_RETURN_FALSE;
    if (reinterpret_cast<uint64_t>(impl->data_ptr().get()) != want) Py_RETURN_FALSE;
  }
  Py_RETURN_TRUE;
}

// copy_d2d(dst, src, nbytes, stream) -> bool: a device-to-device cudaMemcpyAsync of nbytes on
// the given raw stream, through the CUDA runtime that torch already loaded (found with dlsym, so
// nothing here is built against CUDA). False, having done nothing, where no runtime is loaded
// (a CPU build): the caller copies another way. A CUDA error raises RuntimeError.
using MemcpyAsync = int (*)(void*, const void*, size_t, int, void*);
using ErrorString = const char* (*)(int);
constexpr int kDeviceToDevice = 3;  // cudaMemcpyDeviceToDevice

void* runtime_symbol(const char* name) {
  if (void* f = dlsym(RTLD_DEFAULT, name)) return f;
  for (const char* lib : {"libcudart.so.13", "libcudart.so.12", "libcudart.so"}) {
    if (void* h = dlopen(lib, RTLD_LAZY | RTLD_NOLOAD)) {  // only a runtime already in the process
      if (void* f = dlsym(h, name)) return f;
    }
  }
  return nullptr;
}

PyObject* copy_d2d(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  static MemcpyAsync memcpy_async = reinterpret_cast<MemcpyAsync>(runtime_symbol("cudaMemcpyAsync"));
  static ErrorString error_string = reinterpret_cast<ErrorString>(runtime_symbol("cudaGetErrorString"));
  if (nargs != 4) {
    PyErr_SetString(PyExc_TypeError, "copy_d2d(dst, src, nbytes, stream) takes 4 arguments");
    return nullptr;
  }
  if (memcpy_async == nullptr) Py_RETURN_FALSE;
  void* dst = PyLong_AsVoidPtr(args[0]);
  void* src = PyLong_AsVoidPtr(args[1]);
  const size_t nbytes = PyLong_AsSize_t(args[2]);
  void* stream = PyLong_AsVoidPtr(args[3]);
  if (PyErr_Occurred()) return nullptr;
  const int err = memcpy_async(dst, src, nbytes, kDeviceToDevice, stream);
  if (err != 0) {
    PyErr_Format(PyExc_RuntimeError, "graphtree: cudaMemcpyAsync of an input failed: %s (%d)",
                 error_string ? error_string(err) : "cudaError", err);
    return nullptr;
  }
  Py_RETURN_TRUE;
}

// copy_in(stream, leaves, copies, writes) -> bool: a replay's whole copy-in in one call. copies is
// a flat tuple of (leaf, dst, nbytes): a device-to-device cudaMemcpyAsync from the exact tensor
// leaves[leaf]; writes a flat tuple of (leaf, dst): the Python float (as a float64) or int (as an
// int64) leaves[leaf] written to the 8 bytes at dst with cuStreamWriteValue64, stream-ordered and
// without a kernel (fill_ launched one). Every leaf is read before anything is written; False,
// having done nothing, where the runtime or the driver's entry is not loaded or a leaf is not
// what the plan expects: not an exact tensor or number, or a tensor with its conjugate or
// negative bit set (torch.conj's lazy view: its memory holds the values unconjugated, which a raw
// copy would hand the graph; the sweep found dot, vdot and mm of such a view WRONG, H100). The
// caller's Python twin, InputPlan.copy_in, copies then. A CUDA error raises RuntimeError.
using StreamWrite64 = int (*)(void*, uint64_t, uint64_t, unsigned int);

StreamWrite64 find_write64() {
  for (const char* name : {"cuStreamWriteValue64_v2", "cuStreamWriteValue64"}) {
    if (void* f = dlsym(RTLD_DEFAULT, name)) return reinterpret_cast<StreamWrite64>(f);
    if (void* h = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD)) {
      if (void* f = dlsym(h, name)) return reinterpret_cast<StreamWrite64>(f);
    }
  }
  return nullptr;
}

bool number_bits(PyObject* x, uint64_t* out) {
  if (PyFloat_CheckExact(x)) {
    const double d = PyFloat_AS_DOUBLE(x);
    std::memcpy(out, &d, sizeof d);
    return true;
  }
  if (PyLong_CheckExact(x)) {
    int overflow = 0;
    const long long v = PyLong_AsLongLongAndOverflow(x, &overflow);
    if (overflow != 0 || (v == -1 && PyErr_Occurred())) {
      PyErr_Clear();
      return false;
    }
    *out = static_cast<uint64_t>(v);
    return true;
  }
  return false;
}

PyObject* copy_in(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  static MemcpyAsync memcpy_async = reinterpret_cast<MemcpyAsync>(runtime_symbol("cudaMemcpyAsync"));
  static ErrorString error_string = reinterpret_cast<ErrorString>(runtime_symbol("cudaGetErrorString"));
  static StreamWrite64 write64 = find_write64();
  if (nargs != 4 || !(PyList_Check(args[1]) || PyTuple_Check(args[1])) || !PyTuple_Check(args[2]) ||
      !PyTuple_Check(args[3]) || PyTuple_GET_SIZE(args[2]) % 3 != 0 || PyTuple_GET_SIZE(args[3]) % 2 != 0) {
    PyErr_SetString(PyExc_TypeError,
                    "copy_in(stream, leaves: list | tuple, copies: (leaf, dst, nbytes)*, writes: (leaf, dst)*)");
    return nullptr;
  }
  void* stream = PyLong_AsVoidPtr(args[0]);
  if (PyErr_Occurred()) return nullptr;
  PyObject* leaves = args[1];
  PyObject* copies = args[2];
  PyObject* writes = args[3];
  const Py_ssize_t n = PySequence_Fast_GET_SIZE(leaves);
  const Py_ssize_t nc = PyTuple_GET_SIZE(copies) / 3, nw = PyTuple_GET_SIZE(writes) / 2;
  if ((nc && memcpy_async == nullptr) || (nw && write64 == nullptr)) Py_RETURN_FALSE;
  auto leaf = [&](PyObject* index) -> PyObject* {
    const Py_ssize_t i = PyLong_AsSsize_t(index);
    if (i < 0 || i >= n) {
      if (!PyErr_Occurred()) PyErr_SetString(PyExc_IndexError, "copy_in: a leaf index past the call's leaves");
      return nullptr;
    }
    return PySequence_Fast_GET_ITEM(leaves, i);
  };
  c10::SmallVector<void*, 8> srcs;
  c10::SmallVector<uint64_t, 4> bits;
  for (Py_ssize_t k = 0; k < nc; ++k) {
    PyObject* x = leaf(PyTuple_GET_ITEM(copies, 3 * k));
    if (x == nullptr) return nullptr;
    if (!THPVariable_CheckExact(x)) Py_RETURN_FALSE;
    const at::Tensor& t = THPVariable_Unpack(x);
    if (t.is_conj() || t.is_neg()) Py_RETURN_FALSE;  // (its memory reads conjugated or negated: copy_ resolves it)
    srcs.push_back(t.data_ptr());
  }
  for (Py_ssize_t k = 0; k < nw; ++k) {
    PyObject* x = leaf(PyTuple_GET_ITEM(writes, 2 * k));
    if (x == nullptr) return nullptr;
    uint64_t b = 0;
    if (!number_bits(x, &b)) Py_RETURN_FALSE;
    bits.push_back(b);
  }
  for (Py_ssize_t k = 0; k < nc; ++k) {
    void* dst = PyLong_AsVoidPtr(PyTuple_GET_ITEM(copies, 3 * k + 1));
    const size_t nbytes = PyLong_AsSize_t(PyTuple_GET_ITEM(copies, 3 * k + 2));
    if (PyErr_Occurred()) return nullptr;
    const int err = memcpy_async(dst, srcs[k], nbytes, kDeviceToDevice, stream);
    if (err != 0) {
      PyErr_Format(PyExc_RuntimeError, "graphtree: cudaMemcpyAsync of an input failed: %s (%d)",
                   error_string ? error_string(err) : "cudaError", err);
      return nullptr;
    }
  }
  for (Py_ssize_t k = 0; k < nw; ++k) {
    const uint64_t dst = static_cast<uint64_t>(PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(writes, 2 * k + 1)));
    if (PyErr_Occurred()) return nullptr;
    const int err = write64(stream, dst, bits[k], 0);
    if (err != 0) {
      PyErr_Format(PyExc_RuntimeError, "graphtree: cuStreamWriteValue64 of a Python number's value failed (CUDA error %d)", err);
      return nullptr;
    }
  }
  Py_RETURN_TRUE;
}

PyObject* int_tuple(const c10::SmallVector<int64_t, 8>& values) {
  PyObject* out = PyTuple_New(static_cast<Py_ssize_t>(values.size()));
  if (!out) return nullptr;
  for (size_t k = 0; k < values.size(); ++k) {
    PyObject* v = PyLong_FromLongLong(values[k]);
    if (!v) {
      Py_DECREF(out);
      return nullptr;
    }
    PyTuple_SET_ITEM(out, static_cast<Py_ssize_t>(k), v);
  }
  return out;
}

// signature(args, plain_types) -> (parts, device, needs_grad) | None
//
// The recording key of a plain positional call, as graphtree.tree.inputs.read_call builds it:
// for a tensor (shape, dtype, stride), the shape a plain tuple (equal to the torch.Size that the
// Python path puts there, with the same hash, so keys from either path find the same
// recordings); for a value whose exact type is in plain_types, (type(x), x). device is the
// tensors' one CUDA device (-2 without tensors). None when the call needs the Python path:
// another object, a tensor subclass, a CPU tensor or several devices (the Python path names the
// reason), a non-strided or symbolic-shaped tensor.
PyObject* signature(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2 || !PyTuple_Check(args[0]) || !PyTuple_Check(args[1])) {
    PyErr_SetString(PyExc_TypeError, "signature(args: tuple, plain_types: tuple)");
    return nullptr;
  }
  PyObject* call = args[0];
  PyObject* plain = args[1];
  const Py_ssize_t n = PyTuple_GET_SIZE(call);
  const Py_ssize_t nplain = PyTuple_GET_SIZE(plain);
  PyObject* parts = PyTuple_New(n);
  if (!parts) return nullptr;
  long device = -2;
  bool needs_grad = false;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* x = PyTuple_GET_ITEM(call, i);
    PyObject* part = nullptr;
    if (THPVariable_CheckExact(x)) {
      c10::SmallVector<int64_t, 8> sizes, strides;
      at::ScalarType scalar_type;
      long d = -1;
      try {  // a nested or otherwise unusual tensor may throw: the Python path reports it
        const at::Tensor& t = THPVariable_Unpack(x);
        if (t.layout() != c10::kStrided || t.unsafeGetTensorImpl()->has_symbolic_sizes_strides() || t.is_conj() ||
            t.is_neg()) {  // (a lazy view's key part holds its bits: the Python path builds it)
          Py_DECREF(parts);
          Py_RETURN_NONE;
        }
        d = t.is_cuda() ? static_cast<long>(t.get_device()) : -1;
        sizes.assign(t.sizes().begin(), t.sizes().end());
        strides.assign(t.strides().begin(), t.strides().end());
        scalar_type = t.scalar_type();
        needs_grad = needs_grad || t.requires_grad();
      } catch (const std::exception&) {
        Py_DECREF(parts);
        Py_RETURN_NONE;
      }
      if (d < 0 || (device != -2 && d != device)) {
        Py_DECREF(parts);
        Py_RETURN_NONE;
      }
      device = d;
      PyObject* shape = int_tuple(sizes);
      PyObject* stride = int_tuple(strides);
      if (!shape || !stride) {
        Py_XDECREF(shape);
        Py_XDECREF(stride);
        Py_DECREF(parts);
        return nullptr;
      }
      PyObject* dtype = reinterpret_cast<PyObject*>(torch::getTHPDtype(scalar_type));
      Py_INCREF(dtype);
      part = PyTuple_New(3);
      if (!part) {
        Py_DECREF(shape);
        Py_DECREF(stride);
        Py_DECREF(dtype);
        Py_DECREF(parts);
        return nullptr;
      }
      PyTuple_SET_ITEM(part, 0, shape);
      PyTuple_SET_ITEM(part, 1, dtype);
      PyTuple_SET_ITEM(part, 2, stride);
    } else {
      PyObject* tp = reinterpret_cast<PyObject*>(Py_TYPE(x));
      bool is_plain = false;
      for (Py_ssize_t k = 0; k < nplain; ++k) {
        if (PyTuple_GET_ITEM(plain, k) == tp) {
          is_plain = true;
          break;
        }
      }
      if (!is_plain) {
        Py_DECREF(parts);
        Py_RETURN_NONE;
      }
      part = PyTuple_Pack(2, tp, x);
      if (!part) {
        Py_DECREF(parts);
        return nullptr;
      }
    }
    PyTuple_SET_ITEM(parts, i, part);
  }
  return Py_BuildValue("(NlO)", parts, device, needs_grad ? Py_True : Py_False);
}

// object_state(obj, plain_types, opaque_types, room) -> (parts, tensors, device, needs_grad) | None
//
// The key part of an object argument, as graphtree.tree.inputs.read_object builds it for an
// object that is not a module: (type(obj), tuple(out)), out walked as _read_state walks it. tensors
// are the CUDA tensors it holds, in order (read in place); device their one device (-2: none);
// room how many more tensors the call may hold. None where the Python path must decide or name a
// reason: a module, a function or any of opaque_types, a list, tuple or dict subclass, a dict key
// that is not plain, a type with __slots__ or its own attribute lookup, a tensor subclass or
// unusual tensor, several devices, a limit reached. Runs no Python code: borrowed references stay
// valid for the walk.
constexpr Py_ssize_t kMaxItems = 20000;  // graphtree.tree.inputs._MAX_ITEMS
constexpr int kMaxDepth = 6;             // _MAX_DEPTH

struct Walk {
  PyObject* plain;
  PyObject* opaque;
  Py_ssize_t room;
  PyObject* out;      // list
  PyObject* tensors;  // list
  PyObject* seen_tag;  // "seen"
  long device = -2;
  bool needs_grad = false;
  std::unordered_set<PyObject*> seen;
};

enum Step { kFallback = 0, kOk = 1, kError = -1 };

bool type_in(PyObject* types, PyTypeObject* tp) {
  const Py_ssize_t n = PyTuple_GET_SIZE(types);
  for (Py_ssize_t k = 0; k < n; ++k) {
    if (PyTuple_GET_ITEM(types, k) == reinterpret_cast<PyObject*>(tp)) return true;
  }
  return false;
}

Step append_new(PyObject* list, PyObject* item) {  // steals item
  if (!item) return kError;
  const int rc = PyList_Append(list, item);
  Py_DECREF(item);
  return rc < 0 ? kError : kOk;
}

Step tensor_part(Walk& w, PyObject* x) {
  if (!THPVariable_CheckExact(x)) return kFallback;
  c10::SmallVector<int64_t, 8> sizes, strides;
  at::ScalarType scalar_type;
  long d = -1;
  bool grad = false;
  try {
    const at::Tensor& t = THPVariable_Unpack(x);
    if (t.layout() != c10::kStrided || t.is_nested() || t.is_meta() ||
        t.unsafeGetTensorImpl()->has_symbolic_sizes_strides())
      return kFallback;
    if (t.is_cuda()) {
      d = static_cast<long>(t.get_device());
    } else if (!t.is_cpu()) {
      return kFallback;
    }
    sizes.assign(t.sizes().begin(), t.sizes().end());
    strides.assign(t.strides().begin(), t.strides().end());
    scalar_type = t.scalar_type();
    grad = t.requires_grad();
  } catch (const std::exception&) {
    return kFallback;
  }
  if (d >= 0) {
    if ((w.device != -2 && d != w.device) || PyList_GET_SIZE(w.tensors) >= w.room) return kFallback;
    w.device = d;
    w.needs_grad = w.needs_grad || grad;
    if (PyList_Append(w.tensors, x) < 0) return kError;
  }
  PyObject* shape = int_tuple(sizes);
  PyObject* stride = int_tuple(strides);
  if (!shape || !stride) {
    Py_XDECREF(shape);
    Py_XDECREF(stride);
    return kError;
  }
  PyObject* dtype = reinterpret_cast<PyObject*>(torch::getTHPDtype(scalar_type));
  return append_new(w.out, Py_BuildValue("(NONl)", shape, dtype, stride, d));
}

// Whether obj's attributes are its instance __dict__ and nothing else: the generic attribute
// lookup, a __dict__ slot, and no __slots__ along the MRO but empty ones (abc.ABC's).
bool plain_attributes(PyTypeObject* tp) {
  if (tp->tp_getattro != PyObject_GenericGetAttr || tp->tp_dictoffset == 0) return false;
  PyObject* mro = tp->tp_mro;
  if (!mro || !PyTuple_Check(mro)) return false;
  for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(mro); ++k) {
    PyTypeObject* cls = reinterpret_cast<PyTypeObject*>(PyTuple_GET_ITEM(mro, k));
    if (cls == &PyBaseObject_Type) continue;
#if PY_VERSION_HEX >= 0x030C0000
    PyObject* dict = PyType_GetDict(cls);  // new reference
#else
    PyObject* dict = cls->tp_dict;
    Py_XINCREF(dict);
#endif
    if (!dict) return false;
    PyObject* slots = PyDict_GetItemString(dict, "__slots__");  // borrowed
    bool ok = true;
    if (slots) {
      if (!PyTuple_Check(slots) && !PyList_Check(slots)) {
        ok = false;
      } else {
        PyObject* seq = slots;
        const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
        for (Py_ssize_t i = 0; i < n && ok; ++i) {
          PyObject* name = PySequence_Fast_GET_ITEM(seq, i);
          ok = PyUnicode_Check(name) && (PyUnicode_CompareWithASCIIString(name, "__dict__") == 0 ||
                                         PyUnicode_CompareWithASCIIString(name, "__weakref__") == 0);
        }
      }
    }
    Py_DECREF(dict);
    if (!ok) return false;
  }
  return true;
}

Step walk(Walk& w, PyObject* x, int depth);

// One child as the loop of _read_state reads it: a plain value, or a walk (a tensor included).
Step child(Walk& w, PyObject* v, int depth) {
  PyTypeObject* tp = Py_TYPE(v);
  if (type_in(w.plain, tp)) return append_new(w.out, PyTuple_Pack(2, reinterpret_cast<PyObject*>(tp), v));
  return walk(w, v, depth);
}

Step walk(Walk& w, PyObject* x, int depth) {
  if (PyList_GET_SIZE(w.out) > kMaxItems) return kFallback;
  PyTypeObject* tp = Py_TYPE(x);
  if (THPVariable_Check(x)) return tensor_part(w, x);
  if (type_in(w.plain, tp)) return append_new(w.out, PyTuple_Pack(2, reinterpret_cast<PyObject*>(tp), x));
  if (w.seen.count(x)) return append_new(w.out, PyTuple_Pack(2, w.seen_tag, reinterpret_cast<PyObject*>(tp)));
  if (depth >= kMaxDepth) return kFallback;
  for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(w.opaque); ++k) {
    if (PyType_IsSubtype(tp, reinterpret_cast<PyTypeObject*>(PyTuple_GET_ITEM(w.opaque, k)))) return kFallback;
  }
  w.seen.insert(x);
  Step st = kOk;
  if (tp == &PyList_Type || tp == &PyTuple_Type) {
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(x);
    if (append_new(w.out, Py_BuildValue("(On)", reinterpret_cast<PyObject*>(tp), n)) != kOk) return kError;
    for (Py_ssize_t i = 0; i < n && st == kOk; ++i) st = child(w, PySequence_Fast_GET_ITEM(x, i), depth + 1);
  } else if (tp == &PyDict_Type) {
    if (append_new(w.out, Py_BuildValue("(On)", reinterpret_cast<PyObject*>(&PyDict_Type), PyDict_GET_SIZE(x))) != kOk)
      return kError;
    Py_ssize_t pos = 0;
    PyObject *k, *v;
    while (PyDict_Next(x, &pos, &k, &v)) {
      if (!type_in(w.plain, Py_TYPE(k))) return kFallback;
    }
    pos = 0;
    while (st == kOk && PyDict_Next(x, &pos, &k, &v)) {
      if (PyList_Append(w.out, k) < 0) return kError;
      st = child(w, v, depth + 1);
    }
  } else {
    // a list, tuple or dict subclass (a namedtuple, an OrderedDict) is read as a container by the
    // Python path, through its own iteration: left to it
    if (PyList_Check(x) || PyTuple_Check(x) || PyDict_Check(x) || !plain_attributes(tp)) return kFallback;
    PyObject* dict = PyObject_GenericGetDict(x, nullptr);  // new reference
    if (!dict) return kError;
    if (!PyDict_CheckExact(dict)) {
      Py_DECREF(dict);
      return kFallback;
    }
    if (PyList_Append(w.out, reinterpret_cast<PyObject*>(tp)) < 0) {
      Py_DECREF(dict);
      return kError;
    }
    Py_ssize_t pos = 0;
    PyObject *k, *v;
    while (st == kOk && PyDict_Next(dict, &pos, &k, &v)) {
      if (PyList_Append(w.out, k) < 0) {
        st = kError;
        break;
      }
      st = child(w, v, depth + 1);
    }
    Py_DECREF(dict);
  }
  if (st == kOk && PyList_GET_SIZE(w.out) > kMaxItems) return kFallback;
  return st;
}

PyObject* object_state(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 4 || !PyTuple_Check(args[1]) || !PyTuple_Check(args[2]) || !PyLong_Check(args[3])) {
    PyErr_SetString(PyExc_TypeError, "object_state(obj, plain_types: tuple, opaque_types: tuple, room: int)");
    return nullptr;
  }
  static PyObject* seen_tag = PyUnicode_InternFromString("seen");
  if (!seen_tag) return nullptr;
  Walk w{args[1], args[2], PyLong_AsSsize_t(args[3]), PyList_New(0), PyList_New(0), seen_tag};
  if (!w.out || !w.tensors) {
    Py_XDECREF(w.out);
    Py_XDECREF(w.tensors);
    return nullptr;
  }
  PyObject* x = args[0];
  Step st = (THPVariable_Check(x) || type_in(w.plain, Py_TYPE(x))) ? kFallback : walk(w, x, 0);
  if (st != kOk) {
    Py_DECREF(w.out);
    Py_DECREF(w.tensors);
    if (st == kError) return nullptr;
    Py_RETURN_NONE;
  }
  PyObject* parts = PyList_AsTuple(w.out);
  Py_DECREF(w.out);
  if (!parts) {
    Py_DECREF(w.tensors);
    return nullptr;
  }
  PyObject* key = PyTuple_Pack(2, reinterpret_cast<PyObject*>(Py_TYPE(x)), parts);
  Py_DECREF(parts);
  if (!key) {
    Py_DECREF(w.tensors);
    return nullptr;
  }
  return Py_BuildValue("(NNlO)", key, w.tensors, w.device, w.needs_grad ? Py_True : Py_False);
}

// The int64 cells of a buffer object (a memoryview cast to "q", an array("q")), held while in
// scope. get() fails with the buffer protocol's error (a released memoryview: ValueError) or a
// TypeError for anything that is not writable, C-contiguous and of 8-byte integers.
class Int64Cells {
 public:
  ~Int64Cells() {
    if (held_) PyBuffer_Release(&view_);
  }
  bool get(PyObject* obj, const char* what) {
    if (PyObject_GetBuffer(obj, &view_, PyBUF_WRITABLE | PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) != 0) return false;
    held_ = true;
    const char* f = view_.format;
    const size_t n = f ? std::strlen(f) : 0;
    if (view_.itemsize != 8 || n == 0 || (f[n - 1] != 'q' && f[n - 1] != 'l')) {
      PyErr_Format(PyExc_TypeError, "%s: expected a writable buffer of int64 cells", what);
      return false;
    }
    return true;
  }
  int64_t* data() const { return static_cast<int64_t*>(view_.buf); }
  Py_ssize_t size() const { return view_.len / 8; }

 private:
  Py_buffer view_{};
  bool held_ = false;
};

int64_t load(const int64_t* cell) { return __atomic_load_n(cell, __ATOMIC_ACQUIRE); }
void store(int64_t* cell, int64_t v) { __atomic_store_n(cell, v, __ATOMIC_RELEASE); }

// A graphtree.share producer's state: one int64 array (graphtree.share.channel's _VERSION,
// _NEWEST, _WRITING, then the version last committed in each slot).
constexpr Py_ssize_t kVersion = 0, kNewest = 1, kWriting = 2, kWritten = 3;

// The cells and state of a channel, checked: plans holds, for each newest slot k = -1..n-1, the
// same number of int64 quintuples (slot, reading, ready, version, pending: cell numbers) in the
// order to try (slot -1: none, padding); publishing holds (version, latest) cell numbers per slot. false with a Python
// error set when anything does not fit.
struct ChannelState {
  Int64Cells cells, state;
  int64_t* c = nullptr;
  int64_t* st = nullptr;
  Py_ssize_t slots = 0;

  bool get(PyObject* cells_obj, PyObject* state_obj, const char* what) {
    if (!cells.get(cells_obj, what) || !state.get(state_obj, what)) return false;
    slots = state.size() - kWritten;
    if (slots < 1) {
      PyErr_Format(PyExc_ValueError, "%s: the state holds no slot", what);
      return false;
    }
    c = cells.data();
    st = state.data();
    return true;
  }
  bool cell_ok(int64_t i) const { return i >= 0 && i < cells.size(); }
};

// graphtree.share's Channel._take on a checked state: the first slot in plan k = newest that no
// consumer reads and whose ready cell has reached the version last committed in it is marked
// (version cell -1), and, after a full fence, taken if still no consumer reads it (a consumer sets
// its bit, fences, then checks the version cell: of the two, one sees the other's store); its
// pending cell is then set to the next version and the state records it as being written. The
// slot; -1 when none can be taken now; -2 when one is being written already; -3 with a Python
// error set on a bad plan.
int64_t take_slot(ChannelState& ch, PyObject* plans, const char* what) {
  if (!PyBytes_Check(plans)) {
    PyErr_Format(PyExc_TypeError, "%s: plans must be bytes", what);
    return -3;
  }
  int64_t* c = ch.c;
  int64_t* st = ch.st;
  if (st[kWriting] >= 0) return -2;
  const Py_ssize_t per = PyBytes_GET_SIZE(plans) / (ch.slots + 1);
  if (PyBytes_GET_SIZE(plans) % ((ch.slots + 1) * 40) != 0 || per == 0) {
    PyErr_Format(PyExc_ValueError, "%s: plans must be int64 quintuples, as many for each newest slot", what);
    return -3;
  }
  const int64_t newest = st[kNewest];
  if (newest < -1 || newest >= ch.slots) {
    PyErr_Format(PyExc_IndexError, "%s: newest slot out of range", what);
    return -3;
  }
  const char* plan = PyBytes_AS_STRING(plans) + (newest + 1) * per;
  for (Py_ssize_t k = 0; k < per / 40; ++k) {
    int64_t q[5];
    std::memcpy(q, plan + k * 40, sizeof(q));
    const int64_t slot = q[0], reading = q[1], ready = q[2], ver = q[3], pending = q[4];
    if (slot == -1) continue;  // padding
    if (slot < 0 || slot >= ch.slots) {
      PyErr_Format(PyExc_IndexError, "%s: slot out of range", what);
      return -3;
    }
    for (int i = 1; i < 5; ++i) {
      if (!ch.cell_ok(q[i])) {
        PyErr_Format(PyExc_IndexError, "%s: cell out of range", what);
        return -3;
      }
    }
    if (load(c + reading) != 0 || load(c + ready) < st[kWritten + slot]) continue;
    const int64_t before = load(c + ver);
    store(c + ver, -1);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);
    if (load(c + reading) != 0) {  // a consumer claimed it meanwhile: it keeps it
      store(c + ver, before);
      continue;
    }
    store(c + pending, st[kVersion] + 1);
    st[kWriting] = slot;
    return slot;
  }
  return -1;
}

// graphtree.share's Channel._publish on a checked state: the slot being written becomes the newest
// version; stores in order: the state's record of the slot, the slot's version cell, the channel's
// latest cell (a consumer reads latest, then looks for the slot). The version; -1 when no slot is
// being written; -3 with a Python error set on a bad table.
int64_t publish_slot(ChannelState& ch, PyObject* publishing, const char* what) {
  if (!PyBytes_Check(publishing) || PyBytes_GET_SIZE(publishing) != ch.slots * 16) {
    PyErr_Format(PyExc_ValueError, "%s: publishing must be bytes of an int64 pair per slot", what);
    return -3;
  }
  int64_t* st = ch.st;
  const int64_t s = st[kWriting];
  if (s < 0) return -1;
  if (s >= ch.slots) {
    PyErr_Format(PyExc_IndexError, "%s: slot out of range", what);
    return -3;
  }
  int64_t cell[2];
  std::memcpy(cell, PyBytes_AS_STRING(publishing) + s * 16, sizeof(cell));
  if (!ch.cell_ok(cell[0]) || !ch.cell_ok(cell[1])) {
    PyErr_Format(PyExc_IndexError, "%s: cell out of range", what);
    return -3;
  }
  const int64_t v = st[kVersion] + 1;
  st[kWritten + s] = v;
  store(ch.c + cell[0], v);
  store(ch.c + cell[1], v);
  st[kVersion] = v;
  st[kNewest] = s;
  st[kWriting] = -1;
  return v;
}

// channel_take(cells, state, plans) -> int: take_slot (-1: none now, -2: one being written already).
PyObject* channel_take(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 3) {
    PyErr_SetString(PyExc_TypeError, "channel_take(cells, state, plans)");
    return nullptr;
  }
  ChannelState ch;
  if (!ch.get(args[0], args[1], "channel_take")) return nullptr;
  const int64_t s = take_slot(ch, args[2], "channel_take");
  return s == -3 ? nullptr : PyLong_FromLongLong(s);
}

// channel_publish(cells, state, publishing) -> int: publish_slot (-1: no slot being written).
PyObject* channel_publish(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 3) {
    PyErr_SetString(PyExc_TypeError, "channel_publish(cells, state, publishing)");
    return nullptr;
  }
  ChannelState ch;
  if (!ch.get(args[0], args[1], "channel_publish")) return nullptr;
  const int64_t v = publish_slot(ch, args[2], "channel_publish");
  return v == -3 ? nullptr : PyLong_FromLongLong(v);
}

// channel_write(writer, args, kwargs) -> result: graphtree.share's GraphedWriter call in one C
// call: take a slot, call writer's function with out= the slot's buffer, publish the version.
// writer is the tuple (cells, state, plans, publishing, buffers, call, out, again); kwargs a dict
// (it gets the out= item). Returns `again` where the Python path must decide (kwargs hold out=
// already, no slot free now, a slot being written): it raises, or waits for a slot. A call that
// raises leaves no slot being written and publishes nothing. The cells are not held during the
// call (it may close the channel: the publish then raises the released view's ValueError).
PyObject* channel_write(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 3 || !PyTuple_Check(args[0]) || PyTuple_GET_SIZE(args[0]) != 8 || !PyTuple_Check(args[1]) ||
      !PyDict_Check(args[2])) {
    PyErr_SetString(PyExc_TypeError, "channel_write(writer: tuple of 8, args: tuple, kwargs: dict)");
    return nullptr;
  }
  PyObject* const* w = &PyTuple_GET_ITEM(args[0], 0);
  PyObject *buffers = w[4], *call = w[5], *out = w[6], *again = w[7];
  if (!PyTuple_Check(buffers)) {
    PyErr_SetString(PyExc_TypeError, "channel_write: buffers must be a tuple");
    return nullptr;
  }
  const int has_out = PyDict_Contains(args[2], out);
  if (has_out < 0) return nullptr;
  if (has_out) return Py_NewRef(again);
  int64_t s;
  {
    ChannelState ch;
    if (!ch.get(w[0], w[1], "channel_write")) return nullptr;
    if (PyTuple_GET_SIZE(buffers) != ch.slots) {
      PyErr_SetString(PyExc_ValueError, "channel_write: a buffer per slot");
      return nullptr;
    }
    s = take_slot(ch, w[2], "channel_write");
    if (s == -3) return nullptr;
    if (s < 0) return Py_NewRef(again);
  }
  PyObject* result = nullptr;
  if (PyDict_SetItem(args[2], out, PyTuple_GET_ITEM(buffers, s)) == 0) result = PyObject_Call(call, args[1], args[2]);
  if (result == nullptr) {  // give the slot up: nothing published
    PyObject *type, *value, *trace;
    PyErr_Fetch(&type, &value, &trace);
    Int64Cells state;
    if (state.get(w[1], "channel_write") && state.size() > kWriting) state.data()[kWriting] = -1;
    PyErr_Clear();
    PyErr_Restore(type, value, trace);
    return nullptr;
  }
  ChannelState ch;
  if (!ch.get(w[0], w[1], "channel_write") || publish_slot(ch, w[3], "channel_write") < 0) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "channel_write: the slot taken was given up");
    Py_DECREF(result);
    return nullptr;
  }
  return result;
}

// ambient() -> (bits, default dtype, autocast dtype | None): the state a call computes under
// without being passed it, packed as graphtree/tree/ambient.py's _python_state packs it (that
// module's BITS names each bit; _native._check compares the two before this one is used).
PyObject* ambient(PyObject*, PyObject* const*, Py_ssize_t) {
  try {
    auto& ctx = at::globalContext();
    const bool cast = at::autocast::is_autocast_enabled(at::kCUDA);
    const bool flags[] = {
        ctx.deterministicAlgorithms(),      ctx.deterministicFillUninitializedMemory(),
        ctx.userEnabledCuDNN(),             ctx.benchmarkCuDNN(),
        ctx.deterministicCuDNN(),           ctx.allowTF32CuDNN(),
        ctx.allowTF32CuBLAS(),              ctx.allowFP16AccumulationCuBLAS(),
        ctx.userEnabledFlashSDP(),          ctx.userEnabledMemEfficientSDP(),
        ctx.userEnabledMathSDP(),           ctx.userEnabledCuDNNSDP(),
        ctx.allowFP16BF16ReductionMathSDP(),
    };
    int64_t bits = int64_t(at::GradMode::is_enabled()) | int64_t(c10::InferenceMode::is_enabled()) << 1 |
                   int64_t(cast) << 2;
    int shift = 3;
    for (bool f : flags) {
      bits |= int64_t(f) << shift++;
    }
    bits |= int64_t(ctx.float32MatmulPrecision()) << 16 | int64_t(ctx.allowFP16ReductionCuBLAS()) << 18 |
            int64_t(ctx.allowBF16ReductionCuBLAS()) << 20 | int64_t(ctx.blasPreferredBackend()) << 22;
    PyObject* dtype = reinterpret_cast<PyObject*>(torch::getTHPDtype(c10::get_default_dtype_as_scalartype()));
    PyObject* cast_dtype =
        cast ? reinterpret_cast<PyObject*>(torch::getTHPDtype(at::autocast::get_autocast_dtype(at::kCUDA))) : Py_None;
    PyObject* n = PyLong_FromLongLong(bits);
    if (n == nullptr) {
      return nullptr;
    }
    Py_INCREF(dtype);
    Py_INCREF(cast_dtype);
    PyObject* out = PyTuple_New(3);
    if (out == nullptr) {
      Py_DECREF(n);
      Py_DECREF(dtype);
      Py_DECREF(cast_dtype);
      return nullptr;
    }
    PyTuple_SET_ITEM(out, 0, n);
    PyTuple_SET_ITEM(out, 1, dtype);
    PyTuple_SET_ITEM(out, 2, cast_dtype);
    return out;
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}

#ifdef GRAPHTREE_CUDA
// body() with its C++ exceptions raised as Python ones: pybind11's (a cast that failed) as TypeError,
// any other as RuntimeError with its message.
template <typename Body>
PyObject* raising(Body&& body) {
  try {
    return body();
  } catch (const pybind11::error_already_set& e) {
    PyErr_SetString(PyExc_TypeError, e.what());
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  }
  return nullptr;
}

// capture_begin_isolated(graph, pool, standin) -> None: graph.capture_begin(pool, thread-local mode)
// with the device's default CUDA generator kept out of the capture (torch < 2.12).
//
// capture_begin registers the default generator's state with the graph and puts it in capture mode;
// that state is the whole process's, so while one thread captured, a random op of any other thread
// failed ("Offset increment outside graph capture encountered unexpectedly"). Here the default
// generator holds the stand-in's state while capture_begin registers it, and its own state again right
// after, all under the generator's mutex (random ops of other threads take it, so none draws in
// between) and without the GIL (so a thread that holds the GIL while it waits for the mutex, as
// torch.manual_seed does, cannot deadlock with this one). The capture's own random ops then draw from
// the stand-in (graphtree passes it as their generator), and each replay hands the stand-in the
// default generator's seed and offset first (replay_drawing, below).
PyObject* capture_begin_isolated(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 3) {
    PyErr_SetString(PyExc_TypeError, "capture_begin_isolated(graph, pool, standin) takes 3 arguments");
    return nullptr;
  }
  return raising([&]() -> PyObject* {
    auto& graph = pybind11::handle(args[0]).cast<at::cuda::CUDAGraph&>();
    auto pool = pybind11::handle(args[1]).cast<std::pair<unsigned long long, unsigned long long>>();
    at::Generator standin = reinterpret_cast<THPGenerator*>(args[2])->cdata;
    at::Generator gen = at::cuda::detail::getDefaultCUDAGenerator();
    {
      pybind11::gil_scoped_release no_gil;
      std::lock_guard<std::mutex> lock(gen.mutex());
      at::Generator own = gen.graphsafe_get_state();
      gen.graphsafe_set_state(standin);
      try {
        graph.capture_begin(pool, cudaStreamCaptureModeThreadLocal);
      } catch (...) {
        gen.graphsafe_set_state(own);
        throw;
      }
      gen.graphsafe_set_state(own);
    }
    Py_RETURN_NONE;
  });
}

// replay_drawing(graph, pairs) -> int: replay a graph whose random operations drew, in its capture,
// from stand-in generators (pairs: ((stand-in, generator), ...)), so that it draws what eager draws.
//
// Under each generator's mutex (random ops of other threads take it, so none draws in between), each
// stand-in takes its generator's seed and offset, the graph replays (torch's replay prologue writes
// the stand-ins' seed and offset into the graph and advances them by what the capture drew), and
// each generator's offset moves to its stand-in's: the replay drew the numbers an eager call would
// have drawn at that point of the generator's sequence, and the generator is where eager leaves it.
// The GIL is released first (a thread holding it while it waits for a mutex, as torch.manual_seed
// does, cannot deadlock with this one); Python dispatch is off around the replay (the prologue's
// fills must not reach a dispatch mode, whose Python could wait for a mutex held here). Returns how
// far each generator advanced (the capture's whole-graph increments): all 0 means the graph draws
// nothing, and needs none of this; else later replays go through launch_drawing, which knows them.
PyObject* replay_drawing(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2 || !PyTuple_Check(args[1])) {
    PyErr_SetString(PyExc_TypeError, "replay_drawing(graph, pairs: tuple) takes 2 arguments");
    return nullptr;
  }
  return raising([&]() -> PyObject* {
    auto& graph = pybind11::handle(args[0]).cast<at::cuda::CUDAGraph&>();
    c10::SmallVector<std::pair<at::CUDAGeneratorImpl*, at::CUDAGeneratorImpl*>, 4> gens;
    c10::SmallVector<std::mutex*, 4> locks;
    c10::SmallVector<at::Generator, 8> held;  // keeps the generators alive while the GIL is released
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(args[1]); ++i) {
      PyObject* pair = PyTuple_GET_ITEM(args[1], i);
      if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2 || !THPGenerator_Check(PyTuple_GET_ITEM(pair, 0)) ||
          !THPGenerator_Check(PyTuple_GET_ITEM(pair, 1))) {
        PyErr_SetString(PyExc_TypeError, "replay_drawing: pairs must be (stand-in, generator) tuples");
        return nullptr;
      }
      at::Generator standin = reinterpret_cast<THPGenerator*>(PyTuple_GET_ITEM(pair, 0))->cdata;
      at::Generator gen = reinterpret_cast<THPGenerator*>(PyTuple_GET_ITEM(pair, 1))->cdata;
      gens.emplace_back(at::check_generator<at::CUDAGeneratorImpl>(standin),
                        at::check_generator<at::CUDAGeneratorImpl>(gen));
      locks.push_back(&gen.mutex());
      held.push_back(std::move(standin));
      held.push_back(std::move(gen));
    }
    std::sort(locks.begin(), locks.end());  // one order for every thread: no deadlock between two replays
    locks.erase(std::unique(locks.begin(), locks.end()), locks.end());
    c10::SmallVector<uint64_t, 4> drawn;
    {
      pybind11::gil_scoped_release no_gil;
      for (auto* m : locks) {
        m->lock();
      }
      try {
        c10::SmallVector<uint64_t, 4> start;
        for (auto& [standin, gen] : gens) {
          start.push_back(gen->philox_offset_per_thread());
          standin->set_current_seed(gen->current_seed());
          standin->set_philox_offset_per_thread(start.back());
        }
        {
          c10::impl::ExcludeDispatchKeyGuard no_python(
              c10::DispatchKeySet({c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot}));
          graph.replay();
        }
        for (size_t i = 0; i < gens.size(); ++i) {
          uint64_t end = gens[i].first->philox_offset_per_thread();
          gens[i].second->set_philox_offset_per_thread(end);
          drawn.push_back(end - start[i]);
        }
      } catch (...) {
        for (auto* m : locks) {
          m->unlock();
        }
        throw;
      }
      for (auto* m : locks) {
        m->unlock();
      }
    }
    PyObject* out = PyTuple_New(static_cast<Py_ssize_t>(drawn.size()));
    if (!out) return nullptr;
    for (size_t k = 0; k < drawn.size(); ++k) {
      PyTuple_SET_ITEM(out, static_cast<Py_ssize_t>(k), PyLong_FromUnsignedLongLong(drawn[k]));
    }
    return out;
  });
}

// standin_slots(standin) -> (seed address, offset address): where the kernels a capture draws from
// the stand-in read their seed and offset on the device (the state's graph-safe slots, which torch's
// replay prologue fills). Call it on the capturing stream while the capture runs.
PyObject* standin_slots(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 1 || !THPGenerator_Check(args[0])) {
    PyErr_SetString(PyExc_TypeError, "standin_slots(standin: torch.Generator) takes 1 argument");
    return nullptr;
  }
  return raising([&]() -> PyObject* {
    at::Generator gen = reinterpret_cast<THPGenerator*>(args[0])->cdata;
    auto* impl = at::check_generator<at::CUDAGeneratorImpl>(gen);
    at::PhiloxCudaState state;
    {
      std::lock_guard<std::mutex> lock(gen.mutex());
      state = impl->philox_cuda_state(0);
    }
    if (!state.captured_) {
      PyErr_SetString(PyExc_RuntimeError, "standin_slots: the stand-in is not being captured");
      return nullptr;
    }
    return Py_BuildValue("(KK)", reinterpret_cast<unsigned long long>(state.seed_.ptr),
                         reinterpret_cast<unsigned long long>(state.offset_.ptr));
  });
}

// standin_seal(standin) -> int: capture, as the last work of the capture under way, an add that moves
// the stand-in's offset slot on by what the capture drew (its whole-graph increment, returned). Each
// replay then leaves the slot where the generator is after it (launch_drawing advances the generator by
// as much), so that the next replay needs no write unless something else drew in between. Call it on
// the capturing stream, after the side streams are joined and right before capture_end. The add runs
// past Python dispatch: a dispatch mode watching the capture must not take it for the caller's write.
PyObject* standin_seal(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 1 || !THPGenerator_Check(args[0])) {
    PyErr_SetString(PyExc_TypeError, "standin_seal(standin: torch.Generator) takes 1 argument");
    return nullptr;
  }
  return raising([&]() -> PyObject* {
    at::Generator gen = reinterpret_cast<THPGenerator*>(args[0])->cdata;
    auto* impl = at::check_generator<at::CUDAGeneratorImpl>(gen);
    at::PhiloxCudaState state;
    {
      std::lock_guard<std::mutex> lock(gen.mutex());
      state = impl->philox_cuda_state(0);
    }
    if (!state.captured_) {
      PyErr_SetString(PyExc_RuntimeError, "standin_seal: the stand-in is not being captured");
      return nullptr;
    }
    const auto drawn = static_cast<int64_t>(state.offset_intragraph_);
    if (drawn > 0) {
      c10::impl::ExcludeDispatchKeyGuard no_python(
          c10::DispatchKeySet({c10::DispatchKey::Python, c10::DispatchKey::PythonTLSSnapshot}));
      auto options = at::TensorOptions().dtype(at::kLong).device(at::Device(at::kCUDA, impl->device().index()));
      at::from_blob(state.offset_.ptr, {1}, options).add_(drawn);
    }
    return PyLong_FromLongLong(drawn);
  });
}

// A graph that draws, ready to launch with its generators' seeds and offsets written to its slots:
// what replay_drawing does, without torch's replay prologue, whose two fill_ kernels per generator
// cost about 20 us of CPU a call on the H100 host (torch 2.11). The capsule holds no reference to the
// graph (the graph holds the capsule): whoever launches it holds the graph.
struct DrawingLaunch {
  struct Slot {
    at::Generator gen;
    int64_t* seed;
    int64_t* offset;
    uint64_t increment;
  };
  cudaGraphExec_t exec;
  c10::DeviceIndex device;
  c10::SmallVector<Slot, 2> slots;
  c10::SmallVector<std::mutex*, 2> locks;
  bool sealed = false;  // each replay moves its offset slots on itself (standin_seal)
  uint64_t seed_written[2] = {0, 0};
  bool seed_known[2] = {false, false};
  uint64_t offset_in_slot[2] = {0, 0};  // sealed: the offset a slot holds once the last launch has run
  bool offset_known[2] = {false, false};
};

using GraphLaunch = int (*)(cudaGraphExec_t, cudaStream_t);
using WriteValue64 = int (*)(cudaStream_t, uint64_t, uint64_t, unsigned int);
using MemcpyAsyncT = int (*)(void*, const void*, size_t, int, cudaStream_t);

void* driver_symbol(const char* name) {
  if (void* f = dlsym(RTLD_DEFAULT, name)) return f;
  if (void* h = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD)) return dlsym(h, name);
  return nullptr;
}

WriteValue64 stream_write64() {
  void* f = driver_symbol("cuStreamWriteValue64_v2");
  return reinterpret_cast<WriteValue64>(f ? f : driver_symbol("cuStreamWriteValue64"));
}

// drawing_writes() -> str: how launch_drawing writes the seeds and offsets (for the benchmarks' notes).
PyObject* drawing_writes(PyObject*, PyObject* const*, Py_ssize_t) {
  return PyUnicode_FromString(stream_write64() ? "cuStreamWriteValue64" : "cudaMemcpyAsync (pageable, staged)");
}

void drawing_launch_free(PyObject* capsule) {
  delete static_cast<DrawingLaunch*>(PyCapsule_GetPointer(capsule, "graphtree.DrawingLaunch"));
}

// prepare_drawing(graph, pairs, slots, increments, sealed) -> capsule for launch_drawing; at most 2
// pairs. sealed: the graph was captured with standin_seal (its replays move their offset slots on).
PyObject* prepare_drawing(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 5 || !PyTuple_Check(args[1]) || !PyTuple_Check(args[2]) || !PyTuple_Check(args[3]) ||
      PyTuple_GET_SIZE(args[1]) != PyTuple_GET_SIZE(args[2]) || PyTuple_GET_SIZE(args[1]) != PyTuple_GET_SIZE(args[3]) ||
      PyTuple_GET_SIZE(args[1]) > 2) {
    PyErr_SetString(PyExc_TypeError,
                    "prepare_drawing(graph, pairs, slots, increments, sealed): tuples of one length, at most 2");
    return nullptr;
  }
  return raising([&]() -> PyObject* {
    auto& graph = pybind11::handle(args[0]).cast<at::cuda::CUDAGraph&>();
    auto launch = std::make_unique<DrawingLaunch>();
    launch->exec = graph.raw_cuda_graph_exec();
    launch->sealed = PyObject_IsTrue(args[4]) == 1;
    launch->device = c10::cuda::current_device();
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(args[1]); ++i) {
      PyObject* pair = PyTuple_GET_ITEM(args[1], i);
      PyObject* slot = PyTuple_GET_ITEM(args[2], i);
      at::Generator gen = reinterpret_cast<THPGenerator*>(PyTuple_GET_ITEM(pair, 1))->cdata;
      launch->device = gen.device().has_index() ? gen.device().index() : launch->device;
      launch->locks.push_back(&gen.mutex());
      launch->slots.push_back({gen, reinterpret_cast<int64_t*>(PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(slot, 0))),
                               reinterpret_cast<int64_t*>(PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(slot, 1))),
                               PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(args[3], i))});
    }
    if (PyErr_Occurred()) return nullptr;
    std::sort(launch->locks.begin(), launch->locks.end());
    launch->locks.erase(std::unique(launch->locks.begin(), launch->locks.end()), launch->locks.end());
    return PyCapsule_New(launch.release(), "graphtree.DrawingLaunch", drawing_launch_free);
  });
}

// launch_drawing(capsule) -> None: under the generators' mutexes, read each generator's seed and
// offset and advance it by the graph's increment (as an eager call's draws would); then, on the
// current stream, write them into the graph's slots (cuStreamWriteValue64: no kernel) and launch.
// A slot that already holds the value is not written: a seed seldom changes, and a sealed graph's
// last replay left its offset slots where the generators are unless something else drew since.
PyObject* launch_drawing(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  static GraphLaunch graph_launch = reinterpret_cast<GraphLaunch>(runtime_symbol("cudaGraphLaunch"));
  static WriteValue64 write64 = stream_write64();
  static MemcpyAsyncT memcpy_async = reinterpret_cast<MemcpyAsyncT>(runtime_symbol("cudaMemcpyAsync"));
  auto* d = nargs == 1 ? static_cast<DrawingLaunch*>(PyCapsule_GetPointer(args[0], "graphtree.DrawingLaunch")) : nullptr;
  if (d == nullptr || graph_launch == nullptr || memcpy_async == nullptr) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "launch_drawing(capsule): no capsule, or no CUDA runtime");
    return nullptr;
  }
  return raising([&]() -> PyObject* {
    c10::cuda::CUDAGuard guard(d->device);
    cudaStream_t stream = c10::cuda::getCurrentCUDAStream(d->device).stream();
    uint64_t seed[2], offset[2];
    for (auto* m : d->locks) m->lock();
    try {
      for (size_t i = 0; i < d->slots.size(); ++i) {
        auto* impl = at::check_generator<at::CUDAGeneratorImpl>(d->slots[i].gen);
        seed[i] = impl->current_seed();
        offset[i] = impl->philox_offset_per_thread();
        impl->set_philox_offset_per_thread(offset[i] + d->slots[i].increment);
      }
    } catch (...) {
      for (auto* m : d->locks) m->unlock();
      throw;
    }
    for (auto* m : d->locks) m->unlock();
    auto forget = [d]() {  // after a failure, the slots' values are unknown: the next launch writes them
      for (size_t i = 0; i < 2; ++i) d->seed_known[i] = d->offset_known[i] = false;
    };
    for (size_t i = 0; i < d->slots.size(); ++i) {
      auto& slot = d->slots[i];
      int err = 0;
      if (!d->seed_known[i] || d->seed_written[i] != seed[i]) {  // (a new seed: rarely)
        err = write64 ? write64(stream, reinterpret_cast<uint64_t>(slot.seed), seed[i], 0)
                      : memcpy_async(slot.seed, &seed[i], 8, 1 /* host to device, pageable: staged */, stream);
        d->seed_written[i] = seed[i];
        d->seed_known[i] = true;
      }
      if (err == 0 && !(d->sealed && d->offset_known[i] && d->offset_in_slot[i] == offset[i])) {
        err = write64 ? write64(stream, reinterpret_cast<uint64_t>(slot.offset), offset[i], 0)
                      : memcpy_async(slot.offset, &offset[i], 8, 1, stream);
      }
      d->offset_in_slot[i] = offset[i] + slot.increment;  // (the replay's own add moves it there)
      d->offset_known[i] = d->sealed;
      if (err != 0) {
        forget();
        PyErr_Format(PyExc_RuntimeError, "graphtree: writing a generator's offset for a replay failed (CUDA error %d)", err);
        return nullptr;
      }
    }
    const int err = graph_launch(d->exec, stream);
    if (err != 0) {
      forget();
      PyErr_Format(PyExc_RuntimeError, "graphtree: cudaGraphLaunch failed (CUDA error %d)", err);
      return nullptr;
    }
    Py_RETURN_NONE;
  });
}
#endif

}  // namespace

namespace graphtree_native {
PyObject* fast_replay(PyObject*, PyObject* const* args, Py_ssize_t nargs);  // fast_replay.cpp
PyObject* fast_call(PyObject*, PyObject* const* args, Py_ssize_t nargs);    // fast_replay.cpp
PyObject* fast_entry(PyObject*, PyObject* const* args, Py_ssize_t nargs);   // fast_replay.cpp
}  // namespace graphtree_native

namespace {

PyMethodDef methods[] = {
    {"ptrs_equal", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(ptrs_equal)), METH_FASTCALL,
     "ptrs_equal(tensors, ptrs, idx) -> bool"},
    {"weak_unchanged", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(weak_unchanged)), METH_FASTCALL,
     "weak_unchanged(refs: bytes, expected: bytes) -> bool"},
    {"addresses_unchanged",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(addresses_unchanged)), METH_FASTCALL,
     "addresses_unchanged(tensors: list, expected: bytes) -> bool"},
    {"copy_d2d", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(copy_d2d)), METH_FASTCALL,
     "copy_d2d(dst, src, nbytes, stream) -> bool"},
    {"copy_in", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(copy_in)), METH_FASTCALL,
     "copy_in(stream, leaves, copies, writes) -> bool"},
    {"signature", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(signature)), METH_FASTCALL,
     "signature(args, plain_types) -> (parts, device, needs_grad) | None"},
    {"object_state", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(object_state)), METH_FASTCALL,
     "object_state(obj, plain_types, opaque_types, room) -> (key part, tensors, device, needs_grad) | None"},
    {"channel_take", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(channel_take)), METH_FASTCALL,
     "channel_take(cells, state, plans) -> int"},
    {"channel_publish", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(channel_publish)),
     METH_FASTCALL, "channel_publish(cells, state, publishing) -> int"},
    {"channel_write", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(channel_write)), METH_FASTCALL,
     "channel_write(writer, args, kwargs) -> result"},
    {"ambient", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(ambient)), METH_FASTCALL,
     "ambient() -> (bits, default dtype, autocast dtype | None)"},
    {"fast_replay", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(graphtree_native::fast_replay)), METH_FASTCALL,
     "fast_replay(gc, plan, leaves, needs_grad) -> outputs | plan[0]"},
    {"fast_call", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(graphtree_native::fast_call)), METH_FASTCALL,
     "fast_call(gc, hits, args, plain_types, miss, threads, float_part[, signature]) -> outputs | miss"},
    {"fast_entry", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(graphtree_native::fast_entry)), METH_FASTCALL,
     "fast_entry(package, owner, fallback, plain_types, miss, threads, float_part[, signature]) -> entry(gc, hits, args)"},
#ifdef GRAPHTREE_CUDA
    {"capture_begin_isolated",
     reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(capture_begin_isolated)), METH_FASTCALL,
     "capture_begin_isolated(graph, pool, standin) -> None"},
    {"replay_drawing", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(replay_drawing)), METH_FASTCALL,
     "replay_drawing(graph, pairs) -> increments"},
    {"standin_slots", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(standin_slots)), METH_FASTCALL,
     "standin_slots(standin) -> (seed address, offset address)"},
    {"standin_seal", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(standin_seal)), METH_FASTCALL,
     "standin_seal(standin) -> int"},
    {"prepare_drawing", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(prepare_drawing)), METH_FASTCALL,
     "prepare_drawing(graph, pairs, slots, increments, sealed) -> capsule"},
    {"launch_drawing", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(launch_drawing)), METH_FASTCALL,
     "launch_drawing(capsule) -> None"},
    {"drawing_writes", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(drawing_writes)), METH_FASTCALL,
     "drawing_writes() -> str"},
#endif
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, GT_STR(TORCH_EXTENSION_NAME), "graphtree's native fast-path helpers",
                          -1, methods};

}  // namespace

// What fast_replay.cpp (the fast hit's native twin, a source of its own) calls here.
namespace graphtree_native {
PyObject* ambient_now() { return ambient(nullptr, nullptr, 0); }
PyObject* copy_in_now(PyObject* const* args) { return copy_in(nullptr, args, 4); }
PyObject* addresses_unchanged_now(PyObject* const* args) { return addresses_unchanged(nullptr, args, 2); }
PyObject* signature_now(PyObject* const* args) { return signature(nullptr, args, 2); }
}  // namespace graphtree_native

PyMODINIT_FUNC GT_CONCAT(PyInit_, TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&module_def); }
