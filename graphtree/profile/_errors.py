"""Errors raised by :mod:`graphtree.profile`.

Example::

    try:
        with graphtree.profile() as prof:
            step(x)
    except graphtree.profile.ProfilerBusyError as e:
        print("someone else is profiling:", e)
"""

from __future__ import annotations

__all__ = ["ProfilerBusyError", "ProfilerError", "ProfilerUnavailableError"]

INSTALL_HINT = "pip install 'graphtree[profile]'"


class ProfilerError(RuntimeError):
    """Base class of the profiler's own errors.

    Example::

        except ProfilerError as e: print(e)
    """


class ProfilerUnavailableError(ProfilerError):
    """CUPTI cannot be used here: the bindings are missing, there is no driver, or CUPTI refused.

    Example::

        except ProfilerUnavailableError as e:
            print(e)   # says to run: pip install 'graphtree[profile]' when cupti is missing
    """


class ProfilerBusyError(ProfilerError):
    """Another CUPTI user (torch.profiler, Nsight, compute-sanitizer, ...) already holds CUPTI.

    CUPTI allows one callback subscriber per process; the message names the likely other user.

    Example::

        with torch.profiler.profile(activities=[ProfilerActivity.CUDA]):
            graphtree.profile().start()     # raises ProfilerBusyError naming torch.profiler
    """
