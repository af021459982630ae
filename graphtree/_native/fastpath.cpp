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
#include <torch/csrc/jit/frontend/tracer.h>

#include <ATen/Context.h>
#include <ATen/PythonTorchFunctionTLS.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/DefaultDtype.h>
#include <c10/core/StorageImpl.h>
#include <c10/core/InferenceMode.h>
#include <c10/util/SmallVector.h>

#include <dlfcn.h>

#include <cstdint>
#include <cstring>
#include <vector>

#define GT_CONCAT_(a, b) a##b
#define GT_CONCAT(a, b) GT_CONCAT_(a, b)
#define GT_STR_(a) #a
#define GT_STR(a) GT_STR_(a)

namespace graphtree_native {
// A CUDA runtime function by name, from the runtime torch loaded (draws.cpp uses it too); nullptr
// where none is loaded (a CPU build).
void* runtime_symbol(const char* name) {
  if (void* f = dlsym(RTLD_DEFAULT, name)) return f;
  for (const char* lib : {"libcudart.so.13", "libcudart.so.12", "libcudart.so"}) {
    if (void* h = dlopen(lib, RTLD_LAZY | RTLD_NOLOAD)) {  // only a runtime already in the process
      if (void* f = dlsym(h, name)) return f;
    }
  }
  return nullptr;
}
}  // namespace graphtree_native

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
// address packed for it in expected, for every i: native-endian uint64 pairs (the tensor's
// TensorImpl, as Tensor._cdata gives it, then its address). The check of a module's parameters
// and buffers on every replay: packed once, at the recording, so a call converts no Python ints.
// Where a tensor still holds the TensorImpl packed with it, its address is read through the packed
// pointer (packed_address), so that its loads do not wait on the Python object's; any other tensor
// is read through its Python object. (Prefetching
// the next tensors' lines, tried in the twenty-eighth session, was compiled away: GCC found the
// helper free of side effects and dropped its calls; DESIGN.md.)

// The k-th uint64 of a packed buffer (read as bytes: no alignment assumed).
inline uint64_t packed_at(const char* packed, Py_ssize_t k) {
  uint64_t v;
  std::memcpy(&v, packed + k * sizeof(uint64_t), sizeof(uint64_t));
  return v;
}

// impl->mutable_data() (Tensor.data_ptr()) in its steps, as TensorImpl::data_impl takes them (the
// dtype's check, the storage's mutable_data() with its own checks and materialization, null where
// the tensor is empty, else the data plus itemsize x storage offset), less its virtual
// has_storage() call: storage_ set is what has_storage() answers in TensorImpl, and the classes that
// override it (undefined, sparse, opaque, batched) answer false and hold no storage. The offset is
// storage_offset(), which is data_impl's storage_offset_ in every TensorImpl but a Python-dispatch
// one with custom sizes, a subclass's, never read here. False, having read nothing, where
// mutable_data() itself is to answer: no storage. May throw as mutable_data() throws.
inline bool packed_address(c10::TensorImpl* impl, void** out) {
  c10::StorageImpl* storage = impl->unsafe_storage().unsafeGetStorageImpl();
  if (storage == nullptr) return false;
  const size_t itemsize = impl->itemsize();
  char* data = static_cast<char*>(storage->mutable_data());
  *out = impl->is_empty() ? nullptr : data + itemsize * impl->storage_offset();
  return true;
}

