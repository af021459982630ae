"""Which CUPTI callbacks the profiler subscribes to, by their enum *names*.

The session looks every name up in the real ``cupti.runtime_api_trace_cbid`` /
``cupti.driver_api_trace_cbid`` / ``cupti.CallbackIdResource`` enums when it starts, so the numbers
used at run time always come from the installed CUPTI. ``RECORDED_VALUES`` holds the numbers read
from cupti-python 13.0.1 (CUPTI 13.0) and is used only where no CUPTI is loaded: replaying
fixtures, the fake CUPTI of the CPU tests, and the documentation.

Deliberately absent: the stream-capture callbacks (``cudaStreamBeginCapture``,
``cuStreamEndCapture``, ...). A capture call launches nothing, so subscribing to it would only
produce launch events that never receive a kernel (see DESIGN.md).

Example::

    >>> from graphtree.profile import _cbids
    >>> _cbids.RECORDED_VALUES[("runtime", "cudaGraphLaunch_v10000")]
    311
"""

from __future__ import annotations

__all__ = [
    "API_KINDS",
    "CAPTURE_CALLBACKS",
    "DOMAIN_DRIVER",
    "DOMAIN_RESOURCE",
    "DOMAIN_RUNTIME",
    "GRAPH",
    "KERNEL",
    "LAUNCH_CALLBACKS",
    "RECORDED_VALUES",
    "RESOURCE_CALLBACKS",
    "display_name",
    "recorded_api_table",
]

# cupti.CallbackDomain values (identical in every CUPTI release since CUDA 4).
DOMAIN_DRIVER = 1
DOMAIN_RUNTIME = 2
DOMAIN_RESOURCE = 3

KERNEL = "kernel"  # an eager kernel launch: one kernel per call
GRAPH = "graph"  # a graph launch: every kernel node of the executable graph

# (domain, enum member name, what it launches)
LAUNCH_CALLBACKS: tuple[tuple[str, str, str], ...] = (
    ("runtime", "cudaLaunchKernel_v7000", KERNEL),
    ("runtime", "cudaLaunchKernel_ptsz_v7000", KERNEL),
    ("runtime", "cudaLaunchKernelExC_v11060", KERNEL),
    ("runtime", "cudaLaunchKernelExC_ptsz_v11060", KERNEL),
    ("runtime", "cudaLaunchCooperativeKernel_v9000", KERNEL),
    ("runtime", "cudaLaunchCooperativeKernel_ptsz_v9000", KERNEL),
    ("driver", "cuLaunchKernel", KERNEL),
    ("driver", "cuLaunchKernel_ptsz", KERNEL),
    ("driver", "cuLaunchKernelEx", KERNEL),
    ("driver", "cuLaunchKernelEx_ptsz", KERNEL),
    ("driver", "cuLaunchCooperativeKernel", KERNEL),
    ("driver", "cuLaunchCooperativeKernel_ptsz", KERNEL),
    ("runtime", "cudaGraphLaunch_v10000", GRAPH),
    ("runtime", "cudaGraphLaunch_ptsz_v10000", GRAPH),
    ("driver", "cuGraphLaunch", GRAPH),
    ("driver", "cuGraphLaunch_ptsz", GRAPH),
)

# cupti.CallbackIdResource member names. GRAPHNODE_CREATED gives each captured node its Python
# stack; GRAPHNODE_CLONED maps the node ids of an instantiated (executable) graph back to the
# captured node; GRAPH_CLONED does the same for graph ids.
RESOURCE_CALLBACKS: tuple[str, ...] = ("GRAPHNODE_CREATED", "GRAPHNODE_CLONED", "GRAPH_CLONED")

# Never enabled; listed so that tests can check it.
CAPTURE_CALLBACKS: tuple[tuple[str, str], ...] = (
    ("runtime", "cudaStreamBeginCapture_v10000"),
    ("runtime", "cudaStreamBeginCapture_ptsz_v10000"),
    ("runtime", "cudaStreamEndCapture_v10000"),
    ("runtime", "cudaStreamEndCapture_ptsz_v10000"),
    ("runtime", "cudaStreamBeginCaptureToGraph_v12030"),
    ("runtime", "cudaStreamBeginCaptureToGraph_ptsz_v12030"),
    ("driver", "cuStreamBeginCapture"),
    ("driver", "cuStreamBeginCapture_ptsz"),
    ("driver", "cuStreamBeginCapture_v2"),
    ("driver", "cuStreamBeginCapture_v2_ptsz"),
    ("driver", "cuStreamEndCapture"),
    ("driver", "cuStreamEndCapture_ptsz"),
    ("driver", "cuStreamBeginCaptureToGraph"),
    ("driver", "cuStreamBeginCaptureToGraph_ptsz"),
)

