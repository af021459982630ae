"""Run a function right after a module is imported, without importing it.

graphtree needs one thing from ``torch._dynamo`` (``torch.compiler.disable`` around the call a
compiled program makes into a graphed function), and importing it costs 1.1 s on the H100 host
(6 s where Python keeps no ``.pyc`` files): a price a program that never compiles must not pay.
:func:`call_after_import` defers the work to the moment the program itself imports the module —
before ``torch.compile`` can trace anything.

Mechanism: a finder placed first on ``sys.meta_path`` that, asked for the module, removes itself,
lets the other finders find it, and wraps the loader's ``exec_module`` so that ``fn`` runs once
the module is fully executed. An exception in ``fn`` is logged, never raised into the import.

Example::

    call_after_import("torch._dynamo", lambda: print("dynamo is here"))
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import logging
import sys
import threading
from collections.abc import Callable, Sequence
from types import ModuleType

__all__ = ["call_after_import"]

log = logging.getLogger("graphtree")
_lock = threading.Lock()


def call_after_import(name: str, fn: Callable[[], None]) -> None:
    """Call ``fn`` now if module ``name`` is imported already, else right after its import.

    Example::

        call_after_import("torch._dynamo", prepare)
    """
    with _lock:
        if name not in sys.modules:
            sys.meta_path.insert(0, _AfterImport(name, fn))
            return
    fn()


class _AfterImport(importlib.abc.MetaPathFinder):
    """A finder that finds nothing itself: it wraps the real loader of one module."""

    def __init__(self, name: str, fn: Callable[[], None]) -> None:
        self.name = name
        self.fn = fn

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != self.name:
            return None
        with _lock:
            if self not in sys.meta_path:
                return None
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)  # the other finders' answer
        loader = spec.loader if spec is not None else None
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module
        fn = self.fn

        def exec_then_call(module: ModuleType) -> None:
            exec_module(module)
            try:
                fn()
            except Exception:
                log.exception("graphtree: preparing for %s failed", fullname)

        loader.exec_module = exec_then_call  # type: ignore[method-assign]
        return spec
