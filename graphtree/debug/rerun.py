"""``graphtree debug rerun DUMP``: run a dumped call again, eagerly, in a fresh process.

The call runs with ``CUDA_LAUNCH_BLOCKING=1`` (every kernel finishes before the next Python line,
so an illegal address or a device-side assert is raised at the operation that caused it), its
tensors back on the devices they were dumped from and its random-number states restored. The
report names the error and the Python line that launched the failing operation.

Exit status: 0 the call ran without an error (not reproduced); 1 the error reproduced (the
report says where); 2 the dump cannot be read or its callable cannot be rebuilt here (the
message says why and what to do); 3 the re-run itself crashed or timed out (a sticky CUDA
error can kill the process: the last lines of its output are shown); 4 the tool asked for
(cuda-gdb, compute-sanitizer) is not installed. With ``--sanitizer``: 1 the sanitizer reported
errors (outside the cuDNN/cuBLAS noise), 0 it reported none.

The report names the kernel that failed (the last one launched, through CUPTI's launch
callbacks when ``cupti-python`` is installed), the Python line that launched it, and a
device-side assertion's message.

``--sanitizer memcheck|racecheck|initcheck|synccheck`` re-runs under compute-sanitizer and
reports its findings grouped by kernel with their Python lines (:mod:`graphtree.debug.sanitizer`;
``--kernel NAME`` checks only kernels whose name holds NAME; exit 1 when it found something).
``--cuda-gdb`` prints the cuda-gdb command that runs the same re-run and stops at the fault
(``--run`` runs it, interactively).

Example::

    $ graphtree debug rerun graphtree-dumps/step-20261123-071920-4242.gtdump
    $ graphtree debug rerun graphtree-dumps/step-20261123-071920-4242.gtdump --sanitizer memcheck
    $ graphtree debug rerun graphtree-dumps/step-20261123-071920-4242.gtdump --cuda-gdb --run
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from graphtree.debug.sanitizer import TOOLS

__all__ = ["cuda_gdb_command", "main", "rerun"]

REPRODUCED, NOT_REPRODUCED, UNUSABLE, CRASHED, NO_TOOL = 1, 0, 2, 3, 4
_MARK = "graphtree-rerun-result: "
_ASSERT = re.compile(r"Assertion `.*` failed")


def _user_frame(exc: BaseException) -> dict[str, Any] | None:
    """The innermost frame of the error outside torch and graphtree's machinery."""
    from graphtree.tree.capture import is_internal

    frames = traceback.extract_tb(exc.__traceback__)
    for f in reversed(frames):
        if not is_internal(f.filename):
            return {"file": f.filename, "line": f.lineno, "function": f.name, "code": (f.line or "").strip()}
    return None


def _to_device(x: Any, layout: dict[str, Any]) -> Any:
    import torch

    device = torch.device(layout["device"])
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"the dump's tensors were on {device}, and this machine has no CUDA device")
    out = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=device)
    out.copy_(x)
    return out


def _inner(path: str) -> int:
    """In the fresh process: load, rebuild, call; print one result line; return the exit status."""
    import torch

    from graphtree import _torch
    from graphtree.debug.dump import load_dump

    try:
        d = load_dump(path)
        if d.cwd and os.path.isdir(d.cwd):  # as where it ran: relative paths, and the lines of a script's code
            os.chdir(d.cwd)
        fn = d.resolve()
        leaves, spec = _torch.tree_flatten((d.args, d.kwargs))
        layouts = iter(d.tensors)
        leaves = [_to_device(x, next(layouts)) if isinstance(x, torch.Tensor) else x for x in leaves]
        args, kwargs = _torch.tree_unflatten(leaves, spec)
        torch.set_rng_state(d.rng["cpu"])
        if d.rng.get("cuda") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(d.rng["cuda"])
    except Exception as e:  # noqa: BLE001 - any reason the dump cannot be used is reported as such
        print(_MARK + json.dumps({"status": UNUSABLE, "error": f"{type(e).__name__}: {e}"}), flush=True)
        return UNUSABLE
    from graphtree.debug.launches import LaunchWatch

    watch = LaunchWatch()
    if torch.cuda.is_available() and os.environ.get("GRAPHTREE_RERUN_WATCH", "1") != "0":
        watch.start()
    try:
        fn(*args, **kwargs)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001 - the error under study
        result = {"status": REPRODUCED, "error": f"{type(e).__name__}: {e}", "where": _user_frame(e)}
        result |= {"launch": watch.last, "watch": watch.unavailable}
        print(_MARK + json.dumps(result), flush=True)
        return REPRODUCED
    finally:
        watch.stop()
    print(_MARK + json.dumps({"status": NOT_REPRODUCED}), flush=True)
    return NOT_REPRODUCED