# Read from cupti-python 13.0.1 (`int(cupti.runtime_api_trace_cbid.<name>)` etc.).
RECORDED_VALUES: dict[tuple[str, str], int] = {
    ("runtime", "cudaLaunchKernel_v7000"): 211,
    ("runtime", "cudaLaunchKernel_ptsz_v7000"): 214,
    ("runtime", "cudaLaunchKernelExC_v11060"): 430,
    ("runtime", "cudaLaunchKernelExC_ptsz_v11060"): 431,
    ("runtime", "cudaLaunchCooperativeKernel_v9000"): 269,
    ("runtime", "cudaLaunchCooperativeKernel_ptsz_v9000"): 270,
    ("runtime", "cudaGraphLaunch_v10000"): 311,
    ("runtime", "cudaGraphLaunch_ptsz_v10000"): 312,
    ("runtime", "cudaStreamBeginCapture_v10000"): 315,
    ("runtime", "cudaStreamBeginCapture_ptsz_v10000"): 316,
    ("runtime", "cudaStreamEndCapture_v10000"): 319,
    ("runtime", "cudaStreamEndCapture_ptsz_v10000"): 320,
    ("runtime", "cudaStreamBeginCaptureToGraph_v12030"): 452,
    ("runtime", "cudaStreamBeginCaptureToGraph_ptsz_v12030"): 453,
    ("runtime", "cudaGraphInstantiate_v10000"): 310,
    ("runtime", "cudaMemcpyAsync_v3020"): 41,
    ("driver", "cuLaunchKernel"): 307,
    ("driver", "cuLaunchKernel_ptsz"): 442,
    ("driver", "cuLaunchKernelEx"): 652,
    ("driver", "cuLaunchKernelEx_ptsz"): 653,
    ("driver", "cuLaunchCooperativeKernel"): 477,
    ("driver", "cuLaunchCooperativeKernel_ptsz"): 478,
    ("driver", "cuGraphLaunch"): 514,
    ("driver", "cuGraphLaunch_ptsz"): 515,
    ("driver", "cuStreamBeginCapture"): 495,
    ("driver", "cuStreamBeginCapture_ptsz"): 496,
    ("driver", "cuStreamEndCapture"): 497,
    ("driver", "cuStreamEndCapture_ptsz"): 498,
    ("driver", "cuStreamBeginCapture_v2"): 539,
    ("driver", "cuStreamBeginCapture_v2_ptsz"): 540,
    ("driver", "cuStreamBeginCaptureToGraph"): 720,
    ("driver", "cuStreamBeginCaptureToGraph_ptsz"): 721,
    ("driver", "cuGraphInstantiateWithFlags"): 643,
    ("driver", "cuMemcpyHtoDAsync_v2"): 277,
    ("resource", "GRAPH_CREATED"): 9,
    ("resource", "GRAPH_CLONED"): 11,
    ("resource", "GRAPHNODE_CREATED"): 13,
    ("resource", "GRAPHEXEC_CREATED"): 18,
    ("resource", "GRAPHNODE_CLONED"): 20,
}

DOMAIN_VALUES = {"driver": DOMAIN_DRIVER, "runtime": DOMAIN_RUNTIME, "resource": DOMAIN_RESOURCE}

API_KINDS = {name: kind for _, name, kind in LAUNCH_CALLBACKS}


def display_name(enum_name: str) -> str:
    """The API's name without CUPTI's version suffix.

    Example::

        >>> display_name("cudaGraphLaunch_ptsz_v10000")
        'cudaGraphLaunch_ptsz'
    """
    head, sep, tail = enum_name.rpartition("_v")
    if sep and tail.isdigit() and len(tail) >= 4:
        return head
    return enum_name


def recorded_api_table() -> dict[tuple[int, int], tuple[str, str]]:
    """``(domain, cbid) -> (api name, "kernel" | "graph")`` from the recorded values.

    Example::

        >>> recorded_api_table()[(2, 311)]
        ('cudaGraphLaunch', 'graph')
    """
    table = {}
    for domain, name, kind in LAUNCH_CALLBACKS:
        table[(DOMAIN_VALUES[domain], RECORDED_VALUES[(domain, name)])] = (display_name(name), kind)
    return table
