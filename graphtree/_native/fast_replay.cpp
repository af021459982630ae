// The fast hit's native twin (tree/fast_hit.py: FastHit.replay is its Python twin; issue 47): a
// signature's last replay made again in one call, after every check the Python path's answer
// depended on. Built with fastpath.cpp into the same module (graphtree/_native/__init__.py), whose
// ambient, copy_in and addresses_unchanged it calls; only the CPython API is used here.

#include "fast_hit.h"

#include <cstddef>
#include <initializer_list>

namespace graphtree_native {
PyObject* ambient_now();
PyObject* copy_in_now(PyObject* const* args);
PyObject* addresses_unchanged_now(PyObject* const* args);
PyObject* signature_now(PyObject* const* args);
int launch_now(PyObject* exec, PyObject* device, PyObject* stream);
PyObject* detach_now(PyObject* t);
int single_output_now(PyObject* single, PyObject* device, PyObject** tensor, PyObject** ref);  // outputs.cpp
PyObject* fast_replay(PyObject*, PyObject* const* args, Py_ssize_t nargs);
PyObject* fast_call(PyObject*, PyObject* const* args, Py_ssize_t nargs);
PyObject* fast_field(PyObject*, PyObject* const* args, Py_ssize_t nargs);
}  // namespace graphtree_native

namespace {

using graphtree_native::addresses_unchanged_now;
using graphtree_native::ambient_now;
using graphtree_native::signature_now;
using graphtree_native::copy_in_now;
using graphtree_native::detach_now;
using graphtree_native::launch_now;
using graphtree_native::single_output_now;
using namespace graphtree_native::fast;  // NOLINT: the shared definitions (fast_hit.h)
// GraphedCallable.takes_python_path(needs_grad), read here where its answer needs no Python: 1
// where a call of tensors alone goes anywhere but its tree's replay (debug snapshots, disabled,
// buckets, closure tensors followed, a training step, an autograd graph to build), 0 where it
// does not, -1 a Python error. A module's call under grad mode with no input that needs grad asks
// the method itself (its parameters' requires_grad).
int takes_python_path(PyObject* gc, PyObject* needs_grad, PyObject* const* plan, Names* s) {
  for (PyObject* name : {s->snapshots, s->disabled_reason, s->bucketing}) {
    const int set = attr_set(gc, name);
    if (set != 0) return set;
  }
  Ref reach(field(gc, s->reach));
  const int follows = reach.get() ? attr_true(reach.get(), s->cells) : -1;
  if (follows != 0) return follows;
  Ref step(field(gc, s->step));
  if (step.get() == nullptr) return -1;
  if (step.get() != Py_None) {
    const int trains = attr_true(step.get(), s->trains);
    if (trains != 0) return trains;
  }
  Ref grad(PyObject_CallNoArgs(plan[kGradEnabled]));
  if (grad.get() == nullptr) return -1;
  if (grad.get() != Py_True) return 0;  // (no_grad, inference_mode: the common loop)
  const int off_inside = attr_true(gc, s->grad_off_inside);
  if (off_inside != 0) return off_inside < 0 ? -1 : 0;
  if (needs_grad == Py_True) return 1;
  const int forward = attr_true(gc, s->forward);
  if (forward <= 0) return forward;
  Ref off(PyObject_CallMethodOneArg(gc, s->takes_python_path, needs_grad));
  return off.get() == nullptr ? -1 : off.get() != Py_False;
}

// reach.FreeValues.part() where its answer is its cached part: the values the code reads, each read
// from an exact dict (globals, an object's __dict__), all the very objects of the last call, no
// module registered since its structure was read. Anything else (a value rebound, a closure's cell,
// the first call, a restructure) calls part() itself, the reference. A new reference.
PyObject* reads_part(PyObject* free, PyObject* const* plan, Names* s) {
  Ref reads(field(free, s->reads_));
  Ref structure(reads.get() ? field(free, s->structure) : nullptr);
  Ref cache(structure.get() ? field(free, s->cache) : nullptr);
  if (cache.get() == nullptr) return nullptr;
  auto python = [&] { return PyObject_CallMethodNoArgs(free, s->part); };
  if (!PyList_Check(reads.get()) || PyList_GET_SIZE(reads.get()) == 0 || !PyList_Check(structure.get()) ||
      !PyTuple_Check(cache.get()) || PyTuple_GET_SIZE(cache.get()) != 2) {
    return python();
  }
  if (PyList_GET_SIZE(structure.get()) > 0) {  // (a module registered since: part() reads the structure again)
    Ref epoch(field(free, s->epoch_));
    PyObject* cell = plan[kEpochCell];
    if (epoch.get() == nullptr) return nullptr;
    if (!PyList_Check(cell) || PyList_GET_SIZE(cell) < 1) return python();
    const int same = PyObject_RichCompareBool(PyList_GET_ITEM(cell, 0), epoch.get(), Py_EQ);
    if (same < 0) return nullptr;
    if (!same) return python();
  }
  PyObject* last = PyTuple_GET_ITEM(cache.get(), 0);
  PyObject* cached = PyTuple_GET_ITEM(cache.get(), 1);
  const Py_ssize_t n = PyList_GET_SIZE(reads.get());
  if (cached == Py_None || !PyList_Check(last) || PyList_GET_SIZE(last) != n) return python();
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* read = PyList_GET_ITEM(reads.get(), i);  // (namespace, name, label)
    if (!PyTuple_Check(read) || PyTuple_GET_SIZE(read) != 3 || !PyDict_CheckExact(PyTuple_GET_ITEM(read, 0))) {
      return python();
    }
    PyObject* now = PyDict_GetItemWithError(PyTuple_GET_ITEM(read, 0), PyTuple_GET_ITEM(read, 1));  // (borrowed)
    if (now == nullptr && PyErr_Occurred()) return nullptr;
    if (now != PyList_GET_ITEM(last, i)) return python();  // (gone or rebound: part() decides)
  }
  return Py_NewRef(cached);
}

