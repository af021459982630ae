// The CUDA part of graphtree's native helpers (see DESIGN.md beside this file, "The CUDA part"):
// random draws in captures and their replays on torch before 2.12, through torch's CUDA internals
// (the default generator's state, CUDAGraph). Compiled only with -DGRAPHTREE_CUDA (a CUDA torch
// with CUDA's headers); without it this file is empty. Built with fastpath.cpp into one module,
// whose method table lists these functions.

#ifdef GRAPHTREE_CUDA
#include <Python.h>

#include <ATen/cuda/CUDAGeneratorImpl.h>
#include <ATen/cuda/CUDAGraph.h>
#include <ATen/ops/from_blob.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/SmallVector.h>
#include <torch/csrc/Generator.h>
#include <torch/csrc/utils/pybind.h>

#include <dlfcn.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <mutex>

namespace graphtree_native {
void* runtime_symbol(const char* name);            // fastpath.cpp
PyObject* raise_cuda_error(int err, const char* what);  // fastpath.cpp
}  // namespace graphtree_native

namespace {

using graphtree_native::raise_cuda_error;
using graphtree_native::runtime_symbol;

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

// The Philox state of the stand-in generator `standin` (a torch.Generator) in the capture under way,
// read under its mutex into `state`: its generator, or nullptr with a RuntimeError naming `who` where
// the stand-in is not being captured.
at::CUDAGeneratorImpl* captured_state(PyObject* standin, const char* who, at::PhiloxCudaState& state) {
  at::Generator gen = reinterpret_cast<THPGenerator*>(standin)->cdata;
  auto* impl = at::check_generator<at::CUDAGeneratorImpl>(gen);
  {
    std::lock_guard<std::mutex> lock(gen.mutex());
    state = impl->philox_cuda_state(0);
  }
  if (!state.captured_) {
    PyErr_Format(PyExc_RuntimeError, "%s: the stand-in is not being captured", who);
    return nullptr;
  }
  return impl;
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
    at::PhiloxCudaState state;
    if (captured_state(args[0], "standin_slots", state) == nullptr) return nullptr;
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
    at::PhiloxCudaState state;
    at::CUDAGeneratorImpl* impl = captured_state(args[0], "standin_seal", state);
    if (impl == nullptr) return nullptr;
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
        return raise_cuda_error(err, "write of a generator's seed and offset for a replay");
      }
    }
    const int err = graph_launch(d->exec, stream);
    if (err != 0) {
      forget();
      return raise_cuda_error(err, "cudaGraphLaunch of a recording that draws");
    }
    Py_RETURN_NONE;
  });
}

}  // namespace

namespace graphtree_native {
// This file's entries in the module's method table (fastpath.cpp joins the tables).
extern const PyMethodDef draws_methods[] = {
    {"capture_begin_isolated", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)(void)>(capture_begin_isolated)), METH_FASTCALL,
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
    {nullptr, nullptr, 0, nullptr},
};
}  // namespace graphtree_native
#endif  // GRAPHTREE_CUDA