def _env(**extra: str) -> dict[str, str]:
    """The environment of every re-run: kernels finish before the next Python line."""
    return {**os.environ, "CUDA_LAUNCH_BLOCKING": "1", "PYTHONUNBUFFERED": "1", **extra}


def _result(output: str) -> dict[str, Any] | None:
    """The result line the fresh process printed (see ``_inner``), if any."""
    for line in output.splitlines():
        if line.startswith(_MARK):
            return json.loads(line[len(_MARK) :])
    return None


def rerun(path: str | os.PathLike[str], timeout: float = 600.0) -> dict[str, Any]:
    """Re-run the dump at ``path`` in a fresh process; the result as a dict (``status`` is the exit code).

    Example::

        r = rerun("graphtree-dumps/step.gtdump")
        print(r["status"], r.get("error"), r.get("where"))
    """
    cmd = [sys.executable, "-m", "graphtree.debug.rerun", "--inner", os.fspath(path)]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=timeout, check=False)
    except subprocess.TimeoutExpired as e:
        tail = (e.stdout or "")[-2000:] if isinstance(e.stdout, str) else ""
        return {"status": CRASHED, "error": f"the re-run did not finish in {timeout:.0f} s", "output": tail}
    result = _result(proc.stdout)
    if result is not None:
        asserts = [a.strip() for a in proc.stderr.splitlines() if _ASSERT.search(a)]
        if asserts:
            result["assertion"] = asserts[0]
            result["assertions"] = len(asserts)
        return result
    output = (proc.stdout + proc.stderr)[-4000:]
    return {"status": CRASHED, "error": f"the re-run ended with exit status {proc.returncode}", "output": output}


def cuda_gdb_command(path: str | os.PathLike[str], exe: str = "cuda-gdb") -> list[str]:
    """The cuda-gdb command that re-runs the dump at ``path`` eagerly and stops at the fault.

    cuda-gdb stops by itself at a kernel's illegal address or device-side assert, in the
    kernel, with the CUDA thread and the host backtrace; ``api_failures stop`` also stops at a
    CUDA API call that fails.

    Example::

        print(shlex.join(cuda_gdb_command("step.gtdump")))
    """
    return [
        exe,
        "-q",
        "-ex",
        "set cuda api_failures stop",
        "-ex",
        "run",
        "--args",
        sys.executable,
        "-m",
        "graphtree.debug.rerun",
        "--inner",
        os.fspath(path),
    ]