// LaunchOrder.unchanged: 1 where the current stream is the last call's (nothing to order), 0 where
// it is another, -1 a Python error. `stream` gets the current raw stream (None without CUDA), which
// the replay's copy and launch then use.
int order_unchanged(PyObject* tree, Names* s, Ref& stream) {
  Ref order(field(tree, s->order));
  Ref stream_of(order.get() ? field(order.get(), s->raw_stream) : nullptr);
  if (stream_of.get() == nullptr) return -1;
  if (stream_of.get() == Py_None) {  // (a build without CUDA: no streams to order)
    stream.reset(Py_NewRef(Py_None));
    return 1;
  }
  Ref device(field(order.get(), s->device));
  stream.reset(device.get() ? PyObject_CallOneArg(stream_of.get(), device.get()) : nullptr);
  Ref last(stream.get() ? field(order.get(), s->last_raw) : nullptr);
  return last.get() == nullptr ? -1 : PyObject_RichCompareBool(stream.get(), last.get(), Py_EQ);
}

// OutputLiveness.hand_out's second case where the CUDA part is built: a single output built anew on
// its pool memory (single_output_now) where the last step's output was released (every weak
// reference 0) and no base is to be kept. 1 with `out` set, 0 where the Python twin hands it out,
// -1 an error.
int hand_out_single(PyObject* live, PyObject* device, Names* s, Ref& out) {
  const int keep = attr_true(live, s->keep_base);
  if (keep != 0) return keep < 0 ? -1 : 0;
  Ref single(field(live, s->single));
  Ref refs(single.get() ? field(live, s->refs) : nullptr);
  if (refs.get() == nullptr) return -1;
  if (single.get() == Py_None || !PyList_Check(refs.get())) return 0;
  for (Py_ssize_t i = 0; i < PyList_GET_SIZE(refs.get()); ++i) {
    const int set = PyObject_IsTrue(PyList_GET_ITEM(refs.get(), i));
    if (set != 0) return set < 0 ? -1 : 0;  // (a reference to free first: the twin frees it)
  }
  PyObject *tensor = nullptr, *ref = nullptr;
  const int built = single_output_now(single.get(), device, &tensor, &ref);
  if (built <= 0) return built;
  Ref t(tensor), r(ref);
  Ref now(PyList_New(1));
  if (now.get() == nullptr) return -1;
  PyList_SET_ITEM(now.get(), 0, r.release());
  if (set_field(live, s->refs, now.get()) < 0) return -1;
  out.reset(t.release());
  return 1;
}

