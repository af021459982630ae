// A replay's single output built on its pool memory, and an output the caller held past its step
// invalidated, in C++ (issue 47: the "output kept" loop, `y = f(x)` kept until the next call). The
// Python twins are _torch.storage_at + _torch.tensor_on + _torch.weak_ref (OutputLiveness.hand_out)
// and _torch.invalidate_storage + _torch.weak_free (Walk.end_step): torch's bindings in
// torch/csrc/cuda/Module.cpp, called here as C++ without their Python argument parsing (a dict of
// metadata, std::string, three calls for one invalidation). What they do is the same.
//
// The CUDA part (-DGRAPHTREE_CUDA: the caching allocator's deleter); without it each *_now function
// answers 0 and its caller (fast_replay.cpp, step_end.cpp) calls the Python twin. (The CPU tests'
// stand-ins hand out references of their own: a build without CUDA never reads one as a pointer.)

#include <Python.h>

namespace graphtree_native {
int single_output_now(PyObject* single, PyObject* device, PyObject** tensor, PyObject** ref);
int invalidate_storage_now(PyObject* ref, PyObject* message);
int weak_free_now(PyObject* ref);
int use_count_now(PyObject* ref, Py_ssize_t* count);
}  // namespace graphtree_native

#ifndef GRAPHTREE_CUDA
namespace graphtree_native {
int single_output_now(PyObject*, PyObject*, PyObject**, PyObject**) { return 0; }
int invalidate_storage_now(PyObject*, PyObject*) { return 0; }
int weak_free_now(PyObject*) { return 0; }
int use_count_now(PyObject*, Py_ssize_t*) { return 0; }
}  // namespace graphtree_native
#else
#include <torch/csrc/Dtype.h>
#include <torch/csrc/autograd/python_variable.h>

#include <ATen/core/TensorBase.h>
#include <c10/core/Storage.h>
#include <c10/core/StorageImpl.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/util/SmallVector.h>
#include <c10/util/intrusive_ptr.h>

#include <string>

namespace {

// The ints of a tuple of Python ints into `out`; false (no error set) where it is not one.
bool int_list(PyObject* seq, c10::SmallVector<int64_t, 8>& out) {
  if (!PyTuple_Check(seq)) return false;
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(seq); ++i) {
    const long long v = PyLong_AsLongLong(PyTuple_GET_ITEM(seq, i));
    if (v == -1 && PyErr_Occurred()) {
      PyErr_Clear();
      return false;
    }
    out.push_back(v);
  }
  return true;
}

// The StorageImpl* a weak reference (an int from make_weak or UntypedStorage._weak_ref) names.
c10::StorageImpl* storage_named(PyObject* ref) {
  void* p = PyLong_AsVoidPtr(ref);
  return p == nullptr ? nullptr : static_cast<c10::StorageImpl*>(p);
}

template <typename Body>
int raising(Body&& body) {
  try {
    return body();
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  }
  return -1;
}

// single_output(single, device) -> (tensor, ref): single_output_now for tests (GPU).
PyObject* single_output(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2) {
    PyErr_SetString(PyExc_TypeError, "single_output(single: SingleOutput, device: int)");
    return nullptr;
  }
  PyObject *tensor = nullptr, *ref = nullptr;
  const int built = graphtree_native::single_output_now(args[0], args[1], &tensor, &ref);
  if (built < 0) return nullptr;
  if (built == 0) Py_RETURN_NONE;
  return Py_BuildValue("(NN)", tensor, ref);
}

// invalidate_storage(ref, message) -> None: invalidate_storage_now for tests (GPU).
PyObject* invalidate_storage(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 2 || !PyUnicode_Check(args[1])) {
    PyErr_SetString(PyExc_TypeError, "invalidate_storage(ref: int, message: str)");
    return nullptr;
  }
  if (graphtree_native::invalidate_storage_now(args[0], args[1]) < 0) return nullptr;
  Py_RETURN_NONE;
}

}  // namespace

