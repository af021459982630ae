"""``graphtree doctor``: report whether CUDA graphs can run on this machine, and why not.

Every probe (torch build, driver, GPUs, CUPTI, compute-sanitizer, ...) is wrapped so that a
failing probe becomes a row that says what failed; :func:`doctor` itself never raises.

Example::

    from graphtree.debug import doctor
    report = doctor()
    print(report.render())
    if not report.ok:
        print("graphed functions will run eagerly")
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
import platform
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any

__all__ = ["DoctorReport", "doctor"]

_MIN_TORCH = (2, 11)
_CUDA_INDEX = "https://download.pytorch.org/whl/cu130"
_PROFILE_HINT = "not installed: pip install 'graphtree[profile]'"
_SANITIZER_DIRS = ("/usr/local/cuda/bin",)

Row = tuple[str, str]


@dataclass
class DoctorReport:
    """What :func:`doctor` found.

    Attributes:
        lines: ``(label, value)`` rows in display order (labels are unique).
        verdict: one line saying whether CUDA graphs can run here and, if not, how to fix it.
        ok: ``True`` when CUDA graphs can run here.

    Example::

        r = doctor()
        dict(r.lines)["torch"]     # e.g. '2.13.0+cu130'
        print(r.render())
    """

    lines: list[Row] = field(default_factory=list)
    verdict: str = ""
    ok: bool = False

    def get(self, label: str, default: str | None = None) -> str | None:
        """The value of the row called ``label`` (``default`` if there is none)."""
        for name, value in self.lines:
            if name == label:
                return value
        return default

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready dict: ``{"ok": bool, "verdict": str, "lines": [[label, value], ...]}``."""
        return {
            "ok": self.ok,
            "verdict": self.verdict,
            "lines": [[label, value] for label, value in self.lines],
        }

    def render(self) -> str:
        """The report as aligned ``label: value`` text followed by the verdict."""
        width = max((len(label) for label, _ in self.lines), default=0)
        out = ["graphtree doctor", ""]
        out += [f"  {label + ':':<{width + 1}} {value}" for label, value in self.lines]
        out += ["", self.verdict]
        return "\n".join(out)


def _version_tuple(version: str) -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def _fmt_cuda_int(v: Any) -> str:
    """Format an int CUDA version such as 13000 as '13.0'; anything else as its str()."""
    if isinstance(v, int) and v >= 1000:
        return f"{v // 1000}.{(v % 1000) // 10}"
    return str(v)


# --------------------------------------------------------------------------------------------
# Probes. Each returns rows; doctor() looks them up by name at call time and turns any
# exception into an "error: ..." row, so a broken probe never hides the rest of the report.
# --------------------------------------------------------------------------------------------


def _probe_graphtree() -> list[Row]:
    version = getattr(sys.modules.get("graphtree"), "__version__", None)
    if version is None:
        try:
            version = importlib.metadata.version("graphtree")
        except importlib.metadata.PackageNotFoundError:
            version = "unknown"
    return [("graphtree", str(version))]


def _probe_python() -> list[Row]:
    return [("Python", f"{platform.python_version()} ({sys.executable})"), ("platform", platform.platform())]


def _probe_torch() -> list[Row]:
    import torch

    cuda = torch.version.cuda
    hip = getattr(torch.version, "hip", None)
    if cuda:
        build = f"CUDA {cuda} build"
    elif hip:
        build = f"ROCm/HIP {hip} build"
    else:
        build = "CPU build (no CUDA)"
    return [("torch", str(torch.__version__)), ("torch build", build)]


