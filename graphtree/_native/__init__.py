"""graphtree's native helpers: the replay fast path's per-tensor loops in C++, built on first use.

What they do and why they are native: ``DESIGN.md`` beside this file. Each has a Python twin
that graphtree uses until the build is ready, and for good when it cannot be built (no C++
compiler, no ``ninja``, ``GRAPHTREE_NATIVE=0``): the results are the same, only the cost per
call differs.

The build runs once per torch version and Python (about 15 s on two cores), in a child process
waited on by a background thread started by the first CUDA tree (or CUDA ``graphtree.share``
channel), through
``torch.utils.cpp_extension.load`` into torch's extension cache (``TORCH_EXTENSIONS_DIR``, by
default ``~/.cache/torch_extensions``); later processes load the cached library in under a
second. ``python -m graphtree._native`` builds it ahead of time. ``graphtree doctor`` says which
state it is in.

Example::

    from graphtree import _native

    _native.start()                 # what the first CUDA tree does
    helpers = _native.wait(60)      # the module, or None (then _native.status() says why)
"""

from __future__ import annotations

import array
import hashlib
import importlib.util
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import ModuleType

log = logging.getLogger("graphtree")

# (fastpath.cpp holds the module's table and joins the others'; draws.cpp and outputs.cpp have their
# functions in the CUDA part only)
_SOURCES = [
    Path(__file__).with_name(f)
    for f in (
        "fastpath.cpp", "keys.cpp", "channel.cpp", "draws.cpp", "outputs.cpp", "fast_replay.cpp", "entries.cpp",
        "step_end.cpp",
    )
]  # fmt: skip
_HEADERS = [Path(__file__).with_name("fast_hit.h")]
_ENV = "GRAPHTREE_NATIVE"

loaded: ModuleType | None = None
"""The built module once it is ready (read on the hot path: a plain module attribute); None while
it builds, where it cannot be built, and with ``GRAPHTREE_NATIVE=0``."""

capture: ModuleType | None = None
"""The built module where it has the CUDA part (torch before 2.12: captures that keep the
generators out, so that other threads' random ops keep working, ``tree/draws.py``), whether or not
``GRAPHTREE_NATIVE=0`` turns the call path's helpers off: that switch runs the call's Python path,
and must not make another thread's random op fail during a capture."""

_lock = threading.Lock()
_done = threading.Event()
_thread: threading.Thread | None = None
_status = "not started"


def disabled() -> bool:
    """Whether ``GRAPHTREE_NATIVE=0`` (or ``off``/``false``/``no``) turns the helpers off."""
    return os.environ.get(_ENV, "").strip().lower() in ("0", "off", "false", "no")


def start() -> None:
    """Build or load the helpers in a background thread, once per process; returns at once."""
    global _thread, _status
    with _lock:
        if _thread is not None or _done.is_set():
            return
        _status = "building"
        _thread = threading.Thread(target=_build, name="graphtree-native-build", daemon=True)
        _thread.start()


def wait(timeout: float | None = None) -> ModuleType | None:
    """Start the build if needed and wait up to ``timeout`` seconds: the module, or ``None``."""
    start()
    _done.wait(timeout)
    return loaded


def wait_capture(timeout: float | None = None) -> ModuleType | None:
    """:func:`wait` for :data:`capture`: the module with its CUDA part, or ``None``."""
    start()
    _done.wait(timeout)
    return capture


def status() -> str:
    """One line: built (where, how long it took), building, off, or why it is unavailable."""
    return _status