def _render(r: dict[str, Any]) -> str:
    status = r["status"]
    if status == NOT_REPRODUCED:
        return "not reproduced: the call ran without an error (a race, or state the dump does not hold?)"
    if status == UNUSABLE:
        return f"cannot re-run this dump: {r['error']}"
    if status == CRASHED:
        return f"the re-run crashed: {r['error']}\n{r.get('output', '')}"
    from graphtree.debug.launches import demangle, short_name

    lines = [f"reproduced: {(r['error'].strip().splitlines() or [''])[0]}"]
    launch = r.get("launch")
    if launch:
        lines.append(f"  kernel: {short_name(demangle(launch['kernel']))}")
        if launch.get("file"):
            lines.append(f"  launched from {launch['file']}:{launch['line']} in {launch['function']}")
    elif r.get("watch"):
        lines.append(f"  kernel: not named ({r['watch']})")
    if r.get("assertion"):
        more = f" (and {r['assertions'] - 1} more threads)" if r.get("assertions", 1) > 1 else ""
        lines.append(f"  device-side assertion: {r['assertion']}{more}")
    where = r.get("where")
    if where:
        lines.append(f"  raised at {where['file']}:{where['line']} in {where['function']}: {where['code']}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``graphtree debug rerun DUMP`` (see the module's docstring for the exit statuses)."""
    p = argparse.ArgumentParser(prog="graphtree debug", description="Re-run what graphtree dumped.")
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("rerun", help="run a dumped call again, eagerly, with CUDA_LAUNCH_BLOCKING=1")
    r.add_argument("dump", help="a .gtdump file (graphtree.debug.dump_on_error writes them)")
    r.add_argument("--timeout", type=float, default=600.0, help="seconds before the re-run is stopped")
    r.add_argument("--cuda-gdb", action="store_true", help="print the cuda-gdb command that stops at the fault")
    r.add_argument("--run", action="store_true", help="with --cuda-gdb: run that command (interactive)")
    r.add_argument("--sanitizer", choices=TOOLS, help="re-run under compute-sanitizer with this tool")
    r.add_argument("--kernel", metavar="NAME", help="with --sanitizer: check only kernels whose name holds NAME")
    r.add_argument("--all", action="store_true", help="with --sanitizer: show the findings set aside as noise too")
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--inner"]:
        return _inner(argv[1])
    try:
        args = p.parse_args(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else UNUSABLE
    if not os.path.isfile(args.dump):
        print(f"graphtree debug rerun: no such dump: {args.dump}", file=sys.stderr)
        return UNUSABLE
    if args.run and not args.cuda_gdb:
        print("graphtree debug rerun: --run goes with --cuda-gdb", file=sys.stderr)
        return UNUSABLE
    if (args.kernel or args.all) and not args.sanitizer:
        print("graphtree debug rerun: --kernel and --all go with --sanitizer", file=sys.stderr)
        return UNUSABLE
    if args.cuda_gdb and args.sanitizer:
        print("graphtree debug rerun: choose one of --cuda-gdb and --sanitizer", file=sys.stderr)
        return UNUSABLE
    if args.cuda_gdb:
        return _cuda_gdb(args.dump, args.run)
    if args.sanitizer:
        return _sanitize(args.dump, args.sanitizer, args.kernel, args.all, args.timeout)
    print(f"re-running {args.dump} in a fresh process (CUDA_LAUNCH_BLOCKING=1) ...", flush=True)
    result = rerun(args.dump, timeout=args.timeout)
    print(_render(result))
    return int(result["status"])


def _cuda_gdb(path: str, run: bool) -> int:
    from graphtree.debug.doctor import TOOLKIT_HINT, find_cuda_tool

    exe = find_cuda_tool("cuda-gdb")
    cmd = cuda_gdb_command(path, exe or "cuda-gdb")
    print(shlex.join(cmd), flush=True)
    if not run:
        return NOT_REPRODUCED
    if exe is None:
        print(f"graphtree debug rerun: cuda-gdb is not installed: {TOOLKIT_HINT}", file=sys.stderr)
        return NO_TOOL
    return subprocess.run(cmd, env=_env(), check=False).returncode


def _sanitize(path: str, tool: str, kernel: str | None, show_noise: bool, timeout: float) -> int:
    from graphtree.debug.doctor import TOOLKIT_HINT, find_cuda_tool
    from graphtree.debug.sanitizer import SANITIZER_ENV, read_report, render, run_sanitizer, sanitizer_command

    exe = find_cuda_tool("compute-sanitizer")
    if exe is None:
        print(f"graphtree debug rerun: compute-sanitizer is not installed: {TOOLKIT_HINT}", file=sys.stderr)
        return NO_TOOL
    xml_path, log = Path(f"{path}.{tool}.xml"), Path(f"{path}.{tool}.log")
    xml_path.unlink(missing_ok=True)
    cmd = sanitizer_command(path, tool, xml_path, kernel, exe)
    print(f"re-running {path} under compute-sanitizer --tool {tool} (slow: tens of times an eager run) ...", flush=True)
    print(f"  {shlex.join(cmd)}", flush=True)
    status, seconds = run_sanitizer(cmd, log, timeout, tool, _env(**SANITIZER_ENV))
    if status is None:
        print(f"the sanitizer run did not finish in {timeout:.0f} s (its output: {log})")
        return CRASHED
    text = log.read_text(errors="replace") if log.is_file() else ""
    result = _result(text)
    if result is not None and result["status"] == UNUSABLE:
        print(_render(result))
        return UNUSABLE
    report, why = read_report(xml_path, text)
    if report is None:
        print(f"the sanitizer run failed (exit status {status}): {why}\n{text[-3000:]}")
        return CRASHED
    print(render(report, tool, show_noise))
    print(f"({seconds:.0f} s; report: {xml_path}, output: {log})")
    return REPRODUCED if report.groups else NOT_REPRODUCED


if __name__ == "__main__":
    raise SystemExit(main())