PyObject* addresses_unchanged(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2 || !PyList_Check(args[0]) || !PyBytes_Check(args[1])) {
    PyErr_SetString(PyExc_TypeError, "addresses_unchanged(tensors: list, expected: bytes)");
    return nullptr;
  }
  PyObject* tensors = args[0];
  const Py_ssize_t n = PyList_GET_SIZE(tensors);
  if (PyBytes_GET_SIZE(args[1]) != n * static_cast<Py_ssize_t>(2 * sizeof(uint64_t))) Py_RETURN_FALSE;
  const char* expected = PyBytes_AS_STRING(args[1]);
  PyObject* const* items = PySequence_Fast_ITEMS(tensors);  // (a recording's own list: nothing here changes it)
  // (THPVariable_CheckExact's two classes, read once: a module's parameters first)
  auto* const parameter = reinterpret_cast<PyTypeObject*>(ParameterClass);
  auto* const variable = reinterpret_cast<PyTypeObject*>(THPVariableClass);
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* t = items[i];
    auto* packed = reinterpret_cast<c10::TensorImpl*>(packed_at(expected, 2 * i));
    PyTypeObject* type = Py_TYPE(t);
    void* have;
    try {
      if (!((type == parameter || type == variable) && THPVariable_Unpack(t).unsafeGetTensorImpl() == packed &&
            packed_address(packed, &have))) {
        if (!tensor_address(t, "addresses_unchanged: expected a list of tensors", &have)) return nullptr;
      }
    } catch (const std::exception& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
      return nullptr;
    }
    if (reinterpret_cast<uint64_t>(have) != packed_at(expected, 2 * i + 1)) Py_RETURN_FALSE;
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

using graphtree_native::runtime_symbol;

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

// graph_launch(exec, device, stream) -> bool: cudaGraphLaunch of a recording's cudaGraphExec_t (an
// int: _torch.graph_exec) on a raw stream of `device`, what torch's CUDAGraph.replay does for a
// graph that draws nothing (its generators' prologue then adds nothing) without its binding: the
// argument casts, the GIL released and taken again, the device guard. False, having done nothing,
// where the current device is not `device` (the guard would switch it: the caller replays through
// torch), exec is 0 or no CUDA runtime is loaded. A CUDA error raises what torch's check raises
// (torch.AcceleratorError, "CUDA error: " and the runtime's message), the error cleared as torch clears it.
using GraphLaunchRaw = int (*)(void*, void*);
using GetDevice = int (*)(int*);
using GetLastError = int (*)();

// The exception type torch raises for a CUDA error (torch.AcceleratorError since 2.8), RuntimeError
// before it (a borrowed reference, looked up once).
PyObject* cuda_error_type() {
  static PyObject* type = [] {
    PyObject* torch = PyImport_ImportModule("torch");
    PyObject* t = torch ? PyObject_GetAttrString(torch, "AcceleratorError") : nullptr;
    Py_XDECREF(torch);
    if (t == nullptr || !PyExceptionClass_Check(t)) {
      PyErr_Clear();
      Py_XDECREF(t);
      return Py_NewRef(PyExc_RuntimeError);
    }
    return t;  // (kept for the process's life)
  }();
  return type;
}

}  // namespace

namespace graphtree_native {
// Raise CUDA error `err` as torch's check raises it (cuda_error_type, "CUDA error: " and the
// runtime's message), `what` naming graphtree's call, the error cleared as torch clears it
// (cudaGetLastError). Returns nullptr, for `return raise_cuda_error(...)`. draws.cpp uses it too.
PyObject* raise_cuda_error(int err, const char* what) {
  static GetLastError last_error = reinterpret_cast<GetLastError>(runtime_symbol("cudaGetLastError"));
  static ErrorString error_string = reinterpret_cast<ErrorString>(runtime_symbol("cudaGetErrorString"));
  if (last_error != nullptr) last_error();
  PyErr_Format(cuda_error_type(), "CUDA error: %s (graphtree's %s, error %d)", error_string ? error_string(err) : "unknown",
               what, err);
  return nullptr;
}
}  // namespace graphtree_native