namespace graphtree_native {

// OutputLiveness.hand_out's storage and tensor for a single output (tree/outputs.py: SingleOutput,
// a tuple (ptr, nbytes, meta)) on CUDA device `device`: a storage of nbytes at ptr that owns
// nothing (_construct_storage_from_data_pointer), a tensor of meta's dtype, size, stride and
// storage offset on it (_construct_CUDA_Tensor_From_Storage_And_Metadata), and a weak reference to
// the storage (UntypedStorage._weak_ref). 1 with *tensor and *ref new references, 0 where `single`
// is not in that form (the Python twin builds it), -1 an error.
int single_output_now(PyObject* single, PyObject* device, PyObject** tensor, PyObject** ref) {
  if (!PyTuple_Check(single) || PyTuple_GET_SIZE(single) != 3 || !PyDict_Check(PyTuple_GET_ITEM(single, 2))) return 0;
  PyObject* meta = PyTuple_GET_ITEM(single, 2);
  // (borrowed references; PyDict_GetItemString raises nothing: the keys are str)
  PyObject *size = PyDict_GetItemString(meta, "size"), *stride = PyDict_GetItemString(meta, "stride"),
           *dtype = PyDict_GetItemString(meta, "dtype"), *offset = PyDict_GetItemString(meta, "storage_offset");
  if (size == nullptr || stride == nullptr || dtype == nullptr || offset == nullptr || !THPDtype_Check(dtype)) return 0;
  c10::SmallVector<int64_t, 8> sizes, strides;
  if (!int_list(size, sizes) || !int_list(stride, strides) || sizes.size() != strides.size()) return 0;
  void* ptr = PyLong_AsVoidPtr(PyTuple_GET_ITEM(single, 0));
  const Py_ssize_t nbytes = PyLong_AsSsize_t(PyTuple_GET_ITEM(single, 1));
  const long long storage_offset = PyLong_AsLongLong(offset);
  const long index = PyLong_AsLong(device);
  if (PyErr_Occurred()) return -1;
  const at::ScalarType scalar_type = reinterpret_cast<THPDtype*>(dtype)->scalar_type;
  return raising([&]() -> int {
    const c10::Device on(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(index));
    c10::Storage storage(c10::Storage::use_byte_size_t(), static_cast<size_t>(nbytes), at::DataPtr(ptr, on));
    c10::StorageImpl* impl = storage.unsafeGetStorageImpl();
    at::TensorBase t = at::detail::make_tensor_base<c10::TensorImpl>(
        std::move(storage), c10::DispatchKeySet(c10::DispatchKey::CUDA), c10::scalarTypeToTypeMeta(scalar_type));
    t.unsafeGetTensorImpl()->set_sizes_and_strides(at::IntArrayRef(sizes), at::IntArrayRef(strides));
    t.unsafeGetTensorImpl()->set_storage_offset(storage_offset);
    PyObject* r = PyLong_FromVoidPtr(c10::raw::intrusive_ptr::make_weak(impl));
    if (r == nullptr) return -1;
    PyObject* wrapped = THPVariable_Wrap(std::move(t));
    if (wrapped == nullptr) {
      c10::raw::weak_intrusive_ptr::decref(impl);
      Py_DECREF(r);
      return -1;
    }
    *tensor = wrapped;
    *ref = r;
    return 1;
  });
}

// _torch.invalidate_storage(ref, message): where the storage still owns its pool block (the
// caching allocator's deleter: _has_Standard_Deleter), the block goes back to the pool first
// (_free_And_Remove_DeleterFn); then every later access raises `message`
// (_set_storage_data_ptr_access_error_msg). 1 done, -1 an error.
int invalidate_storage_now(PyObject* ref, PyObject* message) {
  c10::StorageImpl* impl = storage_named(ref);
  Py_ssize_t length = 0;
  const char* text = PyUnicode_AsUTF8AndSize(message, &length);
  if (impl == nullptr || text == nullptr) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "graphtree: invalidate_storage of a null storage");
    return -1;
  }
  return raising([&]() -> int {
    auto* allocator = c10::cuda::CUDACachingAllocator::get();
    if (impl->data_ptr().get_deleter() == allocator->raw_deleter()) {
      void* block = impl->data_ptr().get();
      TORCH_CHECK(impl->mutable_data_ptr().compare_exchange_deleter(allocator->raw_deleter(), c10::detail::deleteNothing),
                  "Expected standard deleter");
      c10::cuda::CUDACachingAllocator::raw_delete(block);
    }
    impl->release_data_and_set_meta_custom_data_ptr_error_msg_(std::string(text, static_cast<size_t>(length)));
    return 1;
  });
}

// _torch.weak_free(ref) (UntypedStorage._free_weak_ref): 1 done, -1 an error.
int weak_free_now(PyObject* ref) {
  c10::StorageImpl* impl = storage_named(ref);
  if (impl == nullptr) return PyErr_Occurred() ? -1 : 1;  // (0: no reference, nothing to free)
  c10::raw::weak_intrusive_ptr::decref(impl);
  return 1;
}

// _torch.storage_use_count(ref) (torch._C._storage_Use_Count): how many tensors and storage objects
// hold the storage; 1 with *count set, -1 an error.
int use_count_now(PyObject* ref, Py_ssize_t* count) {
  c10::StorageImpl* impl = storage_named(ref);
  if (impl == nullptr) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "graphtree: the use count of a null storage");
    return -1;
  }
  *count = static_cast<Py_ssize_t>(c10::raw::weak_intrusive_ptr::use_count(impl));
  return 1;
}

// This file's entries in the module's method table (fastpath.cpp joins the tables).
extern const PyMethodDef outputs_methods[] = {
    {"single_output", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(single_output)), METH_FASTCALL,
     "single_output(single, device) -> (tensor, weak ref) | None"},
    {"invalidate_storage", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(invalidate_storage)),
     METH_FASTCALL, "invalidate_storage(ref, message) -> None"},
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace graphtree_native
#endif  // GRAPHTREE_CUDA