def _build() -> None:
    global loaded, capture, _status
    off = f"off ({_ENV}=0): address checks and call signatures run in Python"
    # Nothing a capture needs: no build. Decided in this thread, not the caller's: _cuda_flags
    # imports cpp_extension (~0.15 s on the CI machine).
    if disabled() and _cuda_flags() is None:
        _status = off
        _done.set()
        return
    t0 = time.perf_counter()
    try:
        path, compiled = _build_in_child()
        if compiled is not None:  # (once per torch version and Python: say what took the time)
            print(
                f"graphtree: compiled its native helpers in {compiled:.0f} s, in the background (once per torch "
                f"version and Python; cached in {Path(path).parent.parent})",
                file=sys.stderr,
            )
        spec = importlib.util.spec_from_file_location(Path(path).stem.split(".")[0], path)
        if spec is None or spec.loader is None:
            raise ImportError(f"cannot import {path}")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _check(module)
    except Exception as e:  # noqa: BLE001 - any failure (no compiler, no ninja, bad headers) means the Python path
        reason = str(e).strip().splitlines()[-1][:300] if str(e).strip() else type(e).__name__
        _status = f"unavailable ({type(e).__name__}: {reason}): address checks and call signatures run in Python"
        log.info("graphtree: native helpers %s", _status)
    else:
        capture = module if hasattr(module, "capture_begin_isolated") else None
        if disabled():
            _status = (
                f"{off}; its CUDA part, built ({Path(path).parent}), keeps other threads' random ops working"
                if capture is not None
                else f"{off}; its CUDA part failed to build (the builder's stderr says why)"
            )
        else:
            loaded = module
            _status = f"built ({Path(path).parent}, ready after {time.perf_counter() - t0:.1f} s)"
        log.debug("graphtree: native helpers %s", _status)
    finally:
        _done.set()


def _build_in_child() -> tuple[str, float | None]:
    """Build (or find built) in a child process of its own session; returns the library's path, and
    the seconds the build took where the child compiled it (None where it was cached).

    Not in this process: cpp_extension guards its build folder with a lock file that only the
    building process removes. A build in a daemon thread of a process that exits first (a short
    script) left the lock behind, and every later process then waited on it forever. The child
    finishes the build and removes the lock whatever this process does meanwhile (Ctrl-C in
    the terminal does not reach it either).
    """
    proc = subprocess.run(
        [sys.executable, "-m", "graphtree._native"],
        capture_output=True,
        text=True,
        timeout=1800,
        start_new_session=True,
        check=False,
    )
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        err = (proc.stderr.strip() or proc.stdout.strip() or f"exit status {proc.returncode}").splitlines()
        raise RuntimeError(err[-1])
    compiled = next((float(line.split()[1]) for line in lines[:-1] if line.startswith("compiled ")), None)
    return lines[-1], compiled


def build_here() -> str:
    """Build (or find built) the helpers in this process; the library's path. What the child runs.

    With CUDA's headers at hand and a torch before 2.12, the CUDA part is built too
    (``capture_begin_isolated``, see fastpath.cpp); should that fail, the rest is built without it.
    """
    from torch.utils import cpp_extension

    _find_ninja()

    # torch rebuilds an extension when a listed source or a flag changes, not a header: the headers'
    # digest goes in the flags
    headers = hashlib.sha256(b"".join(p.read_bytes() for p in _HEADERS)).hexdigest()[:16]

    # -DNDEBUG as setuptools builds extensions (Python's own CFLAGS): without it every
    # PyTuple_GET_ITEM and PyList_GET_ITEM checks its type again (a quarter of a parameter's
    # address check: DESIGN.md)
    def load(name: str, cflags: list[str], ldflags: list[str], include: list[str] | None) -> str:
        module = cpp_extension.load(
            name=name,
            sources=[str(p) for p in _SOURCES],
            extra_cflags=["-O2", "-DNDEBUG", f"-DGRAPHTREE_HEADERS_{headers}", *cflags],
            extra_ldflags=["-ldl", *ldflags],
            extra_include_paths=include,
            is_python_module=True,
            verbose=False,
        )
        return str(module.__file__)

    cuda = _cuda_flags()
    if cuda is not None:
        try:
            return load("graphtree_native_cuda", cuda["cflags"], cuda["ldflags"], cuda["include"])
        except Exception as e:  # noqa: BLE001 - the CUDA part is optional: build without it
            print(f"graphtree: native helpers without their CUDA part: {str(e).strip()[-300:]}", file=sys.stderr)
    return load("graphtree_native", [], [], None)


def _cuda_flags() -> dict[str, list[str]] | None:
    """Compiler and linker flags for the CUDA part, or None: no CUDA build of torch, no CUDA headers,
    or a torch (2.12 and later) whose CUDA generator keeps capture state per capture already."""
    import torch
    from torch.utils import cpp_extension

    home = cpp_extension.CUDA_HOME
    version = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    if torch.version.cuda is None or home is None or version >= (2, 12):
        return None
    include = os.path.join(home, "include")
    if not os.path.exists(os.path.join(include, "cuda_runtime_api.h")):
        return None
    lib = os.path.join(os.path.dirname(torch.__file__), "lib")
    return {
        "cflags": ["-DGRAPHTREE_CUDA"],
        "ldflags": [f"-L{lib}", "-ltorch_cuda", "-lc10_cuda", f"-Wl,-rpath,{lib}"],
        "include": [include],
    }