namespace {
using graphtree_native::raise_cuda_error;

int launch_graph(PyObject* exec, PyObject* device, PyObject* stream) {
  static GraphLaunchRaw launch = reinterpret_cast<GraphLaunchRaw>(runtime_symbol("cudaGraphLaunch"));
  static GetDevice get_device = reinterpret_cast<GetDevice>(runtime_symbol("cudaGetDevice"));
  static GetLastError last_error = reinterpret_cast<GetLastError>(runtime_symbol("cudaGetLastError"));
  if (launch == nullptr || get_device == nullptr || last_error == nullptr) return 0;
  void* e = PyLong_AsVoidPtr(exec);
  const long d = PyLong_AsLong(device);
  void* st = PyLong_AsVoidPtr(stream);
  if (PyErr_Occurred()) return -1;
  int current = -1;
  if (e == nullptr || get_device(&current) != 0 || current != d) {
    if (current < 0) last_error();  // (cudaGetDevice failed: torch's replay reports it)
    return 0;
  }
  const int err = launch(e, st);
  if (err != 0) {
    raise_cuda_error(err, "cudaGraphLaunch of a recording");
    return -1;
  }
  return 1;
}

PyObject* graph_launch(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 3) {
    PyErr_SetString(PyExc_TypeError, "graph_launch(exec, device, stream) takes 3 arguments");
    return nullptr;
  }
  const int launched = launch_graph(args[0], args[1], args[2]);
  if (launched < 0) return nullptr;
  return PyBool_FromLong(launched);
}

// detach(t) -> Tensor: t.detach() from C++, for an exact tensor while no torch function mode is on
// (Python's t.detach() would call the mode, and a subclass's __torch_function__: those go through
// Python's method); what the replay hands out for an output the caller dropped.
PyObject* detach(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 1) {
    PyErr_SetString(PyExc_TypeError, "detach(t) takes 1 argument");
    return nullptr;
  }
  PyObject* t = args[0];
  if (!THPVariable_CheckExact(t) || at::impl::torch_function_mode_enabled()) {
    static PyObject* name = PyUnicode_InternFromString("detach");
    return name == nullptr ? nullptr : PyObject_CallMethodNoArgs(t, name);
  }
  try {
    return THPVariable_Wrap(THPVariable_Unpack(t).detach());
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}

// The StorageImpl* of a leaf of a call, as _torch.storage_id reads it (the int a live weak reference
// to that storage equals): 1 with *out a new int for an exact tensor, 0 for anything that is not a
// tensor, 2 for a tensor subclass or one whose storage cannot be read here (Python reads it), -1 an
// error.
int storage_of(PyObject* t, PyObject** out) {
  if (!THPVariable_CheckExact(t)) {
    const int tensor = PyObject_IsInstance(t, THPVariableClass);
    return tensor < 0 ? -1 : tensor ? 2 : 0;
  }
  try {
    const at::Tensor& v = THPVariable_Unpack(t);
    if (!v.has_storage()) return 2;
    *out = PyLong_FromVoidPtr(v.storage().unsafeGetStorageImpl());
    return *out == nullptr ? -1 : 1;
  } catch (const std::exception&) {
    return 2;
  }
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


}  // namespace

namespace graphtree_native {
PyObject* fast_replay(PyObject*, PyObject* const* args, Py_ssize_t nargs);  // fast_replay.cpp
PyObject* fast_call(PyObject*, PyObject* const* args, Py_ssize_t nargs);    // fast_replay.cpp
PyObject* fast_field(PyObject*, PyObject* const* args, Py_ssize_t nargs);   // fast_replay.cpp
PyObject* fast_entry(PyObject*, PyObject* const* args, Py_ssize_t nargs);        // entries.cpp
PyObject* module_entry(PyObject*, PyObject* const* args, Py_ssize_t nargs);      // entries.cpp
PyObject* module_type_call(PyObject*, PyObject* const* args, Py_ssize_t nargs);  // entries.cpp
extern const PyMethodDef keys_methods[];                                    // keys.cpp
extern const PyMethodDef channel_methods[];                                 // channel.cpp
#ifdef GRAPHTREE_CUDA
extern const PyMethodDef draws_methods[];    // draws.cpp
extern const PyMethodDef outputs_methods[];  // outputs.cpp
#endif
}  // namespace graphtree_native