def _probe_bytecode() -> list[Row]:
    """Whether Python keeps torch's compiled bytecode. Without it every process compiles torch's
    sources again: on the H100 host ``import torch`` took 4.5 s instead of 1.6 s and
    ``torch._dynamo`` 6 s instead of 1.1 s (``PYTHONDONTWRITEBYTECODE=1``, common in container images)."""
    import importlib.util

    import torch

    cached = os.path.exists(importlib.util.cache_from_source(torch.__file__))
    if cached:
        return [("Python bytecode", "torch's is cached")]
    fix = "export PYTHONPYCACHEPREFIX=/tmp/pycache (a writable folder)"
    if sys.dont_write_bytecode:
        why = "PYTHONDONTWRITEBYTECODE is set"
        fix = f"unset PYTHONDONTWRITEBYTECODE; {fix}"
    else:
        why = "torch's folder takes no .pyc files"
    return [
        (
            "Python bytecode",
            f"not cached ({why}): every process compiles torch's sources again (import torch 4.5 s instead "
            f"of 1.6 s on an H100 host). Fix: {fix}",
        )
    ]


def _probe_cuda_available() -> list[Row]:
    import torch

    rows: list[Row] = [("CUDA available", "yes" if torch.cuda.is_available() else "no")]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        rows.append(("CUDA_VISIBLE_DEVICES", repr(visible)))
    return rows


