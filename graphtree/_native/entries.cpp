// The native entries of a graphed call (issue 47): what GraphedCallable.__call__ and a graphed
// module's call reach with no Python frame of graphtree's between them and fast_call (fast_replay.cpp).
// fast_entry and module_entry bind an entry's fixed arguments into a C function; module_type_call
// makes a graphed module's class call its entry from its tp_call slot. Only the CPython API is used.

#include "fast_hit.h"

#include <initializer_list>

namespace graphtree_native {
PyObject* fast_call(PyObject*, PyObject* const* args, Py_ssize_t nargs);  // fast_replay.cpp
bool jit_tracing_now();                                                   // fastpath.cpp
}  // namespace graphtree_native

namespace graphtree_native {

using namespace graphtree_native::fast;  // NOLINT: the shared definitions (fast_hit.h)

// An entry made by fast_entry, `bound` its `self`: (package, owner, fallback, *fast_call's fixed
// arguments). fast_call(gc, hits, args, *fixed) while package.loaded is still `owner` (the helpers
// it was made from); fallback(gc, hits, args) once another module or None was put there (tests
// swap it; GRAPHTREE_NATIVE=0 never binds one).
static PyObject* entry_call(PyObject* bound, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 3 || !PyTuple_Check(bound) || PyTuple_GET_SIZE(bound) < 7 || PyTuple_GET_SIZE(bound) > 8) {
    PyErr_SetString(PyExc_TypeError, "graphtree fast entry(gc, hits, args)");
    return nullptr;
  }
  Names* s = names();
  if (s == nullptr) return nullptr;
  Ref loaded(field(PyTuple_GET_ITEM(bound, 0), s->loaded));
  if (loaded.get() == nullptr) return nullptr;
  if (loaded.get() != PyTuple_GET_ITEM(bound, 1)) return PyObject_Vectorcall(PyTuple_GET_ITEM(bound, 2), args, 3, nullptr);
  const Py_ssize_t k = PyTuple_GET_SIZE(bound) - 3;
  PyObject* full[8] = {args[0], args[1], args[2]};
  for (Py_ssize_t i = 0; i < k; ++i) full[3 + i] = PyTuple_GET_ITEM(bound, 3 + i);
  return fast_call(nullptr, full, 3 + k);
}

// The C function `def` with a tuple of `args` as its self: an entry with its fixed arguments bound.
static PyObject* bound_to(PyMethodDef* def, PyObject* const* args, Py_ssize_t nargs) {
  Ref bound(PyTuple_New(nargs));
  if (bound.get() == nullptr) return nullptr;
  for (Py_ssize_t i = 0; i < nargs; ++i) PyTuple_SET_ITEM(bound.get(), i, Py_NewRef(args[i]));
  return PyCFunction_NewEx(def, bound.get(), nullptr);
}

static PyMethodDef entry_def = {"fast_entry", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(entry_call)),
                                METH_FASTCALL, "entry(gc, hits, args) -> outputs | miss: fast_call with its bound arguments"};

// fast_entry(package, owner, fallback, plain_types, miss, threads, float_part[, signature]) -> entry:
// fast_call with the arguments that never change bound, as a C function taking (gc, hits, args):
// what GraphedCallable.__call__ calls, with no Python frame between it and fast_call
// (tree/fast_hit.py: entry). It calls fallback instead once package.loaded is no longer owner.
// `signature`, where given, the stand-in fast_call takes (tests on CPU tensors).
PyObject* fast_entry(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 7 && nargs != 8) {
    PyErr_SetString(PyExc_TypeError,
                    "fast_entry(package, owner, fallback, plain_types, miss, threads, float_part[, signature])");
    return nullptr;
  }
  return bound_to(&entry_def, args, nargs);
}

