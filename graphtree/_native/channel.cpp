// graphtree.share's channel in C++ (see DESIGN.md beside this file): a producer's choice of the slot
// to write next (`channel_take`), the stores that publish it (`channel_publish`) and a graphed
// writer's whole call (`channel_write`), on the control block's int64 cells with atomic loads and
// stores. Built with fastpath.cpp into one module, whose method table lists them; the CPython API alone.

#include <Python.h>

#include <cstdint>
#include <cstring>

namespace {

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

}  // namespace

namespace graphtree_native {
// This file's entries in the module's method table (fastpath.cpp joins the tables).
extern const PyMethodDef channel_methods[] = {
    {"channel_take", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(channel_take)), METH_FASTCALL,
     "channel_take(cells, state, plans) -> int"},
    {"channel_publish", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(channel_publish)), METH_FASTCALL,
     "channel_publish(cells, state, publishing) -> int"},
    {"channel_write", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(channel_write)), METH_FASTCALL,
     "channel_write(writer, args, kwargs) -> result"},
    {nullptr, nullptr, 0, nullptr},
};
}  // namespace graphtree_native
