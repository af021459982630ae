// What the fast hit's native twin (fast_replay.cpp) and its step end (step_end.cpp) share: a
// reference holder, the attribute names they read, interned once, and the plan's layout
// (tree/fast_hit.py: FastHit.plan). graphtree/_native/__init__.py puts a digest of this header in
// the build's flags, so that a change here rebuilds the module (torch's extension build hashes the
// listed sources alone). Only the CPython API is used here.

#pragma once

#include <Python.h>
#include <structmember.h>

#include <cstddef>
#include <cstdint>

namespace graphtree_native::fast {

// A new reference, released at the end of its scope.
struct Ref {
  PyObject* p;
  explicit Ref(PyObject* o = nullptr) : p(o) {}
  ~Ref() { Py_XDECREF(p); }
  Ref(const Ref&) = delete;
  Ref& operator=(const Ref&) = delete;
  void reset(PyObject* o) {
    Py_XDECREF(p);
    p = o;
  }
  PyObject* get() const { return p; }
  PyObject* release() {
    PyObject* o = p;
    p = nullptr;
    return o;
  }
};

// The attribute names fast_replay reads, interned once.
struct Names {
  PyObject *takes_python_path, *next_id, *models, *training, *active, *part, *dict, *managers, *one_step, *lock,
      *acquire, *release, *walk, *path, *step_requested, *user_steps, *called, *root, *warming, *current, *first,
      *children, *order, *unconditional, *statics_only, *epoch, *statics, *static_packed, *new_step,
      *memory, *live, *inputs, *native, *copy_in, *launch, *raise_replay_error, *replays, *writes, *grads,
      *hand_out, *counters, *hit, *plan, *snapshots, *disabled_reason, *bucketing, *reach, *cells, *step, *trains,
      *grad_off_inside, *forward, *raw_stream, *last_raw, *device, *retired, *collected_seen, *base, *base_storage,
      *refs, *base_holders, *last_replayed, *generation, *numbers, *by_value, *loaded, *exec, *single, *keep_base,
      *groups, *message, *invalidate_storage, *weak_free, *reads_, *structure, *cache, *epoch_, *forward_hooks,
      *forward_pre_hooks, *backward_hooks, *backward_pre_hooks, *compiled_call_impl, *graphtree_call, *fast_hits,
      *entry, *past_fast_hit, *threads;
  bool ok = false;
};

inline Names* names() {
  static Names n;
  if (n.ok) return &n;
  const char* all[] = {"takes_python_path", "next_id", "models", "training", "active", "part", "__dict__",
                       "managers", "one_step", "lock", "acquire", "release", "walk", "path", "step_requested",
                       "user_steps", "called", "root", "warming", "current", "first", "children", "order",
                       "unconditional", "statics_only", "epoch", "statics", "static_packed",
                       "new_step", "memory", "live", "inputs", "_native", "copy_in", "_launch",
                       "raise_replay_error", "replays", "writes", "grads", "hand_out", "counters", "hit", "plan",
                       "_snapshots", "disabled_reason", "bucketing", "_reach", "cells", "_step", "trains",
                       "_grad_off_inside", "_forward", "_raw_stream", "_last_raw", "device", "retired",
                       "_collected_seen", "_base", "_base_storage", "refs", "_base_holders", "last_replayed",
                       "generation", "numbers", "by_value", "loaded", "exec", "_single", "_keep_base", "groups",
                       "message", "invalidate_storage", "weak_free", "_reads", "_structure", "_cache", "_epoch",
                       "_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
                       "_compiled_call_impl", "_graphtree_call", "fast_hits", "entry", "past_fast_hit", "threads"};
  PyObject** slots[] = {&n.takes_python_path, &n.next_id, &n.models, &n.training, &n.active, &n.part, &n.dict,
                        &n.managers, &n.one_step, &n.lock, &n.acquire, &n.release, &n.walk, &n.path,
                        &n.step_requested, &n.user_steps, &n.called, &n.root, &n.warming, &n.current, &n.first,
                        &n.children, &n.order, &n.unconditional, &n.statics_only, &n.epoch,
                        &n.statics, &n.static_packed, &n.new_step, &n.memory, &n.live, &n.inputs, &n.native,
                        &n.copy_in, &n.launch, &n.raise_replay_error, &n.replays, &n.writes, &n.grads, &n.hand_out,
                        &n.counters, &n.hit, &n.plan, &n.snapshots, &n.disabled_reason, &n.bucketing, &n.reach,
                        &n.cells, &n.step, &n.trains, &n.grad_off_inside, &n.forward, &n.raw_stream, &n.last_raw,
                        &n.device, &n.retired, &n.collected_seen, &n.base, &n.base_storage, &n.refs,
                        &n.base_holders, &n.last_replayed, &n.generation, &n.numbers, &n.by_value, &n.loaded,
                        &n.exec, &n.single, &n.keep_base, &n.groups, &n.message, &n.invalidate_storage,
                        &n.weak_free, &n.reads_, &n.structure, &n.cache, &n.epoch_, &n.forward_hooks,
                        &n.forward_pre_hooks, &n.backward_hooks, &n.backward_pre_hooks, &n.compiled_call_impl,
                        &n.graphtree_call, &n.fast_hits, &n.entry, &n.past_fast_hit, &n.threads};
  static_assert(sizeof(all) / sizeof(all[0]) == sizeof(slots) / sizeof(slots[0]), "one slot per name");
  for (size_t i = 0; i < sizeof(all) / sizeof(all[0]); ++i) {
    *slots[i] = PyUnicode_InternFromString(all[i]);  // (never released: they live as long as the module)
    if (*slots[i] == nullptr) return nullptr;
  }
  n.ok = true;
  return &n;
}

// The plan FastHit builds once (fast_hit.py: FastHit.plan), by index.
enum PlanItem {
  kMiss, kTree, kNode, kParent, kChildKey, kDevice, kAmbient, kModule, kTraining, kHandleClass, kHandles,
  kEpochCell, kEpoch, kFree, kModels, kReads, kThreadState, kGcId, kMaxPath, kGradEnabled,
  kCollected, kUseCount, kTorch, kChildHash, kPlanSize
};

// dict[key] for a key whose hash the caller has (a recording's key, hashed once when its fast hit
// was made: hashing a call's key walks all of its nested tuples); a borrowed reference, nullptr
// where it is missing or on error. Python 3.13 keeps the known-hash lookup to itself: plain lookup.
inline PyObject* dict_item(PyObject* dict, PyObject* key, PyObject* hash) {
#if PY_VERSION_HEX < 0x030D0000
  const Py_hash_t h = PyLong_AsSsize_t(hash);
  if (h == -1 && PyErr_Occurred()) return nullptr;
  return _PyDict_GetItem_KnownHash(dict, key, h);
#else
  (void)hash;
  return PyDict_GetItemWithError(dict, key);
#endif
}

// The int 1 (a borrowed reference, made once).
inline PyObject* one() {
  static PyObject* value = PyLong_FromLong(1);
  return value;
}

// What the weak reference `ref` points to (a new reference), or nullptr where it died.
inline PyObject* alive(PyObject* ref) {
#if PY_VERSION_HEX >= 0x030D0000
  PyObject* obj = nullptr;
  return PyWeakref_GetRef(ref, &obj) > 0 ? obj : nullptr;
#else
  PyObject* obj = PyWeakref_GetObject(ref);  // (borrowed; None once dead)
  return obj == nullptr || obj == Py_None ? nullptr : Py_NewRef(obj);
#endif
}

// Where attribute `name` of an instance of `type` is read, as PyObject_GenericGetAttr finds it:
// > 0 the offset of a slot (a __slots__ member, which is a data descriptor: the instance's dict,
// if any, never answers for it), 0 the instance's __dict__ (nothing of that name on the type, or
// a non-data descriptor or class attribute, which the dict's entry overrides), -1 elsewhere (another
// data descriptor: a property). Kept per (type, name) in a small table, valid while the type's
// version tag is (CPython gives a type a new one whenever it or a base changes; tags are never
// reused), as CPython's own attribute cache keys it; a type without a valid tag is looked up each
// time.
struct SlotEntry {
  PyTypeObject* type;
  PyObject* name;
  unsigned int version;
  Py_ssize_t offset;
};

// Whether `type`'s version tag is valid (a flag up to Python 3.12, a nonzero tag after).
inline bool tag_valid(PyTypeObject* type) {
#ifdef Py_TPFLAGS_VALID_VERSION_TAG
  return PyType_HasFeature(type, Py_TPFLAGS_VALID_VERSION_TAG);
#else
  return type->tp_version_tag != 0;
#endif
}

// (Names are keyed by their pointer: every name read here lives as long as the process, the
// interned names of `names()` and those fast_field keeps.)
inline Py_ssize_t slot_offset(PyTypeObject* type, PyObject* name) {
  static SlotEntry table[512];
  const uintptr_t h = (reinterpret_cast<uintptr_t>(type) >> 4) * 31 + (reinterpret_cast<uintptr_t>(name) >> 4);
  SlotEntry& e = table[(h ^ (h >> 9)) & 511];
  if (tag_valid(type) && e.type == type && e.name == name && e.version == type->tp_version_tag) return e.offset;
  PyObject* found = _PyType_Lookup(type, name);  // (borrowed; sets no error; gives the type a tag)
  Py_ssize_t offset = 0;
  if (found != nullptr && Py_IS_TYPE(found, &PyMemberDescr_Type)) {
    const PyMemberDef* m = reinterpret_cast<PyMemberDescrObject*>(found)->d_member;
    offset = m->type == T_OBJECT_EX && !(m->flags & READONLY) && m->offset > 0 ? m->offset : -1;
  } else if (found != nullptr && Py_TYPE(found)->tp_descr_set != nullptr) {
    offset = -1;
  }
  if (tag_valid(type)) e = SlotEntry{type, name, type->tp_version_tag, offset};
  return offset;
}

// Attribute `name` of `obj` (a new reference; nullptr with the error set), as PyObject_GetAttr
// reads it, in a fraction of its instructions for a class that reads attributes generically (no
// __getattr__, no __getattribute__): a slot read at its offset (slot_offset), an instance
// attribute from the instance's __dict__ where it is there, and a module's from its dict; anything
// else (a class attribute, a method, an unset slot's error), PyObject_GetAttr. (Reading the
// __dict__ gives the object one of its own where its attributes were kept inline: Python reads
// them from it as fast.)
inline PyObject* field(PyObject* obj, PyObject* name) {
  PyObject* dict = nullptr;  // (borrowed)
  PyTypeObject* type = Py_TYPE(obj);
  if (type->tp_getattro == PyObject_GenericGetAttr) {
    const Py_ssize_t at = slot_offset(type, name);
    if (at > 0) {
      PyObject* v = *reinterpret_cast<PyObject**>(reinterpret_cast<char*>(obj) + at);
      return v != nullptr ? Py_NewRef(v) : PyObject_GetAttr(obj, name);
    }
    if (at == 0) {
      PyObject** where = _PyObject_GetDictPtr(obj);
      dict = where != nullptr ? *where : nullptr;
    }
  } else if (PyModule_CheckExact(obj)) {
    dict = PyModule_GetDict(obj);
  }
  if (dict != nullptr && PyDict_CheckExact(dict)) {
    PyObject* v = PyDict_GetItemWithError(dict, name);  // (borrowed)
    if (v != nullptr) return Py_NewRef(v);
    if (PyErr_Occurred()) return nullptr;
  }
  return PyObject_GetAttr(obj, name);
}

// obj.name = value, as PyObject_SetAttr sets it: a slot of a class that sets attributes generically
// written at its offset (what its member descriptor does), anything else through PyObject_SetAttr.
// 0 done, -1 an error.
inline int set_field(PyObject* obj, PyObject* name, PyObject* value) {
  PyTypeObject* type = Py_TYPE(obj);
  if (type->tp_setattro == PyObject_GenericSetAttr && type->tp_getattro == PyObject_GenericGetAttr) {
    const Py_ssize_t at = slot_offset(type, name);
    if (at > 0) {
      PyObject** where = reinterpret_cast<PyObject**>(reinterpret_cast<char*>(obj) + at);
      PyObject* old = *where;
      *where = Py_NewRef(value);
      Py_XDECREF(old);
      return 0;
    }
  }
  return PyObject_SetAttr(obj, name, value);
}

// 1 true, 0 false, -1 a Python error: attribute `name` of `obj` is true.
inline int attr_true(PyObject* obj, PyObject* name) {
  Ref v(field(obj, name));
  return v.get() == nullptr ? -1 : PyObject_IsTrue(v.get());
}

// 1 true, 0 false, -1 a Python error: attribute `name` of `obj` is not None.
inline int attr_set(PyObject* obj, PyObject* name) {
  Ref v(field(obj, name));
  return v.get() == nullptr ? -1 : v.get() != Py_None;
}

// step_end.cpp: TreeManager.new_step's common cases, natively (1 done, 0 Python ends the step, -1 an error).
int end_step_natively(PyObject* tree, PyObject* walk, PyObject* leaves, PyObject* const* plan, Names* s);

}  // namespace graphtree_native::fast