// A module's entry made by module_entry, `bound` its self: (package, owner, fallback, hooked,
// global_hooks, user_code, fast_hit, miss). What GraphedModule.__call__ calls for
// (module, args, kwargs), its Python twin graphed_module._plain_call in C: `hooked` where
// nn.Module.__call__ would do more than call forward (a hook on the module or a global one, a
// compiled call from module.compile(), a torch.jit trace under way); else the call made as
// GraphedCallable.__call__ would make it: fast_hit.entry (read on each call: tests count through
// it) where fast hits are kept for a call of positional arguments outside user code, and on a
// miss past_fast_hit, the Python path, with no second try; anything else gc(*args, **kwargs).
// fallback(module, args, kwargs) once package.loaded is no longer owner, or where the module's
// state is not where nn.Module keeps it (its instance dict). `kwargs` None for none (the class
// call's, below: a dict is made only where a Python function takes it).
static PyObject* module_call(PyObject* bound, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 3 || !PyTuple_Check(bound) || PyTuple_GET_SIZE(bound) != 8 || !PyTuple_Check(args[1]) ||
      (!PyDict_Check(args[2]) && args[2] != Py_None)) {
    PyErr_SetString(PyExc_TypeError, "graphtree module entry(module, args: tuple, kwargs: dict | None)");
    return nullptr;
  }
  Names* s = names();
  if (s == nullptr) return nullptr;
  auto item = [bound](Py_ssize_t i) { return PyTuple_GET_ITEM(bound, i); };
  Ref made;  // (an empty dict for kwargs None, once a Python function takes it)
  auto kwargs = [&]() -> PyObject* {
    if (args[2] != Py_None) return args[2];
    if (made.get() == nullptr) made.reset(PyDict_New());
    return made.get();
  };
  auto fallback = [&]() -> PyObject* {
    PyObject* kw = kwargs();
    if (kw == nullptr) return nullptr;
    PyObject* a[3] = {args[0], args[1], kw};
    return PyObject_Vectorcall(item(2), a, 3, nullptr);
  };
  Ref loaded(field(item(0), s->loaded));
  if (loaded.get() == nullptr) return nullptr;
  if (loaded.get() != item(1)) return fallback();
  Ref dict(PyObject_GenericGetDict(args[0], nullptr));
  if (dict.get() == nullptr) return nullptr;
  for (PyObject* name : {s->forward_hooks, s->forward_pre_hooks, s->backward_hooks, s->backward_pre_hooks}) {
    PyObject* hooks = PyDict_GetItemWithError(dict.get(), name);  // (borrowed; an OrderedDict)
    if (hooks == nullptr) return PyErr_Occurred() ? nullptr : fallback();
    const int set = PyObject_IsTrue(hooks);
    if (set != 0) return set < 0 ? nullptr : Py_NewRef(item(3));
  }
  PyObject* compiled = PyDict_GetItemWithError(dict.get(), s->compiled_call_impl);  // (module.compile() sets it)
  if (compiled == nullptr && PyErr_Occurred()) return nullptr;
  if (compiled == nullptr) {  // (else nn.Module's own: None)
    Ref declared(field(reinterpret_cast<PyObject*>(Py_TYPE(args[0])), s->compiled_call_impl));
    if (declared.get() == nullptr) return nullptr;
    if (declared.get() != Py_None) return Py_NewRef(item(3));
  } else if (compiled != Py_None) {
    return Py_NewRef(item(3));
  }
  PyObject* global = item(4);  // (torch's global module hooks: the dicts themselves)
  for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(global); ++i) {
    const int set = PyObject_IsTrue(PyTuple_GET_ITEM(global, i));
    if (set != 0) return set < 0 ? nullptr : Py_NewRef(item(3));
  }
  if (jit_tracing_now()) return Py_NewRef(item(3));  // (torch._C._get_tracing_state() is not None)
  PyObject* found = PyDict_GetItemWithError(dict.get(), s->graphtree_call);
  if (found == nullptr) return PyErr_Occurred() ? nullptr : fallback();
  Ref gc(Py_NewRef(found));  // (the dict may lose it while the call runs Python)
  Ref hits(field(gc.get(), s->fast_hits));
  if (hits.get() == nullptr) return nullptr;
  const int any_hits = PyObject_IsTrue(hits.get());
  if (any_hits < 0) return nullptr;
  const bool positional = args[2] == Py_None || PyDict_GET_SIZE(args[2]) == 0;
  int inside = 1;
  if (any_hits && positional) {  // (user_code.active, read where UserCode.threads counts any thread in user code)
    Ref threads(field(reinterpret_cast<PyObject*>(Py_TYPE(item(5))), s->threads));
    if (threads.get() == nullptr) return nullptr;
    inside = PyObject_IsTrue(threads.get());
    if (inside > 0) inside = attr_true(item(5), s->active);
  }
  if (inside < 0) return nullptr;
  if (inside) return PyObject_Call(gc.get(), args[1], args[2] == Py_None ? nullptr : args[2]);
  Ref entry(field(item(6), s->entry));
  if (entry.get() == nullptr) return nullptr;
  PyObject* entry_args[3] = {gc.get(), hits.get(), args[1]};
  Ref out(PyObject_Vectorcall(entry.get(), entry_args, 3, nullptr));
  if (out.get() == nullptr || out.get() != item(7)) return out.release();
  PyObject* kw = kwargs();
  return kw == nullptr ? nullptr : PyObject_CallMethodObjArgs(gc.get(), s->past_fast_hit, args[1], kw, nullptr);
}