namespace {

using graphtree_native::fast_call;
using graphtree_native::fast_entry;
using graphtree_native::fast_field;
using graphtree_native::module_entry;
using graphtree_native::module_type_call;
using graphtree_native::fast_replay;

const PyMethodDef methods[] = {
    {"ptrs_equal", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(ptrs_equal)), METH_FASTCALL,
     "ptrs_equal(tensors, ptrs, idx) -> bool"},
    {"weak_unchanged", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(weak_unchanged)), METH_FASTCALL,
     "weak_unchanged(refs: bytes, expected: bytes) -> bool"},
    {"addresses_unchanged", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(addresses_unchanged)), METH_FASTCALL,
     "addresses_unchanged(tensors: list, expected: bytes of (TensorImpl, address) pairs) -> bool"},
    {"copy_d2d", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(copy_d2d)), METH_FASTCALL,
     "copy_d2d(dst, src, nbytes, stream) -> bool"},
    {"copy_in", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(copy_in)), METH_FASTCALL,
     "copy_in(stream, leaves, copies, writes) -> bool"},
    {"graph_launch", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(graph_launch)), METH_FASTCALL,
     "graph_launch(exec, device, stream) -> bool"},
    {"detach", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(detach)), METH_FASTCALL,
     "detach(t) -> Tensor"},
    {"ambient", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(ambient)), METH_FASTCALL,
     "ambient() -> (bits, default dtype, autocast dtype | None)"},
    {"fast_replay", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(fast_replay)), METH_FASTCALL,
     "fast_replay(gc, plan, leaves, needs_grad) -> outputs | plan[0]"},
    {"fast_call", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(fast_call)), METH_FASTCALL,
     "fast_call(gc, hits, args, plain_types, miss, threads, float_part[, signature]) -> outputs | miss"},
    {"fast_field", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(fast_field)), METH_FASTCALL,
     "fast_field(obj, name[, value]) -> obj.name | None: the fast hit's attribute read and write"},
    {"fast_entry", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(fast_entry)), METH_FASTCALL,
     "fast_entry(package, owner, fallback, plain_types, miss, threads, float_part[, signature]) -> entry(gc, hits, args)"},
    {"module_entry", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(module_entry)), METH_FASTCALL,
     "module_entry(package, owner, fallback, hooked, global_hooks, user_code, fast_hit, miss) -> entry(module, args, kwargs)"},
    {"module_type_call", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(module_type_call)), METH_FASTCALL,
     "module_type_call(cls, entry, module_class, hooked) -> bool: cls's instances called through entry (its tp_call)"},
    {nullptr, nullptr, 0, nullptr},
};

// The module's method table: this file's entries, then each other source's (keys.cpp, channel.cpp,
// and draws.cpp and outputs.cpp where the CUDA part is built).
PyMethodDef* all_methods() {
  static std::vector<PyMethodDef> all;
  if (!all.empty()) return all.data();
  for (const PyMethodDef* table : {methods, graphtree_native::keys_methods, graphtree_native::channel_methods,
#ifdef GRAPHTREE_CUDA
                                   graphtree_native::draws_methods, graphtree_native::outputs_methods,
#endif
                                  }) {
    for (const PyMethodDef* m = table; m->ml_name != nullptr; ++m) all.push_back(*m);
  }
  all.push_back({nullptr, nullptr, 0, nullptr});
  return all.data();
}

PyModuleDef module_def = {PyModuleDef_HEAD_INIT, GT_STR(TORCH_EXTENSION_NAME), "graphtree's native fast-path helpers",
                          -1, nullptr};

}  // namespace

// What fast_replay.cpp (the fast hit's native twin, a source of its own) calls here.
namespace graphtree_native {
PyObject* ambient_now() { return ambient(nullptr, nullptr, 0); }
PyObject* copy_in_now(PyObject* const* args) { return copy_in(nullptr, args, 4); }
PyObject* addresses_unchanged_now(PyObject* const* args) { return addresses_unchanged(nullptr, args, 2); }
int launch_now(PyObject* exec, PyObject* device, PyObject* stream) { return launch_graph(exec, device, stream); }
PyObject* detach_now(PyObject* t) { return detach(nullptr, &t, 1); }
bool jit_tracing_now() { return torch::jit::tracer::isTracing(); }  // (torch._C._get_tracing_state() is not None)
int storage_of_now(PyObject* t, PyObject** out) { return storage_of(t, out); }
}  // namespace graphtree_native

PyMODINIT_FUNC GT_CONCAT(PyInit_, TORCH_EXTENSION_NAME)(void) {
  module_def.m_methods = all_methods();
  return PyModule_Create(&module_def);
}
