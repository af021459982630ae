"""Name the last kernel launched and the Python line that launched it (for ``graphtree debug rerun``).

A re-run runs with ``CUDA_LAUNCH_BLOCKING=1``: every launch finishes before the next, so the
kernel that faulted is the last one launched before the error. :class:`LaunchWatch` notes each
launch through CUPTI's callback API (``cupti-python``; the same callbacks ``graphtree.profile``
uses), keeping the kernel's name and the innermost Python frame that is not torch's, Triton's
or graphtree's. Without CUPTI it says why, and the re-run still names the Python line from the
error's traceback.

Example::

    watch = LaunchWatch()
    watch.start()
    try:
        fn(*args)
    finally:
        watch.stop()
    print(watch.last)   # {"kernel": "...", "file": ..., "line": ..., ...} or None
"""

from __future__ import annotations

import functools
import importlib
import os
import shutil
import subprocess
import sys
from types import FrameType
from typing import Any

__all__ = ["LaunchWatch", "demangle", "internal_dirs", "short_name"]


def _package_dir(name: str) -> str | None:
    """The folder of installed package ``name`` (with a trailing separator), or ``None``."""
    try:
        module = importlib.import_module(name)
    except Exception:  # noqa: BLE001 - a package that is not there has no frames to skip
        return None
    file = getattr(module, "__file__", None)
    return os.path.dirname(os.path.abspath(file)) + os.sep if file else None


@functools.cache
def internal_dirs() -> tuple[str, ...]:
    """The folders of torch, Triton and graphtree here: frames in them are never the caller's line."""
    return tuple(d for d in map(_package_dir, ("torch", "triton", "graphtree")) if d)


class LaunchWatch:
    """The last kernel launch (name and Python frame), through CUPTI's launch callbacks.

    ``start()`` never raises: when CUPTI cannot be used, :attr:`unavailable` says why and
    :attr:`last` stays ``None``. One per process (CUPTI allows one subscriber).
    """

    def __init__(self) -> None:
        self.last: dict[str, Any] | None = None
        self.launches = 0
        self.unavailable = ""
        self._cupti: Any = None
        self._subscriber: Any = None
        self._callback: Any = None
        self._skip = internal_dirs()

    def start(self) -> None:
        """Subscribe to CUPTI's kernel-launch callbacks (or note why not)."""
        from graphtree.profile import _cbids

        try:
            cupti = importlib.import_module("cupti.cupti")
        except ImportError as e:
            self.unavailable = f"cupti-python is not installed ({e}): pip install cupti-python"
            return
        enter = int(cupti.ApiCallbackSite.API_ENTER)

        def callback(userdata: Any, domain: int, cbid: int, data: Any) -> None:
            try:
                if data.callback_site == enter:
                    self._note(str(data.symbol_name or ""), str(data.function_name or ""))
            except BaseException:  # noqa: BLE001 - never raise into CUPTI
                pass

        try:
            self._subscriber = cupti.subscribe(callback, 0)
            self._callback = callback
            for domain, name, kind in _cbids.LAUNCH_CALLBACKS:
                if kind != _cbids.KERNEL:
                    continue
                table = cupti.runtime_api_trace_cbid if domain == "runtime" else cupti.driver_api_trace_cbid
                member = getattr(table, name, None)
                if member is not None:
                    dom = _cbids.DOMAIN_RUNTIME if domain == "runtime" else _cbids.DOMAIN_DRIVER
                    cupti.enable_callback(1, self._subscriber, dom, int(member))
            self._cupti = cupti
        except Exception as e:  # noqa: BLE001 - another tool holds CUPTI, an old driver, ...
            self.unavailable = f"CUPTI cannot watch kernel launches here: {e}"

    def stop(self) -> None:
        """Unsubscribe (safe to call more than once, and after a failed start)."""
        if self._cupti is not None and self._subscriber is not None:
            try:
                self._cupti.unsubscribe(self._subscriber)
            except Exception:  # noqa: BLE001 - after a sticky CUDA error CUPTI may refuse; the process ends soon
                pass
        self._subscriber = None

    def _note(self, symbol: str, api: str) -> None:
        if not symbol:
            return
        self.launches += 1
        frame: FrameType | None = sys._getframe(1)
        while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(self._skip):
            frame = frame.f_back
        where: dict[str, Any] = {"kernel": symbol, "api": api}
        if frame is not None:
            where |= {"file": frame.f_code.co_filename, "line": frame.f_lineno, "function": frame.f_code.co_name}
        self.last = where


def demangle(symbol: str) -> str:
    """A C++ kernel name made readable (``cu++filt`` or ``c++filt``, when installed)."""
    if not symbol.startswith("_Z"):
        return symbol
    tool = shutil.which("cu++filt") or shutil.which("c++filt")
    if tool is None:
        return symbol
    try:
        out = subprocess.run([tool, symbol], capture_output=True, text=True, timeout=10, check=False).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return symbol
    return out or symbol


def short_name(readable: str) -> str:
    """``void at::native::index_elementwise_kernel<128, 4, ...>(...)`` -> ``at::native::index_elementwise_kernel``."""
    name = readable.strip().removeprefix("void ").replace("(anonymous namespace)", "{anonymous}")
    cut = min((i for i in (name.find("<"), name.find("(")) if i > 0), default=len(name))
    return name[:cut]
