"""Record real CUPTI events on a GPU as a JSON fixture for the CPU tests (and check them).

Run on a machine with a CUDA GPU, torch and cupti-python::

    python tools/record_profile_fixture.py tests/fixtures/profile_graph_replay.json

The scenario (``SCENARIO`` below, compiled under the file name ``<profile-scenario>`` so that its
frames count as user code and the fixture does not depend on install paths):

1. before profiling: capture graph G0 (2 kernels: ``old_region``);
2. start ``graphtree.profile(tap=recorder.attach)``;
3. eager: 2 kernels (``eager_region``), one host-to-device copy, one ``cudaMemsetAsync``
   (when cuda-python is installed);
4. capture graph G1 with ``torch.cuda.CUDAGraph(keep_graph=True)`` (3 kernels:
   ``captured_region``) and instantiate it;
5. replay G1 3 times with ``graph.replay()`` (runtime ``cudaGraphLaunch``) and 2 times with
   ``cuda.bindings.driver.cuGraphLaunch`` on ``raw_cuda_graph_exec()`` (driver only);
6. replay G0 2 times; stop; check the numbers.

:func:`check_expectations` is shared with ``tests/test_profile_fixtures.py``, which rebuilds the
profile from the JSON on any machine and applies the same checks.

Example::

    prof, expect = run_scenario(recorder)
    assert check_expectations(prof, expect) == []
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

__graphtree_profile_internal__ = True  # machinery to graphtree.profile: the scenario's lines are the call sites

__all__ = ["SCENARIO", "SCENARIO_FILE", "check_expectations", "main", "run_scenario"]

SCENARIO_FILE = "<profile-scenario>"

SCENARIO = """
def old_region(a, e, f):
    torch.mul(a, 3.0, out=e)
    torch.add(e, 2.0, out=f)


def eager_region(a, b, c):
    torch.add(a, 1.0, out=b)
    torch.mul(b, 2.0, out=c)


def captured_region(a, b, c, d):
    torch.mul(a, 2.0, out=b)
    torch.add(b, 1.0, out=c)
    torch.sin(c, out=d)


def run(profile, driver, runtime):
    dev = torch.device("cuda")
    a = torch.linspace(0.0, 1.0, 4096, device=dev)
    b, c, d, e, f = (torch.empty_like(a) for _ in range(5))
    host = torch.ones(4096).pin_memory()
    eager_region(a, b, c)                       # warm-up: load the kernels before profiling
    captured_region(a, b, c, d)
    old_region(a, e, f)
    torch.cuda.synchronize()

    g0 = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g0):
        old_region(a, e, f)
    torch.cuda.synchronize()

    prof = profile
    prof.start()
    eager_region(a, b, c)
    b.copy_(host, non_blocking=True)
    memsets = 0
    if runtime is not None:
        try:
            err, = runtime.cudaMemsetAsync(c.data_ptr(), 0, c.numel() * 4, torch.cuda.current_stream().cuda_stream)
            memsets = 1 if int(err) == 0 else 0
        except Exception:
            memsets = 0
    torch.cuda.synchronize()

    g1 = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(g1):
        captured_region(a, b, c, d)
    g1.instantiate()
    for _ in range(3):
        g1.replay()
    driver_launches = 0
    if driver is not None:
        exec_handle = g1.raw_cuda_graph_exec()
        stream = torch.cuda.current_stream().cuda_stream
        for _ in range(2):
            err, = driver.cuGraphLaunch(driver.CUgraphExec(int(exec_handle)), driver.CUstream(int(stream)))
            assert int(err) == 0, err
            driver_launches += 1
    for _ in range(2):
        g0.replay()
    torch.cuda.synchronize()
    prof.stop()

    ok_d = bool(torch.allclose(d, torch.sin(a * 2.0 + 1.0)))
    ok_f = bool(torch.allclose(f, a * 3.0 + 2.0))
    return {"driver_launches": driver_launches, "memsets": memsets, "results_correct": ok_d and ok_f}