// The replay's copy-in, launch and outputs (Node.replay, with Node.hand_out's bookkeeping) on the
// current raw stream `stream` (None without CUDA), any RuntimeError handed to tree.raise_replay_error
// as TreeManager.call hands it.
PyObject* replay_node(PyObject* gc, PyObject* tree, PyObject* node, PyObject* const* plan, PyObject* leaves,
                      PyObject* stream, Names* s) {
  Ref n(PyLong_FromSsize_t(PySequence_Size(leaves)));
  Ref out;
  [&] {
    if (n.get() == nullptr) return;
    Ref inputs(field(node, s->inputs));
    Ref copies(inputs.get() ? field(inputs.get(), s->native) : nullptr);
    if (copies.get() == nullptr) return;
    bool copied = false;
    if (copies.get() != Py_None && stream != Py_None && PyTuple_Check(copies.get()) &&
        PyTuple_GET_SIZE(copies.get()) == 3 && PySequence_Size(PyTuple_GET_ITEM(copies.get(), 0)) == 0) {
      PyObject* a[4] = {stream, leaves, PyTuple_GET_ITEM(copies.get(), 1), PyTuple_GET_ITEM(copies.get(), 2)};
      Ref done(copy_in_now(a));
      if (done.get() == nullptr) return;
      copied = done.get() == Py_True;
    }
    if (!copied) {  // (host fills, a leaf the plan does not expect, no CUDA runtime: the Python twin)
      Ref r(PyObject_CallMethodObjArgs(inputs.get(), s->copy_in, leaves, n.get(), nullptr));
      if (r.get() == nullptr) return;
    }
    // A graph that draws nothing is launched here (Node.exec); any other, or another current
    // device, through the node's launcher (torch's replay, or launch_drawing for one that draws).
    Ref exec(field(node, s->exec));
    if (exec.get() == nullptr) return;
    const int launched = stream != Py_None ? launch_now(exec.get(), plan[kDevice], stream) : 0;
    if (launched < 0) return;
    if (launched == 0) {
      Ref launch(field(node, s->launch));
      Ref done(launch.get() ? PyObject_CallNoArgs(launch.get()) : nullptr);
      if (done.get() == nullptr) return;
    }
    const int writes = attr_true(node, s->writes), grads = writes ? attr_true(node, s->grads) : 0;
    if (writes < 0 || grads < 0) return;
    if (writes || grads) {  // (what the call writes besides its outputs: Node.hand_out)
      out.reset(PyObject_CallMethodObjArgs(node, s->hand_out, leaves, n.get(), nullptr));
      return;
    }
    Ref count(field(node, s->replays));
    Ref more(count.get() ? PyNumber_Add(count.get(), one()) : nullptr);
    if (more.get() == nullptr || set_field(node, s->replays, more.get()) < 0) return;
    Ref live(field(node, s->live));
    Ref base(live.get() ? field(live.get(), s->base) : nullptr);
    if (base.get() == nullptr) return;
    if (base.get() != Py_None) {  // (OutputLiveness.hand_out's first case: a base the caller dropped)
      out.reset(detach_now(base.get()));
      return;
    }
    if (hand_out_single(live.get(), plan[kDevice], s, out) != 0) return;  // (-1: out stays null)
    out.reset(PyObject_CallMethodObjArgs(live.get(), s->hand_out, leaves, n.get(), nullptr));
  }();
  if (out.get() == nullptr && PyErr_ExceptionMatches(PyExc_RuntimeError)) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb != nullptr) PyException_SetTraceback(value, tb);
    Ref t(type), v(value), b(tb);
    Ref raised(PyObject_CallMethodObjArgs(tree, s->raise_replay_error, gc, node, value, nullptr));
    if (raised.get() != nullptr) {  // (it always raises)
      PyErr_SetString(PyExc_RuntimeError, "graphtree: raise_replay_error returned");
    }
    return nullptr;
  }
  return out.release();
}

}  // namespace

