"""Write the HAND-MADE stand-in of tests/fixtures/profile_graph_replay.json (no GPU needed).

It runs the very scenario of ``tools/record_profile_fixture.py`` (same source, same line
numbers) against the fake CUPTI and a tiny fake ``torch`` whose ops launch fake kernels, records
the profiler's events with the same ``Recorder`` (``tools/profile_fixture.py``), and marks the
file ``"hand_made": true``. Replace it with a real recording::

    python tools/record_profile_fixture.py tests/fixtures/profile_graph_replay.json   # on a GPU

Usage (here)::

    python tests/fakes/make_profile_fixture.py [out.json]
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path
from typing import Any

__graphtree_profile_internal__ = True

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parents[1] / "tools"))  # record_profile_fixture, profile_fixture


class _Tensor:
    def __init__(self, torch: _FakeTorch) -> None:
        self._t = torch

    def copy_(self, other: Any, non_blocking: bool = False) -> _Tensor:
        self._t.sim.memcpy(16384, kind="HTOD", stream=self._t.stream)
        return self

    def pin_memory(self) -> _Tensor:
        return self

    def data_ptr(self) -> int:
        return 0x7000_0000

    def numel(self) -> int:
        return 4096

    def __mul__(self, other: Any) -> _Tensor:
        return self

    __add__ = __rmul__ = __radd__ = __mul__


class _Graph:
    def __init__(self, torch: _FakeTorch, keep_graph: bool = False) -> None:
        self._t = torch
        self.exe: Any = None
        self.raw: Any = None

    def instantiate(self) -> None:
        if self.exe is None:
            self.exe = self._t.sim.instantiate(self.raw)

    def replay(self) -> None:
        self.instantiate()
        self._t.sim.graph_launch(self.exe, api="cudaGraphLaunch_v10000", stream=self._t.stream)

    def raw_cuda_graph_exec(self) -> int:
        return self.exe.handle


class _Cuda:
    def __init__(self, torch: _FakeTorch) -> None:
        self._t = torch
        self.CUDAGraph = lambda keep_graph=False: _Graph(torch, keep_graph)

    def synchronize(self) -> None:
        pass

    def current_stream(self) -> Any:
        t = self._t

        class _S:
            cuda_stream = t.stream

        return _S()

    @contextlib.contextmanager
    def graph(self, g: _Graph):  # type: ignore[no-untyped-def]
        sim = self._t.sim
        saved, self._t.stream = self._t.stream, 13  # torch captures on a side stream
        sim.begin_capture(13)
        try:
            yield
        finally:
            g.raw = sim.end_capture(13)
            self._t.stream = saved
        if not getattr(g, "keep", False):
            pass


class _FakeTorch:
    """Just enough torch for the scenario: each op launches one fake kernel."""

    def __init__(self, sim: Any) -> None:
        self.sim = sim
        self.stream = 7
        self.cuda = _Cuda(self)

    def device(self, name: str) -> str:
        return name

    def linspace(self, *a: Any, **k: Any) -> _Tensor:
        return _Tensor(self)

    def empty_like(self, t: Any) -> _Tensor:
        return _Tensor(self)

    def ones(self, *a: Any, **k: Any) -> _Tensor:
        return _Tensor(self)

    def _op(self, name: str) -> _Tensor:
        self.sim.launch_kernel(name, api="cudaLaunchKernel_v7000", stream=self.stream, duration=1500)
        return _Tensor(self)

    def mul(self, *a: Any, **k: Any) -> _Tensor:
        return self._op("void at::native::vectorized_elementwise_kernel<4, at::native::mul_kernel>")

    def add(self, *a: Any, **k: Any) -> _Tensor:
        return self._op("void at::native::vectorized_elementwise_kernel<4, at::native::add_kernel>")

    def sin(self, *a: Any, **k: Any) -> _Tensor:
        return self._op("void at::native::vectorized_elementwise_kernel<4, at::native::sin_kernel>")

    def allclose(self, *a: Any, **k: Any) -> bool:
        return True


class _FakeDriver:
    def __init__(self, torch: _FakeTorch) -> None:
        self._t = torch
        self.CUgraphExec = lambda h: h
        self.CUstream = lambda s: s

    def cuGraphLaunch(self, exe_handle: int, stream: int) -> tuple[int]:
        self._t.sim.graph_launch(self._t.sim.obj(exe_handle), api="cuGraphLaunch", stream=int(stream))
        return (0,)


class _FakeRuntime:
    def __init__(self, torch: _FakeTorch) -> None:
        self._t = torch

    def cudaMemsetAsync(self, ptr: int, value: int, count: int, stream: int) -> tuple[int]:
        self._t.sim.memset(count, stream=int(stream))
        return (0,)


def build(path: str | None = None) -> dict[str, Any]:
    """Run the scenario on the fakes; returns the fixture document (and writes it to ``path``)."""
    import fake_cupti
    from fake_cupti import cupti

    saved = {k: sys.modules.get(k) for k in ("cupti", "cupti.cupti")}
    sys.modules["cupti"] = fake_cupti
    sys.modules["cupti.cupti"] = cupti
    from graphtree.profile import _rawbuf

    saved_factory = _rawbuf.BACKEND_FACTORY
    _rawbuf.BACKEND_FACTORY = lambda _cupti: cupti.LIBCUPTI  # never a real libcupti here
    try:
        import record_profile_fixture
        from profile_fixture import Recorder

        import graphtree

        cupti.SIM.reset()
        torch = _FakeTorch(cupti.SIM)
        ns: dict[str, Any] = {"torch": torch, "__name__": "profile_scenario"}
        exec(compile(record_profile_fixture.SCENARIO, record_profile_fixture.SCENARIO_FILE, "exec"), ns)
        rec = Recorder()
        prof = graphtree.profile(tap=rec.attach)
        outcome = ns["run"](prof, _FakeDriver(torch), _FakeRuntime(torch))
        prof.summary()  # records are aggregated (and so reach the tap) at the first query after stop()
        expect = record_profile_fixture.scenario_expectations(outcome["driver_launches"], outcome["memsets"])
        doc = rec.to_json(
            hand_made=True,
            meta={"generator": "tests/fakes/make_profile_fixture.py (fake CUPTI, fake torch)"},
            expect=expect,
            note=(
                "HAND-MADE from the fake CUPTI, not a GPU recording. Replace it by running on a GPU: "
                "python tools/record_profile_fixture.py tests/fixtures/profile_graph_replay.json"
            ),
        )
        if path:
            import json

            with open(path, "w") as f:
                json.dump(doc, f, separators=(",", ":"))
                f.write("\n")
        return doc
    finally:
        _rawbuf.BACKEND_FACTORY = saved_factory
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v


if __name__ == "__main__":
    out = sys.argv[1] if len(sys.argv) > 1 else str(HERE.parent / "fixtures" / "profile_graph_replay.json")
    doc = build(out)
    print(f"wrote {out}: {len(doc['events'])} events (hand-made)")
