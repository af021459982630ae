// The end of a step the fast hit's native twin (fast_replay.cpp) makes itself: TreeManager.new_step
// (Walk.end_step, OutputLiveness.release) where the path's outputs are bases the caller dropped or
// single outputs the caller still holds, which are invalidated as Walk.end_step invalidates them.
// Everything else is left to TreeManager.new_step, the reference. Only the CPython API is used here.

#include "fast_hit.h"

namespace graphtree_native {
int storage_of_now(PyObject* t, PyObject** out);              // fastpath.cpp
int invalidate_storage_now(PyObject* ref, PyObject* message);  // outputs.cpp (0: not built)
int weak_free_now(PyObject* ref);                              // outputs.cpp (0: not built)
int use_count_now(PyObject* ref, Py_ssize_t* count);           // outputs.cpp (0: not built)
}  // namespace graphtree_native

namespace graphtree_native::fast {
namespace {

// How many tensors and storage objects hold the storage of the weak reference `ref`, into *uses:
// _torch.storage_use_count's answer, read in C++ where the CUDA part is built (use_count_now). 0
// done, -1 an error.
int uses_of(PyObject* ref, PyObject* const* plan, Py_ssize_t* uses) {
  const int native = use_count_now(ref, uses);
  if (native != 0) return native < 0 ? -1 : 0;
  Ref count(PyObject_CallOneArg(plan[kUseCount], ref));
  *uses = count.get() ? PyLong_AsSsize_t(count.get()) : -1;
  return *uses == -1 && PyErr_Occurred() ? -1 : 0;
}

// 1 where the caller no longer holds `node`'s output, a base OutputLiveness keeps between replays
// (OutputLiveness._base_shared false: the storage's use count and the storage object's refcount
// are those taken when the base was built), 0 where it may (or there is no base), -1 an error.
int base_dropped(PyObject* node, PyObject* const* plan, Names* s) {
  Ref live(field(node, s->live));
  Ref base(live.get() ? field(live.get(), s->base) : nullptr);
  if (base.get() == nullptr) return -1;
  if (base.get() == Py_None) return 0;
  Ref storage(field(live.get(), s->base_storage));  // (held once here, as the twin's stack holds it)
  Ref refs(storage.get() ? field(live.get(), s->refs) : nullptr);
  Ref holders(refs.get() ? field(live.get(), s->base_holders) : nullptr);
  if (holders.get() == nullptr) return -1;
  if (!PyList_Check(refs.get()) || PyList_GET_SIZE(refs.get()) < 1 || !PyTuple_Check(holders.get()) ||
      PyTuple_GET_SIZE(holders.get()) != 2) {
    return 0;
  }
  Py_ssize_t uses = 0;
  if (uses_of(PyList_GET_ITEM(refs.get(), 0), plan, &uses) < 0) return -1;
  const Py_ssize_t uses_then = PyLong_AsSsize_t(PyTuple_GET_ITEM(holders.get(), 0));
  const Py_ssize_t count_then = PyLong_AsSsize_t(PyTuple_GET_ITEM(holders.get(), 1));
  if (PyErr_Occurred()) return -1;
  return uses == uses_then && Py_REFCNT(storage.get()) == count_then;
}

// A node of the path whose single output the caller still holds, built anew at its last replay
// (OutputLiveness: no base, its one weak reference alive): OutputLiveness.release hands it to
// Walk.end_step to invalidate. 1 with `live`, `ref` and `message` set (new references), 0 where the
// node is not that case, -1 an error.
int held_single(PyObject* node, PyObject* const* plan, Names* s, Ref& live, Ref& ref, Ref& message) {
  live.reset(field(node, s->live));
  Ref base(live.get() ? field(live.get(), s->base) : nullptr);
  Ref single(base.get() ? field(live.get(), s->single) : nullptr);
  Ref refs(single.get() ? field(live.get(), s->refs) : nullptr);
  if (refs.get() == nullptr) return -1;
  if (base.get() != Py_None || single.get() == Py_None || !PyList_Check(refs.get()) ||
      PyList_GET_SIZE(refs.get()) != 1) {
    return 0;
  }
  ref.reset(Py_NewRef(PyList_GET_ITEM(refs.get(), 0)));
  const int set = PyObject_IsTrue(ref.get());
  if (set <= 0) return set;  // (0: released already)
  Py_ssize_t uses = 0;  // (none: _torch.weak_expired's answer, torch's use count of 0)
  if (uses_of(ref.get(), plan, &uses) < 0) return -1;
  if (uses == 0) return 0;  // (the caller dropped it: release frees the reference)
  Ref out_plan(field(live.get(), s->plan));
  Ref groups(out_plan.get() ? field(out_plan.get(), s->groups) : nullptr);
  if (groups.get() == nullptr) return -1;
  if (!PyList_Check(groups.get()) || PyList_GET_SIZE(groups.get()) < 1) return 0;
  message.reset(field(PyList_GET_ITEM(groups.get(), 0), s->message));
  return message.get() == nullptr ? -1 : 1;
}

// Walk.end_step's invalidations for the nodes of `path` from `first` on (whose output is no dropped
// base: the caller found that), each either a base the caller dropped (nothing to release) or a
// single output the caller holds (held_single), where no leaf of this call is on an output to
// invalidate (Walk.end_step clones those first): 1 done
// (OutputLiveness.release's writes, then each output invalidated and its weak reference freed, in
// Walk.end_step's order), 0 nothing changed (Python ends the step), -1 an error.
int invalidate_held(PyObject* path, Py_ssize_t first, PyObject* leaves, PyObject* const* plan, Names* s) {
  constexpr Py_ssize_t kMost = 8;
  Ref lives[kMost], refs[kMost], messages[kMost];
  Py_ssize_t held = 0;
  for (Py_ssize_t i = first; i < PyList_GET_SIZE(path); ++i) {
    PyObject* node = PyList_GET_ITEM(path, i);
    const int dropped = i == first ? 0 : base_dropped(node, plan, s);  // (`first`'s: the caller's answer)
    if (dropped < 0) return -1;
    if (dropped) continue;
    if (held == kMost) return 0;
    const int one = held_single(node, plan, s, lives[held], refs[held], messages[held]);
    if (one <= 0) return one;
    ++held;
  }
  if (!PyTuple_Check(leaves) && !PyList_Check(leaves)) return 0;
  for (Py_ssize_t i = 0; i < PySequence_Fast_GET_SIZE(leaves); ++i) {
    PyObject* key = nullptr;
    const int tensor = storage_of_now(PySequence_Fast_GET_ITEM(leaves, i), &key);
    if (tensor < 0) return -1;
    if (tensor == 2) return 0;  // (a tensor subclass: Python reads its storage)
    if (tensor == 0) continue;
    Ref k(key);
    for (Py_ssize_t h = 0; h < held; ++h) {
      const int same = PyObject_RichCompareBool(k.get(), refs[h].get(), Py_EQ);
      if (same != 0) return same < 0 ? -1 : 0;
    }
  }
  // From here on, the writes: OutputLiveness.release's, then Walk.end_step's invalidations.
  Ref zero(PyLong_FromLong(0));
  if (zero.get() == nullptr) return -1;
  for (Py_ssize_t h = 0; h < held; ++h) {
    Ref live_refs(field(lives[h].get(), s->refs));
    if (live_refs.get() == nullptr || PyList_SetItem(live_refs.get(), 0, Py_NewRef(zero.get())) < 0 ||
        set_field(lives[h].get(), s->keep_base, Py_False) < 0) {
      return -1;
    }
  }
  // In C++ where the CUDA part is built (outputs.cpp); else _torch's twins, read from _torch now as
  // Walk.end_step reads them (CPU tests replace them).
  Ref invalidate, free_ref;
  for (Py_ssize_t h = 0; h < held; ++h) {
    const int native = invalidate_storage_now(refs[h].get(), messages[h].get());
    if (native < 0) return -1;
    if (native == 1) continue;
    if (invalidate.get() == nullptr) invalidate.reset(field(plan[kTorch], s->invalidate_storage));
    PyObject* a[2] = {refs[h].get(), messages[h].get()};
    Ref done(invalidate.get() ? PyObject_Vectorcall(invalidate.get(), a, 2, nullptr) : nullptr);
    if (done.get() == nullptr) return -1;
  }
  for (Py_ssize_t h = 0; h < held; ++h) {
    const int native = weak_free_now(refs[h].get());
    if (native < 0) return -1;
    if (native == 1) continue;
    if (free_ref.get() == nullptr) free_ref.reset(field(plan[kTorch], s->weak_free));
    Ref freed(free_ref.get() ? PyObject_CallOneArg(free_ref.get(), refs[h].get()) : nullptr);
    if (freed.get() == nullptr) return -1;
  }
  return 1;
}

// TreeManager.new_step where the step that ends leaves nothing Python must decide: no tree retired
// in it, no graphed callable collected since the last step, and every output of its path either a
// base the caller dropped or a single output the caller holds, which is invalidated here
// (invalidate_held). Makes Walk.end_step's writes and returns 1; 0 (nothing changed) where Python
// must end the step; -1 a Python error.
}  // namespace

int end_step_natively(PyObject* tree, PyObject* walk, PyObject* leaves, PyObject* const* plan, Names* s) {
  Ref retired(field(walk, s->retired));
  Ref seen(retired.get() ? field(tree, s->collected_seen) : nullptr);
  if (seen.get() == nullptr) return -1;
  if (!PyList_Check(retired.get()) || PyList_GET_SIZE(retired.get()) != 0 || !PyList_Check(plan[kCollected])) {
    return 0;
  }
  const Py_ssize_t n = PyLong_AsSsize_t(seen.get());
  if (n < 0 && PyErr_Occurred()) return -1;
  if (n != PyList_GET_SIZE(plan[kCollected])) return 0;
  Ref path(field(walk, s->path));
  if (path.get() == nullptr) return -1;
  if (!PyList_Check(path.get())) return 0;
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(path.get()); ++i) {
    const int dropped = base_dropped(PyList_GET_ITEM(path.get(), i), plan, s);
    if (dropped < 0) return -1;
    if (dropped == 0) {  // (an output the caller may hold: the rest of the path decided there)
      const int done = invalidate_held(path.get(), i, leaves, plan, s);
      if (done <= 0) return done;
      break;
    }
  }
  const Py_ssize_t depth = PyList_GET_SIZE(path.get());
  if (depth > 0 && set_field(walk, s->last_replayed, PyList_GET_ITEM(path.get(), depth - 1)) < 0) return -1;
  Ref fresh(PyList_New(0));
  Ref root(fresh.get() ? field(walk, s->root) : nullptr);
  if (root.get() == nullptr || set_field(walk, s->path, fresh.get()) < 0 ||
      set_field(walk, s->current, root.get()) < 0 || set_field(walk, s->warming, Py_False) < 0) {
    return -1;
  }
  Ref called(field(walk, s->called));
  if (called.get() == nullptr || !PySet_Check(called.get()) || PySet_Clear(called.get()) < 0) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "graphtree: Walk.called is not a set");
    return -1;
  }
  if (set_field(walk, s->step_requested, Py_False) < 0) return -1;
  Ref generation(field(walk, s->generation));
  Ref next(generation.get() ? PyNumber_Add(generation.get(), one()) : nullptr);
  return next.get() == nullptr || set_field(walk, s->generation, next.get()) < 0 ? -1 : 1;
}

}  // namespace graphtree_native::fast
