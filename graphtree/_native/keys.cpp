// The recording key of a call, read in C++ (see DESIGN.md beside this file): `signature` for a call
// of tensors and plain values, `object_state` for an object argument's tensors and plain state, each
// the twin of a Python read (graphtree.tree.inputs', graphtree.tree.object_state's). Built with
// fastpath.cpp into one module, whose method table lists them. Only exact torch.Tensor and
// nn.Parameter objects are read here.

#include <Python.h>

#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/autograd/python_variable.h>

#include <c10/util/SmallVector.h>

#include <cstdint>
#include <unordered_set>

namespace {

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
// The key part of an object argument, as graphtree.tree.object_state.read_object builds it for an
// object that is not a module: (type(obj), tuple(out)), out walked as _read_state walks it. tensors
// are the CUDA tensors it holds, in order (read in place); device their one device (-2: none);
// room how many more tensors the call may hold. None where the Python path must decide or name a
// reason: a module, a function or any of opaque_types, a list, tuple or dict subclass, a dict key
// that is not plain, a type with __slots__ or its own attribute lookup, a tensor subclass or
// unusual tensor, several devices, a limit reached. Runs no Python code: borrowed references stay
// valid for the walk.
constexpr Py_ssize_t kMaxItems = 20000;  // graphtree.tree.object_state._MAX_ITEMS
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


}  // namespace

namespace graphtree_native {
// This file's entries in the module's method table (fastpath.cpp joins the tables).
extern const PyMethodDef keys_methods[] = {
    {"signature", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(signature)), METH_FASTCALL,
     "signature(args, plain_types) -> (parts, device, needs_grad) | None"},
    {"object_state", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(object_state)), METH_FASTCALL,
     "object_state(obj, plain_types, opaque_types, room) -> (key part, tensors, device, needs_grad) | None"},
    {nullptr, nullptr, 0, nullptr},
};
PyObject* signature_now(PyObject* const* args) { return signature(nullptr, args, 2); }  // (fast_replay.cpp)
}  // namespace graphtree_native