static PyMethodDef module_call_def = {
    "module_entry", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(module_call)), METH_FASTCALL,
    "entry(module, args, kwargs) -> outputs | hooked: a graphed module's call, its checks in C"};

// module_entry(package, owner, fallback, hooked, global_hooks, user_code, fast_hit, miss)
// -> entry: GraphedModule.__call__'s checks and call as a C function taking (module, args,
// kwargs), with the arguments that never change bound (module_call above); fallback, the Python
// twin, once package.loaded is no longer owner.
PyObject* module_entry(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 8 || !PyTuple_Check(args[4])) {
    PyErr_SetString(PyExc_TypeError,
                    "module_entry(package, owner, fallback, hooked, global_hooks: tuple, user_code, fast_hit, miss)");
    return nullptr;
  }
  return bound_to(&module_call_def, args, nargs);
}

// The call of a graphed module's class made in C: what module_type_call installs.
struct ClassCall {
  PyObject* entry = nullptr;        // module_entry's entry
  PyObject* module_class = nullptr;  // torch.nn.Module (its __call__ read on each hooked call)
  PyObject* hooked = nullptr;       // what the entry answers where nn.Module.__call__ makes the call
};
ClassCall class_call;  // (strong references, replaced by the next module_type_call)

// A graphed module's call (its class's tp_call slot): entry(module, args, kwargs or None), and
// where it answers `hooked`, nn.Module.__call__(module, *args, **kwargs), read then (as the Python
// twin reads it: a test's counting stand-in is called).
static PyObject* graphed_module_call(PyObject* self, PyObject* args, PyObject* kwargs) {
  if (class_call.entry == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "graphtree: a graphed module's call before module_type_call");
    return nullptr;
  }
  // (held here: a call that reaches Python may install another while this one runs)
  Ref entry(Py_NewRef(class_call.entry)), module_class(Py_NewRef(class_call.module_class));
  Ref hooked(Py_NewRef(class_call.hooked));
  PyObject* a[3] = {self, args, kwargs != nullptr ? kwargs : Py_None};
  Ref out(PyObject_Vectorcall(entry.get(), a, 3, nullptr));
  if (out.get() == nullptr || out.get() != hooked.get()) return out.release();
  Ref nn_call(PyObject_GetAttrString(module_class.get(), "__call__"));
  if (nn_call.get() == nullptr) return nullptr;
  const Py_ssize_t n = PyTuple_GET_SIZE(args);
  Ref full(PyTuple_New(n + 1));
  if (full.get() == nullptr) return nullptr;
  PyTuple_SET_ITEM(full.get(), 0, Py_NewRef(self));
  for (Py_ssize_t i = 0; i < n; ++i) PyTuple_SET_ITEM(full.get(), i + 1, Py_NewRef(PyTuple_GET_ITEM(args, i)));
  return PyObject_Call(nn_call.get(), full.get(), kwargs);
}

// module_type_call(cls, entry, module_class, hooked) -> bool: cls's instances called through
// graphed_module_call above (its tp_call slot), with module_entry's `entry`: GraphedModule.__call__'s
// steps with no Python frame, no *args tuple made again and no **kwargs dict. cls keeps its
// __call__, which is what Python reads: torch.compile traces it (a trace never calls a slot: hence
// no is_dynamo_compiling check here, where it is always false), a subclass made since calls it (its
// own slot is made from it), and setting cls.__call__ remakes the slot from it. The last call of
// this function sets the entry of every class it was called for (graphtree calls it for
// GraphedModule alone). False where it does nothing: Python 3.14 on, not tried.
PyObject* module_type_call(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 4 || !PyType_Check(args[0]) ||
      !(reinterpret_cast<PyTypeObject*>(args[0])->tp_flags & Py_TPFLAGS_HEAPTYPE)) {
    PyErr_SetString(PyExc_TypeError, "module_type_call(cls: a class made in Python, entry, module_class, hooked)");
    return nullptr;
  }
#if PY_VERSION_HEX >= 0x030E0000
  Py_RETURN_FALSE;
#else
  ClassCall old = class_call;
  class_call = ClassCall{Py_NewRef(args[1]), Py_NewRef(args[2]), Py_NewRef(args[3])};
  reinterpret_cast<PyTypeObject*>(args[0])->tp_call = graphed_module_call;
  Py_XDECREF(old.entry);
  Py_XDECREF(old.module_class);
  Py_XDECREF(old.hooked);
  Py_RETURN_TRUE;
#endif
}

}  // namespace graphtree_native
