"""``graphtree profile``: run a Python script under the GPU profiler and write its outputs.

Usage::

    graphtree profile [-o trace.json] [--pprof gpu.pb.gz] [options] -- python script.py args...
    graphtree profile -o trace.json -- python -m package.module args...

The script runs in this process (``runpy``), with ``sys.argv`` set to ``[script, args...]``,
under :func:`graphtree.profile.profile`. Afterwards the Chrome trace (``-o``) and the pprof
profile (``--pprof``) are written and the table of top kernels and graphs is printed on stderr.
The exit status is the script's (2 when the profiler cannot start).

Example::

    >>> from graphtree.profile.cli import main
    >>> main(["-o", "trace.json", "--", "python", "train.py", "--epochs", "1"])  # doctest: +SKIP
    0
"""

from __future__ import annotations

import argparse
import os
import re
import runpy
import sys
import traceback
from collections.abc import Sequence

__all__ = ["main"]

_PY_FLAGS = {"-u", "-B", "-O", "-OO", "-E", "-s", "-S", "-I", "-q", "-b", "-bb", "-d", "-v"}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="graphtree profile",
        description="Profile GPU kernels (eager and inside CUDA graph replays) of a Python script "
        "through CUPTI, with the Python call site of every kernel.",
        epilog="Example: graphtree profile -o trace.json --pprof gpu.pb.gz -- python train.py --epochs 1",
    )
    p.add_argument("-o", "--output", metavar="TRACE_JSON", help="write a Chrome/Perfetto trace here")
    p.add_argument("--pprof", metavar="PB_GZ", help="write GPU time per Python stack (gzip'd pprof) here")
    p.add_argument("--limit", type=int, default=20, help="rows of the printed table (default: 20)")
    p.add_argument("--no-table", action="store_true", help="do not print the table")
    p.add_argument(
        "--aggregate-only", action="store_true", help="keep no individual records (long runs; the trace is empty)"
    )
    p.add_argument("--max-records", type=int, default=200_000, help="records kept for the trace (default: 200000)")
    p.add_argument("--no-memcpy", action="store_true", help="collect kernels only (no memcpy/memset)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- python script.py args...")
    return p


def _split_command(cmd: list[str]) -> tuple[str, str, list[str]]:
    """``(mode, target, args)``: mode is "path", "module" or "code"."""
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise ValueError("no command given: graphtree profile [options] -- python script.py args...")
    first = os.path.basename(cmd[0])
    if re.fullmatch(r"python[0-9.]*(\.exe)?", first) or os.path.abspath(cmd[0]) == os.path.abspath(sys.executable):
        cmd = cmd[1:]
        while cmd and cmd[0] in _PY_FLAGS:
            cmd = cmd[1:]
    if not cmd:
        raise ValueError("no script given after python")
    if cmd[0] == "-m":
        if len(cmd) < 2:
            raise ValueError("-m needs a module name")
        return "module", cmd[1], cmd[2:]
    if cmd[0] == "-c":
        if len(cmd) < 2:
            raise ValueError("-c needs code")
        return "code", cmd[1], cmd[2:]
    return "path", cmd[0], cmd[1:]


def _run(mode: str, target: str, args: list[str]) -> int:
    saved_argv, saved_path0 = sys.argv[:], (sys.path[0] if sys.path else None)
    try:
        if mode == "path":
            sys.argv = [target, *args]
            if sys.path:
                sys.path[0] = os.path.dirname(os.path.abspath(target))
            runpy.run_path(target, run_name="__main__")
        elif mode == "module":
            sys.argv = [target, *args]
            if sys.path:
                sys.path[0] = os.getcwd()
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.argv = ["-c", *args]
            exec(compile(target, "<string>", "exec"), {"__name__": "__main__"})
        return 0
    except SystemExit as e:
        from graphtree.cli import exit_status

        return exit_status(e.code)
    except KeyboardInterrupt:
        return 130
    except BaseException:  # noqa: BLE001 - the profiled script's crash is reported, the profile still saved
        traceback.print_exc()
        return 1
    finally:
        sys.argv = saved_argv
        if saved_path0 is not None and sys.path:
            sys.path[0] = saved_path0


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``graphtree profile``; returns the script's exit status (2: usage or profiler error).

    Example::

        main(["-o", "trace.json", "--pprof", "gpu.pb.gz", "--", "python", "bench.py"])
    """
    from graphtree.profile import ProfilerError, profile

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "profile":
        argv = argv[1:]
    parser = _parser()
    try:
        opts = parser.parse_args(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 2
    try:
        mode, target, args = _split_command(list(opts.command))
    except ValueError as e:
        print(f"graphtree profile: {e}", file=sys.stderr)
        parser.print_usage(sys.stderr)
        return 2
    if mode == "path" and not os.path.exists(target):
        print(f"graphtree profile: no such script: {target}", file=sys.stderr)
        return 2

    prof = profile(keep_records=not opts.aggregate_only, max_records=opts.max_records, memcpy=not opts.no_memcpy)
    try:
        prof.start()
    except ProfilerError as e:
        print(f"graphtree profile: {e}", file=sys.stderr)
        return 2
    try:
        status = _run(mode, target, args)
    finally:
        prof.stop()

    outputs = []
    try:
        if opts.output:
            outputs.append(f"Chrome trace: {prof.export_chrome(opts.output)}")
        if opts.pprof:
            outputs.append(f"pprof: {prof.export_pprof(opts.pprof)}")
    except OSError as e:
        print(f"graphtree profile: cannot write output: {e}", file=sys.stderr)
        status = status or 1
    if not opts.no_table:
        print(prof.table(limit=opts.limit), file=sys.stderr)
    for line in outputs:
        print(f"graphtree profile: wrote {line}", file=sys.stderr)
    return status


if __name__ == "__main__":  # python -m graphtree.profile.cli ...
    sys.exit(main())