"""


def _line_of(text: str) -> int:
    for i, line in enumerate(SCENARIO.splitlines(), start=1):
        if text in line:
            return i
    raise ValueError(text)


def scenario_expectations(driver_launches: int, memsets: int) -> dict[str, Any]:
    """What the scenario must produce (derived from the scenario, not from CUPTI)."""
    return {
        "scenario_file": SCENARIO_FILE,
        "runtime_graph_launches": 3 + 2,  # G1 x3 and G0 x2 through graph.replay()
        "driver_graph_launches": driver_launches,  # G1 through cuGraphLaunch
        "captured_graph_kernels": 3,
        "captured_graph_launches": 3 + driver_launches,
        "captured_lines": {
            "torch.mul(a, 2.0, out=b)": _line_of("torch.mul(a, 2.0, out=b)"),
            "torch.add(b, 1.0, out=c)": _line_of("torch.add(b, 1.0, out=c)"),
            "torch.sin(c, out=d)": _line_of("torch.sin(c, out=d)"),
        },
        "captured_function": "captured_region",
        "old_graph_kernels": 2,
        "old_graph_launches": 2,
        "old_replay_line": _line_of("g0.replay()"),
        "eager_kernels_min": 2,
        "eager_function": "eager_region",
        "capture_calls": 3,
        "memcpys_min": 1,
        "memsets": memsets,
    }


def run_scenario(profile: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """Run ``SCENARIO`` under ``profile`` (a not yet started Profile); returns (outcome, expect)."""
    import torch

    try:
        from cuda.bindings import driver, runtime
    except ImportError:
        driver = runtime = None
    ns: dict[str, Any] = {"torch": torch, "__name__": "profile_scenario"}
    exec(compile(SCENARIO, SCENARIO_FILE, "exec"), ns)
    outcome = ns["run"](profile, driver, runtime)
    return outcome, scenario_expectations(outcome["driver_launches"], outcome["memsets"])


def check_expectations(prof: Any, expect: dict[str, Any]) -> list[str]:
    """Problems found in ``prof`` against ``expect`` (empty: all good).

    Example::

        assert check_expectations(load("fixture.json"), doc["expect"]) == []
    """
    problems: list[str] = []
    s = prof.summary()
    fname = expect["scenario_file"]

    def where(sid: int) -> tuple[str, int, str] | None:
        frames = prof.stack(sid)
        return frames[-1] if frames else None

    api = s["api_counts"]
    rt = api.get("cudaGraphLaunch", 0) + api.get("cudaGraphLaunch_ptsz", 0)
    drv = api.get("cuGraphLaunch", 0) + api.get("cuGraphLaunch_ptsz", 0)
    if rt != expect["runtime_graph_launches"]:
        problems.append(f"runtime graph launches: {rt} != {expect['runtime_graph_launches']} ({api})")
    if drv != expect["driver_graph_launches"]:
        problems.append(f"driver-only graph launches: {drv} != {expect['driver_graph_launches']} ({api})")
    if s["graph_launches"] != rt + drv:
        problems.append(f"graph launches {s['graph_launches']} != {rt + drv}")

    launches = prof.graph_launches()
    new = [lz for lz in launches if lz.kernels == expect["captured_graph_kernels"]]
    old = [lz for lz in launches if lz.kernels == expect["old_graph_kernels"]]
    if len(new) != expect["captured_graph_launches"]:
        problems.append(
            f"launches of the captured graph with {expect['captured_graph_kernels']} kernels each: {len(new)} != "
            f"{expect['captured_graph_launches']} (kernels per launch: {[lz.kernels for lz in launches]})"
        )
    if len(old) != expect["old_graph_launches"]:
        problems.append(f"launches of the pre-profiling graph: {len(old)} != {expect['old_graph_launches']}")
    if len(launches) != len(new) + len(old):
        problems.append(f"unexpected graph launches: {[lz.kernels for lz in launches]}")

    graph_rows = [st for st in prof.kernel_stats() if st.graph_key and st.kind == "kernel"]
    captured = [st for st in graph_rows if not st.captured_before_profiling]
    before = [st for st in graph_rows if st.captured_before_profiling]
    n_captured = sum(st.count for st in captured)
    want = expect["captured_graph_kernels"] * expect["captured_graph_launches"]
    if n_captured != want:
        problems.append(f"kernels of the captured graph: {n_captured} != {want}")
    lines = set(expect["captured_lines"].values())
    seen_lines = set()
    for st in captured:
        w = where(st.stack_id)
        if not w or w[0] != fname or w[2] != expect["captured_function"]:
            problems.append(f"captured kernel {st.name} attributed to {w}, not {expect['captured_function']}")
        else:
            seen_lines.add(w[1])
    if seen_lines != lines:
        problems.append(f"captured kernels at lines {sorted(seen_lines)} != {sorted(lines)}")
    n_before = sum(st.count for st in before)
    want_before = expect["old_graph_kernels"] * expect["old_graph_launches"]
    if n_before != want_before:
        problems.append(f"kernels of the graph captured before profiling: {n_before} != {want_before}")
    for st in before:
        w = where(st.stack_id)
        if not w or w[0] != fname or w[1] != expect["old_replay_line"]:
            problems.append(f"pre-profiling graph kernel {st.name} attributed to {w}, not its replay line")

    eager = [st for st in prof.kernel_stats() if not st.graph_key and st.kind == "kernel"]
    n_eager = sum(st.count for st in eager if (where(st.stack_id) or ("", 0, ""))[2] == expect["eager_function"])
    if n_eager < expect["eager_kernels_min"]:
        problems.append(
            f"eager kernels attributed to {expect['eager_function']}: {n_eager} < {expect['eager_kernels_min']}"
        )
    if s["kernel_launches"] < expect["eager_kernels_min"]:
        problems.append(f"eager kernel launches {s['kernel_launches']} < {expect['eager_kernels_min']}")
    if s["capture_calls"] != expect["capture_calls"]:
        problems.append(
            f"launch calls during capture {s['capture_calls']} != {expect['capture_calls']} "
            "(must not count as launches)"
        )
    if s["memcpys"] < expect["memcpys_min"]:
        problems.append(f"memcpy records {s['memcpys']} < {expect['memcpys_min']}")
    if s["memsets"] < expect["memsets"]:
        problems.append(f"memset records {s['memsets']} < {expect['memsets']}")
    if s["records_without_launch"]:
        problems.append(f"{s['records_without_launch']} kernel records without a launch")
    if s["callback_errors"] or s["record_errors"]:
        problems.append(f"errors in callbacks: {s['callback_errors']} / {s['record_errors']}")
    return problems


def _meta() -> dict[str, Any]:
    meta: dict[str, Any] = {"python": sys.version.split()[0]}
    try:
        import torch

        meta["torch"] = torch.__version__
        meta["cuda"] = torch.version.cuda
        meta["device"] = torch.cuda.get_device_name()
    except Exception:  # noqa: BLE001 - metadata is best effort
        pass
    try:
        from importlib import metadata

        for dist in ("cupti-python", "nvidia-cuda-cupti", "cuda-bindings"):
            try:
                meta[dist] = metadata.version(dist)
            except metadata.PackageNotFoundError:
                pass
    except Exception:  # noqa: BLE001
        pass
    try:
        from cuda.bindings import driver

        _err, version = driver.cuDriverGetVersion()
        meta["driver_api_version"] = int(version)
    except Exception:  # noqa: BLE001
        pass
    return meta


def main(argv: list[str] | None = None) -> int:
    """Record the fixture to ``argv[0]`` (default tests/fixtures/profile_graph_replay.json)."""
    from profile_fixture import Recorder

    import graphtree

    args = list(sys.argv[1:] if argv is None else argv)
    path = args[0] if args else os.path.join("tests", "fixtures", "profile_graph_replay.json")
    if os.path.isdir(path):
        path = os.path.join(path, "profile_graph_replay.json")
    recorder = Recorder()
    prof = graphtree.profile.profile(tap=recorder.attach)  # the function behind graphtree.profile(), typed
    outcome, expect = run_scenario(prof)
    problems = check_expectations(prof, expect)
    if not outcome["results_correct"]:
        problems.append("the scenario computed wrong results under profiling")
    print(prof.table(), file=sys.stderr)
    recorder.save(
        path,
        hand_made=False,
        meta=_meta(),
        expect=expect,
        note="recorded on a GPU by `python tools/record_profile_fixture.py`",
    )
    print(json.dumps({"fixture": path, "events": len(recorder.events), "problems": problems}, indent=1))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