namespace graphtree_native {

// fast_replay(gc, plan, leaves, needs_grad) -> outputs | plan[0] (MISS): FastHit.replay's checks
// and, where every one holds, TreeManager.call's writes in its order (see tree/fast_hit.py).
// Nothing is changed before the last check; the Python path, the reference, runs the call on MISS.
// The plan holds the tree, the node and its parent weakly: one gone is a MISS.
PyObject* fast_replay(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if (nargs != 4 || !PyTuple_Check(args[1]) || PyTuple_GET_SIZE(args[1]) != kPlanSize) {
    PyErr_SetString(PyExc_TypeError, "fast_replay(gc, plan: tuple, leaves, needs_grad)");
    return nullptr;
  }
  Names* s = names();
  if (s == nullptr) return nullptr;
  PyObject* const* plan = &PyTuple_GET_ITEM(args[1], 0);
  PyObject *gc = args[0], *leaves = args[2], *miss = plan[kMiss];
  auto missed = [&]() {
    Py_INCREF(miss);
    return miss;
  };
  Ref node_ref(alive(plan[kNode]));
  PyObject* node = node_ref.get();
  if (node == nullptr) return missed();
  // What the callable answers (debug, disabled, buckets, closure tensors, a training step, autograd).
  const int off = takes_python_path(gc, args[3], plan, s);
  if (off != 0) return off < 0 ? nullptr : missed();
  // Hooks registered or parameters registered since (tree/hooks.py decides again), the models it calls.
  Ref made(field(plan[kHandleClass], s->next_id));
  if (made.get() == nullptr) return nullptr;
  int same = PyObject_RichCompareBool(made.get(), plan[kHandles], Py_EQ);
  if (same <= 0) return same < 0 ? nullptr : missed();
  PyObject* cell = plan[kEpochCell];
  if (!PyList_Check(cell) || PyList_GET_SIZE(cell) < 1) return missed();
  same = PyObject_RichCompareBool(PyList_GET_ITEM(cell, 0), plan[kEpoch], Py_EQ);
  if (same <= 0) return same < 0 ? nullptr : missed();
  Ref models(field(plan[kFree], s->models));
  if (models.get() == nullptr) return nullptr;
  if (models.get() != plan[kModels]) return missed();
  // The ambient state, the module's mode, the values its code reads.
  Ref now(ambient_now());
  if (now.get() == nullptr) {  // (torch's fp32_precision API in use: ambient.py reads it in Python)
    PyErr_Clear();
    return missed();
  }
  same = PyObject_RichCompareBool(now.get(), plan[kAmbient], Py_EQ);
  if (same <= 0) return same < 0 ? nullptr : missed();
  if (plan[kModule] != Py_None) {
    Ref training(field(plan[kModule], s->training));
    if (training.get() == nullptr) return nullptr;
    if (training.get() != plan[kTraining]) return missed();
  }
  const int active = attr_true(plan[kFree], s->active);
  if (active < 0) return nullptr;
  Ref reads(active ? reads_part(plan[kFree], plan, s) : Py_NewRef(Py_None));
  if (reads.get() == nullptr) return nullptr;
  if (reads.get() != plan[kReads]) return missed();
  // This thread's tree, and whether it may start a step by itself.
  Ref here(field(plan[kThreadState], s->dict));
  if (here.get() == nullptr || !PyDict_Check(here.get())) return here.get() ? missed() : nullptr;
  PyObject* managers = PyDict_GetItemWithError(here.get(), s->managers);
  if (managers == nullptr || !PyDict_Check(managers)) return PyErr_Occurred() ? nullptr : missed();
  PyObject* tree = PyDict_GetItemWithError(managers, plan[kDevice]);
  if (tree == nullptr) return PyErr_Occurred() ? nullptr : missed();
  Ref tree_then(alive(plan[kTree]));
  if (tree != tree_then.get()) return missed();
  PyObject* depth = PyDict_GetItemWithError(here.get(), s->one_step);
  if (depth == nullptr && PyErr_Occurred()) return nullptr;
  const int inside = depth == nullptr ? 0 : PyObject_IsTrue(depth);
  if (inside < 0) return nullptr;
  Ref lock(field(tree, s->lock));
  if (lock.get() == nullptr) return nullptr;
  Ref taken(PyObject_CallMethodNoArgs(lock.get(), s->acquire));
  if (taken.get() == nullptr) return nullptr;
  struct Unlock {
    PyObject* lock;
    PyObject* name;
    ~Unlock() {
      PyObject *t, *v, *b;
      PyErr_Fetch(&t, &v, &b);
      Py_XDECREF(PyObject_CallMethodNoArgs(lock, name));
      PyErr_Restore(t, v, b);
    }
  } unlock{lock.get(), s->release};
  // The step, the node's place, the node first among its key's recordings, its checks, the stream.
  Ref walk(field(tree, s->walk));
  Ref path(walk.get() ? field(walk.get(), s->path) : nullptr);
  if (path.get() == nullptr) return nullptr;
  if (!PyList_Check(path.get())) return missed();
  const Py_ssize_t max_depth = PyLong_AsSsize_t(plan[kMaxPath]);
  if (max_depth < 0 && PyErr_Occurred()) return nullptr;
  if (PyList_GET_SIZE(path.get()) >= max_depth) return missed();
  const int requested = attr_true(walk.get(), s->step_requested), users = attr_true(tree, s->user_steps);
  if (requested < 0 || users < 0) return nullptr;
  Ref called(field(walk.get(), s->called));
  if (called.get() == nullptr) return nullptr;
  if (!PySet_Check(called.get())) return missed();
  const int in_step = PySet_Contains(called.get(), plan[kGcId]);
  if (in_step < 0) return nullptr;
  const bool new_step = requested || (!users && in_step && !inside);
  Ref parent;
  if (new_step) {
    parent.reset(field(walk.get(), s->root));
  } else {
    const int warming = attr_true(walk.get(), s->warming);
    if (warming != 0) return warming < 0 ? nullptr : missed();
    parent.reset(field(walk.get(), s->current));
  }
  if (parent.get() == nullptr) return nullptr;
  Ref parent_then(alive(plan[kParent]));
  if (parent.get() != parent_then.get()) return missed();
  Ref first(field(node, s->first));
  if (first.get() == nullptr) return nullptr;
  if (first.get() != Py_None) return missed();
  Ref children(field(parent.get(), s->children));
  if (children.get() == nullptr) return nullptr;
  if (!PyDict_Check(children.get())) return missed();
  PyObject* kids = dict_item(children.get(), plan[kChildKey], plan[kChildHash]);
  if (kids == nullptr || !PyList_Check(kids) || PyList_GET_SIZE(kids) == 0 || PyList_GET_ITEM(kids, 0) != node) {
    return PyErr_Occurred() ? nullptr : missed();
  }
  Ref stream;  // (the current raw stream: the replay's copy and launch go on it)
  const int unchanged = order_unchanged(tree, s, stream);
  if (unchanged <= 0) return unchanged < 0 ? nullptr : missed();
  const int unconditional = attr_true(node, s->unconditional);
  if (unconditional < 0) return nullptr;
  if (!unconditional) {
    const int statics_only = attr_true(node, s->statics_only);
    if (statics_only <= 0) return statics_only < 0 ? nullptr : missed();
    Ref epoch(field(node, s->epoch));
    if (epoch.get() == nullptr) return nullptr;
    same = PyObject_RichCompareBool(epoch.get(), plan[kEpoch], Py_EQ);
    if (same <= 0) return same < 0 ? nullptr : missed();
    Ref statics(field(node, s->statics)), packed(field(node, s->static_packed));
    if (statics.get() == nullptr || packed.get() == nullptr) return nullptr;
    PyObject* a[2] = {statics.get(), packed.get()};
    Ref fits(addresses_unchanged_now(a));
    if (fits.get() == nullptr) return nullptr;
    if (fits.get() != Py_True) return missed();
  }
  // From here on, what TreeManager.call writes, in its order.
  Ref stepped;
  if (new_step) {
    const int quiet = end_step_natively(tree, walk.get(), leaves, plan, s);
    if (quiet < 0) return nullptr;
    if (quiet == 0) {  // (a base held, a tree retired, a callable collected...: TreeManager.new_step)
      stepped.reset(PyObject_CallMethodOneArg(tree, s->new_step, leaves));
      if (stepped.get() == nullptr) return nullptr;
      leaves = stepped.get();
    }
  }
  if (PySet_Add(called.get(), plan[kGcId]) < 0) return nullptr;
  Ref memory(field(tree, s->memory));
  if (memory.get() == nullptr || set_field(memory.get(), s->live, Py_False) < 0) return nullptr;
  Ref out(replay_node(gc, tree, node, plan, leaves, stream.get(), s));
  if (out.get() == nullptr) return nullptr;
  Ref entered(field(walk.get(), s->path));  // (a new list when the step began)
  if (entered.get() == nullptr || PyList_Append(entered.get(), node) < 0) return nullptr;
  if (set_field(walk.get(), s->current, node) < 0) return nullptr;
  Ref counters(field(tree, s->counters));
  Ref count(counters.get() ? field(counters.get(), s->replays) : nullptr);
  Ref more(count.get() ? PyNumber_Add(count.get(), one()) : nullptr);
  if (more.get() == nullptr || set_field(counters.get(), s->replays, more.get()) < 0) return nullptr;
  if (set_field(tree, s->hit, node) < 0) return nullptr;
  return out.release();
}

// The signature's parts with each float keyed as graphtree.tree.numbers.Numbers.rekey keys it:
// `float_part` (a device scalar's part) unless the callable keys that position by value
// (gc.numbers.by_value, read only when a float is there). A new reference: `parts` itself where
// nothing changed, nullptr on error.
PyObject* floats_keyed(PyObject* gc, PyObject* parts, PyObject* float_part, Names* s) {
  const Py_ssize_t n = PyTuple_GET_SIZE(parts);
  Ref out;
  Ref by_value;
  for (Py_ssize_t i = 0; i < n; ++i) {
    PyObject* p = PyTuple_GET_ITEM(parts, i);
    if (!PyTuple_Check(p) || PyTuple_GET_SIZE(p) != 2 ||
        PyTuple_GET_ITEM(p, 0) != reinterpret_cast<PyObject*>(&PyFloat_Type)) {
      continue;
    }
    if (by_value.get() == nullptr) {
      Ref numbers(field(gc, s->numbers));
      by_value.reset(numbers.get() ? field(numbers.get(), s->by_value) : nullptr);
      if (by_value.get() == nullptr) return nullptr;
    }
    Ref index(PyLong_FromSsize_t(i));
    const int kept = index.get() ? PySequence_Contains(by_value.get(), index.get()) : -1;
    if (kept < 0) return nullptr;
    if (kept) continue;  // (keyed by its value, as the Python path keys it)
    if (out.get() == nullptr) {  // (a copy: the parts are the signature's)
      out.reset(PyTuple_New(n));
      if (out.get() == nullptr) return nullptr;
      for (Py_ssize_t k = 0; k < n; ++k) PyTuple_SET_ITEM(out.get(), k, Py_NewRef(PyTuple_GET_ITEM(parts, k)));
    }
    if (PyTuple_SetItem(out.get(), i, Py_NewRef(float_part)) < 0) return nullptr;  // (drops the float's part)
  }
  return out.get() != nullptr ? out.release() : Py_NewRef(parts);
}

// fast_call(gc, hits, args, plain_types, miss, threads, float_part[, signature]) -> outputs | miss:
// tree/fast_hit.py's replay_again in one call: the call's signature (the same `signature`
// graphtree.tree.inputs keys by; `signature`, where given, a stand-in for it: tests on CPU
// tensors) with its floats keyed as device scalars where the callable keys them so (`float_part`:
// their part; None keeps them by value), its fast hit in `hits` by those parts, their device and
// the calling thread's tree there (`threads`: manager.thread_state(), as tree_here reads it), and
// that hit's fast_replay. `miss` where the call is not one of tensors and floats alone, the thread
// has no tree on the device, no hit is kept for it, or the hit's replay missed.
PyObject* fast_call(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if ((nargs != 7 && nargs != 8) || !PyDict_Check(args[1]) || !PyTuple_Check(args[2]) || !PyTuple_Check(args[3])) {
    PyErr_SetString(PyExc_TypeError,
                    "fast_call(gc, hits: dict, args: tuple, plain_types: tuple, miss, threads, float_part[, signature])");
    return nullptr;
  }
  PyObject* miss = args[4];
  Names* s = names();
  if (s == nullptr) return nullptr;
  PyObject* sig_args[2] = {args[2], args[3]};
  Ref sig(nargs == 8 && args[7] != Py_None ? PyObject_Vectorcall(args[7], sig_args, 2, nullptr)
                                           : signature_now(sig_args));
  if (sig.get() == nullptr) return nullptr;
  if (sig.get() == Py_None || !PyTuple_Check(sig.get()) || PyTuple_GET_SIZE(sig.get()) != 3) return Py_NewRef(miss);
  PyObject* device = PyTuple_GET_ITEM(sig.get(), 1);
  PyObject* parts = PyTuple_GET_ITEM(sig.get(), 0);
  Ref keyed(args[6] != Py_None && PyTuple_Check(parts) ? floats_keyed(args[0], parts, args[6], s) : Py_NewRef(parts));
  if (keyed.get() == nullptr) return nullptr;
  Ref here(field(args[5], s->dict));
  if (here.get() == nullptr) return nullptr;
  PyObject* managers = PyDict_Check(here.get()) ? PyDict_GetItemWithError(here.get(), s->managers) : nullptr;
  PyObject* tree = managers != nullptr && PyDict_Check(managers) ? PyDict_GetItemWithError(managers, device) : nullptr;
  if (tree == nullptr) return PyErr_Occurred() ? nullptr : Py_NewRef(miss);
  Ref tree_id(PyLong_FromVoidPtr(tree));  // (id(tree), as fast_hit.remember keys it)
  Ref key(tree_id.get() ? PyTuple_Pack(3, keyed.get(), device, tree_id.get()) : nullptr);
  if (key.get() == nullptr) return nullptr;
  PyObject* hit = PyDict_GetItemWithError(args[1], key.get());  // (borrowed)
  if (hit == nullptr) return PyErr_Occurred() ? nullptr : Py_NewRef(miss);
  Ref held(Py_NewRef(hit));  // (the dict may lose it while the replay runs Python)
  Ref plan(field(hit, s->plan));
  if (plan.get() == nullptr) {  // (a signature given up: no plan)
    if (!PyErr_ExceptionMatches(PyExc_AttributeError)) return nullptr;
    PyErr_Clear();
    return Py_NewRef(miss);
  }
  PyObject* replay_args[4] = {args[0], plan.get(), args[2], PyTuple_GET_ITEM(sig.get(), 2)};
  return fast_replay(nullptr, replay_args, 4);
}

// fast_field(obj, name[, value]) -> obj.name, or None having set obj.name = value: the fast hit's
// own attribute read and write (fast_hit.h: field, set_field), for tests to hold them to getattr's
// and setattr's answers (a slot, an instance dict, a property, a class changed since).
PyObject* fast_field(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  if ((nargs != 2 && nargs != 3) || !PyUnicode_CheckExact(args[1])) {
    PyErr_SetString(PyExc_TypeError, "fast_field(obj, name: str[, value])");
    return nullptr;
  }
  PyObject* name = Py_NewRef(args[1]);
  PyUnicode_InternInPlace(&name);  // (interned, as the hit's names are, and kept: the table keys names by pointer)
  if (nargs == 2) return field(args[0], name);
  if (set_field(args[0], name, args[2]) < 0) return nullptr;
  Py_RETURN_NONE;
}

}  // namespace graphtree_native