def nvidia_smi_driver() -> str | None:
    """The driver version(s) ``nvidia-smi`` reports, or ``None`` without it (10 s timeout)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    proc = subprocess.run(
        [exe, "--query-gpu=driver_version", "--format=csv,noheader"],
        check=False,
        capture_output=True,
        text=True,
        timeout=10,
    )
    versions = [ln.strip() for ln in proc.stdout.splitlines() if ln.strip()]
    if proc.returncode != 0 or not versions:
        return None
    return ", ".join(dict.fromkeys(versions))


def _probe_driver() -> list[Row]:
    import torch

    fn = getattr(torch.cuda, "driver_version", None)
    if callable(fn):
        try:
            v = fn()
            if isinstance(v, int) and v > 0:  # cuDriverGetVersion style: 1000 * major + 10 * minor
                return [("driver", f"supports CUDA {_fmt_cuda_int(v)}")]
            if v:
                return [("driver", str(v))]
        except Exception:  # noqa: BLE001 - fall back to nvidia-smi
            pass
    try:
        v = nvidia_smi_driver()
    except Exception:  # noqa: BLE001 - timeout, permission, ...
        v = None
    return [("driver", f"{v} (nvidia-smi)" if v else "unknown")]


def _probe_runtime() -> list[Row]:
    import torch

    built = torch.version.cuda
    if torch.cuda.is_available():
        try:
            rt = torch.cuda.cudart().cudaRuntimeGetVersion()
            if isinstance(rt, tuple):  # some bindings return (status, version)
                rt = rt[-1]
            return [("CUDA runtime", _fmt_cuda_int(rt))]
        except Exception:  # noqa: BLE001
            pass
    return [("CUDA runtime", f"{built} (torch was built with it)" if built else "none (CPU build)")]


def _probe_gpus() -> list[Row]:
    import torch

    if not torch.cuda.is_available():
        return [("GPUs", "none visible")]
    rows: list[Row] = []
    for i in range(torch.cuda.device_count()):
        try:
            p = torch.cuda.get_device_properties(i)
            gib = p.total_memory / 2**30
            rows.append((f"GPU {i}", f"{p.name}, sm_{p.major}{p.minor}, {gib:.1f} GiB"))
        except Exception as e:  # noqa: BLE001
            rows.append((f"GPU {i}", f"error: {type(e).__name__}: {e}"))
    return rows or [("GPUs", "none visible")]


def _probe_cupti() -> list[Row]:
    try:
        dist = importlib.metadata.version("cupti-python")
    except Exception:  # noqa: BLE001
        dist = None
    try:
        importlib.import_module("cupti")
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001 - a broken native module may raise anything
        if dist is None:
            return [("CUPTI (python)", _PROFILE_HINT)]
        return [("CUPTI (python)", f"cupti-python {dist} installed, but import failed: {type(e).__name__}: {e}")]
    return [("CUPTI (python)", f"importable (cupti-python {dist or 'unknown version'})")]


def _probe_native() -> list[Row]:
    from graphtree import _native

    _native.wait(120)  # builds once (about 15 s), then loads from the cache
    return [("native helpers", _native.status())]


def _probe_collectives() -> list[Row]:
    """Whether functions that call NCCL collectives can be recorded here (graphtree.tree.lockstep)."""
    import torch.distributed as dist

    from graphtree.tree.lockstep import environment_problem

    if not dist.is_available() or not dist.is_nccl_available():
        return [("collectives in graphs", "no NCCL in this torch build: functions that call collectives run eagerly")]
    problem = environment_problem()
    return [("collectives in graphs", f"refused here: {problem}" if problem else "NCCL available; environment ok")]


def _probe_sanitizer() -> list[Row]:
    exe = find_cuda_tool("compute-sanitizer")
    return [("compute-sanitizer", exe if exe else "not found (on PATH or in /usr/local/cuda/bin)")]


def _run_tool(exe: str, *args: str) -> str:
    """``exe args`` stdout and stderr together ("" if it cannot be run; 10 s timeout)."""
    try:
        proc = subprocess.run([exe, *args], check=False, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return ""
    return proc.stdout + proc.stderr


def _release(text: str, pattern: str) -> tuple[int, int] | None:
    m = re.search(pattern, text)
    return (int(m.group(1)), int(m.group(2))) if m else None


def _torch_cuda() -> tuple[int, int] | None:
    import torch

    v = getattr(torch.version, "cuda", None)
    return _release(v, r"(\d+)\.(\d+)") if v else None


def _fmt(v: tuple[int, int] | None) -> str:
    return f"{v[0]}.{v[1]}" if v else "unknown"


def driver_cuda_version() -> tuple[int, int] | None:
    """The newest CUDA version the installed driver supports (``nvidia-smi``'s header), or None."""
    exe = shutil.which("nvidia-smi")
    return _release(_run_tool(exe), r"CUDA Version:\s*(\d+)\.(\d+)") if exe else None


def _probe_cuda_versions() -> list[Row]:
    """The CUDA version the driver supports, against torch's CUDA, the toolkit's ``nvcc`` and the
    debuggers (the driver is asked once)."""
    driver, built = driver_cuda_version(), _torch_cuda()
    rows: list[Row] = []
    if driver is None:
        rows.append(("driver supports CUDA", "unknown (no nvidia-smi)"))
    elif built is not None and built > driver:
        rows.append(
            (
                "driver supports CUDA",
                f"{_fmt(driver)}: OLDER than torch's CUDA {_fmt(built)}. Fix: install a driver that supports "
                f"CUDA {_fmt(built)}, or a torch built for CUDA {_fmt(driver)} or older",
            )
        )
    else:
        rows.append(("driver supports CUDA", f"{_fmt(driver)} (torch's CUDA {_fmt(built)}: fine)"))
    nvcc = find_cuda_tool("nvcc")
    if nvcc is None:
        rows.append(("nvcc (toolkit)", "not found (only needed to build CUDA extensions)"))
    else:
        toolkit = _release(_run_tool(nvcc, "--version"), r"release (\d+)\.(\d+)")
        note = "fine"
        if toolkit and built and toolkit[0] != built[0]:
            note = (
                f"MISMATCH with torch's CUDA {_fmt(built)}: extensions built with this nvcc will not load. "
                f"Fix: put a CUDA {built[0]}.x toolkit first on PATH (CUDA_HOME)"
            )
        elif toolkit and driver and toolkit > driver:
            note = (
                f"newer than the driver's CUDA {_fmt(driver)}: programs it builds may not run. Fix: update the driver"
            )
        rows.append(("nvcc (toolkit)", f"{_fmt(toolkit)} at {nvcc}: {note}"))
    rows.extend(_debugger_rows(driver))
    return rows


TOOLKIT_HINT = (
    "it comes with the CUDA toolkit (apt install cuda-toolkit-13-0, or NVIDIA's runfile); put its bin folder on PATH"
)
"""Where compute-sanitizer, cuda-gdb and nvcc come from, for messages about a missing one."""


def find_cuda_tool(name: str) -> str | None:
    """The path of CUDA tool ``name`` (``nvcc``, ``compute-sanitizer``, ``cuda-gdb``): on PATH, else
    in the toolkit's bin folder (see :func:`_in_cuda_bin`); ``None`` if neither has it."""
    return shutil.which(name) or _in_cuda_bin(name)


def _in_cuda_bin(name: str) -> str | None:
    """``name`` in ``$CUDA_HOME/bin`` (or ``$CUDA_PATH/bin``) or ``/usr/local/cuda/bin``, if executable there."""
    dirs = list(_SANITIZER_DIRS)
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if cuda_home:
        dirs.insert(0, os.path.join(cuda_home, "bin"))
    for d in dirs:
        cand = os.path.join(d, name)
        if os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


def _probe_libraries() -> list[Row]:
    """cuDNN loaded against the one torch was built with, and NCCL's version."""
    import torch

    from graphtree import _torch

    rows: list[Row] = []
    if not getattr(torch.version, "cuda", None):
        return [("cuDNN", "none (CPU build)"), ("NCCL", "none (CPU build)")]
    loaded = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    built = _torch.cudnn_compiled_version()
    if loaded is None:
        rows.append(("cuDNN", "not available"))
    elif built is not None and loaded // 10000 != built // 10000:
        rows.append(
            (
                "cuDNN",
                f"{loaded} loaded, torch was built with {built}: MISMATCH (another cuDNN on LD_LIBRARY_PATH?). "
                f"Fix: let torch load its own (pip's nvidia-cudnn) first",
            )
        )
    else:
        rows.append(("cuDNN", f"{loaded} loaded (torch built with {built if built is not None else 'unknown'})"))
    try:
        v = torch.cuda.nccl.version()
        rows.append(("NCCL", ".".join(map(str, v)) if isinstance(v, tuple) else str(v)))
    except Exception as e:  # noqa: BLE001 - a build without NCCL
        rows.append(("NCCL", f"not available ({type(e).__name__})"))
    return rows


def _debugger_rows(driver: tuple[int, int] | None) -> list[Row]:
    """compute-sanitizer's and cuda-gdb's versions, against the driver's CUDA ``driver``."""
    rows: list[Row] = []
    for name, label in (("compute-sanitizer", "compute-sanitizer version"), ("cuda-gdb", "cuda-gdb")):
        exe = find_cuda_tool(name)
        if exe is None:
            rows.append((label, f"not found: {TOOLKIT_HINT}"))
            continue
        text = _run_tool(exe, "--version")
        cuda = _release(text, r"(?:CUDA|Release|release)\D{0,12}(\d+)\.(\d+)")
        # cuda-gdb's wrapper script first says which binary it picked ("exec: .../cuda-gdb-python3.12-tui")
        lines = [ln.strip() for ln in text.splitlines() if not ln.startswith("exec:")]
        first = next((ln for ln in lines if re.search(r"\d+\.\d+", ln)), "version unknown")
        note = ""
        if cuda and driver and cuda > driver:
            note = f"; built for CUDA {_fmt(cuda)}, newer than the driver's {_fmt(driver)}: it may refuse to run"
        rows.append((label, f"{first} ({exe}){note}"))
    return rows


def _probe_runtime_view() -> list[Row]:
    from graphtree.tree.manager import stats  # the tree below, not the package above this tool

    s = stats()
    note = getattr(s, "note", "")
    return [("graphtree sees CUDA", f"{'yes' if getattr(s, 'cuda', False) else 'no'}{f' ({note})' if note else ''}")]


# (function name, label used if the probe itself fails)
_PROBES: tuple[tuple[str, str], ...] = (
    ("_probe_graphtree", "graphtree"),
    ("_probe_python", "Python"),
    ("_probe_torch", "torch"),
    ("_probe_bytecode", "Python bytecode"),
    ("_probe_cuda_available", "CUDA available"),
    ("_probe_driver", "driver"),
    ("_probe_runtime", "CUDA runtime"),
    ("_probe_gpus", "GPUs"),
    ("_probe_cupti", "CUPTI (python)"),
    ("_probe_native", "native helpers"),
    ("_probe_collectives", "collectives in graphs"),
    ("_probe_sanitizer", "compute-sanitizer"),
    ("_probe_cuda_versions", "driver supports CUDA"),
    ("_probe_libraries", "cuDNN"),
    ("_probe_runtime_view", "graphtree sees CUDA"),
)


def _run_probe(name: str, label: str) -> list[Row]:
    try:
        rows = globals()[name]()
        return [(str(a), str(b)) for a, b in rows]
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001 - doctor must always report
        return [(label, f"error: {type(e).__name__}: {e}")]


def _verdict(rows: list[Row]) -> tuple[bool, str]:
    """Decide whether CUDA graphs can run, from live torch state (rows give context only)."""
    info = dict(rows)
    eager = "graphed functions run eagerly"
    try:
        import torch
    except BaseException as e:  # noqa: BLE001
        return False, f"CUDA graphs cannot run here: torch cannot be imported ({type(e).__name__}: {e})."

    version = str(torch.__version__)
    cuda_build = getattr(torch.version, "cuda", None)
    try:
        available = bool(torch.cuda.is_available())
    except BaseException:  # noqa: BLE001
        available = False

    if _version_tuple(version) < _MIN_TORCH:
        need = ".".join(map(str, _MIN_TORCH))
        return False, (
            f"CUDA graphs cannot run here: torch {version} is older than {need}, which graphtree "
            f"needs — {eager}. Fix: pip install -U 'torch>={need}' --index-url {_CUDA_INDEX}"
        )
    if not cuda_build and not getattr(torch.version, "hip", None):
        return False, (
            f"CUDA graphs cannot run here: no CUDA device visible (torch {version} is a CPU build) "
            f"— {eager}. Fix: install a CUDA build of torch: pip install torch --index-url {_CUDA_INDEX}"
        )
    if not available:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible is not None and visible.strip() in ("", "-1"):
            fix = f"CUDA_VISIBLE_DEVICES is {visible!r}; unset it or list a GPU index"
        else:
            fix = (
                "check that `nvidia-smi` lists a GPU and that the NVIDIA driver "
                f"(found: {info.get('driver', 'unknown')}) supports CUDA {cuda_build}"
            )
        return False, (
            f"CUDA graphs cannot run here: no CUDA driver or device visible (torch {version} is a "
            f"CUDA {cuda_build} build, but torch.cuda.is_available() is False) — {eager}. Fix: {fix}"
        )
    try:
        name = torch.cuda.get_device_name(torch.cuda.current_device())
    except BaseException:  # noqa: BLE001
        name = "a CUDA device"
    return True, f"CUDA graphs can run here ({name})"


def doctor() -> DoctorReport:
    """Probe this machine and say whether graphtree can record CUDA graphs here.

    Reports the graphtree, Python and torch versions, the torch build, CUDA availability,
    driver and runtime versions, each GPU (name, compute capability, memory), whether CUPTI's
    Python module (``cupti``) imports, and whether ``compute-sanitizer`` is installed. Never
    raises: a probe that fails shows up as an ``error: ...`` row.

    Example::

        >>> print(doctor().verdict)  # doctest: +SKIP
        CUDA graphs can run here (NVIDIA H100 80GB HBM3)
    """
    rows: list[Row] = []
    for name, label in _PROBES:
        rows.extend(_run_probe(name, label))
    try:
        ok, verdict = _verdict(rows)
    except KeyboardInterrupt:
        raise
    except BaseException as e:  # noqa: BLE001
        ok, verdict = False, f"Could not decide whether CUDA graphs can run here ({type(e).__name__}: {e})."
    return DoctorReport(lines=rows, verdict=verdict, ok=ok)