def _find_ninja() -> None:
    """cpp_extension runs ``ninja`` from PATH; the ``ninja`` wheel (a graphtree dependency) puts
    it in the environment's bin folder, which is not on PATH when Python is run by its full path
    without activating the environment: add that folder then."""
    if shutil.which("ninja") is not None:
        return
    try:
        import ninja
    except ImportError:
        return  # cpp_extension says "Ninja is required", which status() shows
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


class _Probe:
    """An object argument for :func:`_check`: one plain attribute."""

    def __init__(self) -> None:
        self.a = 1


def _check(module: ModuleType) -> None:
    """A built module must answer as its Python twins do before graphtree relies on it."""
    import torch

    from graphtree._torch.gate import tensor_impl, weak_free, weak_ref  # (not the package: it imports this one)

    ts = [torch.zeros(2), torch.nn.Parameter(torch.zeros(3))]
    ptrs = [t.data_ptr() for t in ts]
    if module.ptrs_equal(ts, ptrs, [0, 1]) is not True or module.ptrs_equal(ts, [0, ptrs[1]], [0, 1]) is not False:
        raise RuntimeError("ptrs_equal disagrees with Tensor.data_ptr()")
    impls = [tensor_impl(t) for t in ts]
    packed = array.array("Q", [impls[0], ptrs[0], impls[1], ptrs[1]]).tobytes()
    other = array.array("Q", [impls[0], ptrs[0], impls[1], 0]).tobytes()
    moved = array.array("Q", [impls[0], ptrs[0], 0, ptrs[1]]).tobytes()  # (another TensorImpl: read as data_ptr())
    if module.addresses_unchanged(ts, packed) is not True or module.addresses_unchanged(ts, other) is not False:
        raise RuntimeError("addresses_unchanged disagrees with Tensor.data_ptr()")
    if module.addresses_unchanged(ts, moved) is not True:
        raise RuntimeError("addresses_unchanged disagrees with Tensor.data_ptr() for a TensorImpl swapped")
    storage = torch.zeros(4).untyped_storage()
    ref = weak_ref(storage)
    try:
        refs, at = array.array("Q", [ref]).tobytes(), array.array("Q", [storage.data_ptr()]).tobytes()
        if module.weak_unchanged(refs, at) is not True or module.weak_unchanged(refs, bytes(8)) is not False:
            raise RuntimeError("weak_unchanged disagrees with UntypedStorage.data_ptr()")
        del storage
        if module.weak_unchanged(refs, at) is not False:
            raise RuntimeError("weak_unchanged reads a freed storage as alive")
    finally:
        weak_free(ref)
    if module.signature((1, None), (int, type(None))) != (((int, 1), (type(None), None)), -2, False):
        raise RuntimeError("signature disagrees with read_call")
    obj = _Probe()
    if module.object_state(obj, (int,), (), 1) != ((_Probe, (_Probe, "a", (int, 1))), [], -2, False):
        raise RuntimeError("object_state disagrees with read_object")
    state = module.ambient()  # compared with its Python twin where it is used (tree/ambient.py)
    if not (isinstance(state, tuple) and len(state) == 3 and isinstance(state[0], int)):
        raise RuntimeError(f"ambient() gave {state!r}, not (bits, default dtype, autocast dtype)")
    # a one-slot channel (state: version 8, none newest, none being written, slot 0 last at 0)
    cells, state = array.array("q", [0, 0, 0, 7, 0]), array.array("q", [8, -1, -1, 0])
    plans = array.array("q", [0, 1, 2, 3, 4] * 2).tobytes()
    took = module.channel_take(cells, state, plans)
    if took != 0 or cells.tolist() != [0, 0, 0, -1, 9] or state.tolist() != [8, -1, 0, 0]:
        raise RuntimeError("channel_take disagrees with Channel._take")
    published = module.channel_publish(cells, state, array.array("q", [3, 0]).tobytes())
    if published != 9 or cells.tolist() != [9, 0, 0, 9, 9] or state.tolist() != [9, 0, -1, 9]:
        raise RuntimeError("channel_publish disagrees with Channel._publish")
