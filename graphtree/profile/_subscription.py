"""CUPTI's callback side of a profiling session (:class:`Subscription`): the one subscriber CUPTI
allows, the launch callbacks (runtime and driver kernel launches, their ``_ptsz``/``Ex`` forms, the
graph launches) and the resource callbacks (graph nodes created and cloned, graphs cloned), each fed
to the session's sink (``ProfileData`` or a sampling tap) with the caller's thread and CUPTI's
timestamp. Never the capture callbacks.

The subscription is made first (:meth:`Subscription.subscribe`): if another tool holds CUPTI it
fails with ``CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED`` before anything global was touched,
and becomes :class:`ProfilerBusyError` naming the likely holder (:func:`guess_other_cupti_users`).

Example::

    sub = Subscription(cupti, data, sink=data, capture=lambda: 0)
    sub.subscribe(); sub.enable()
    ...
    sub.close(errors=[], timings={})
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable
from typing import Any

from graphtree.profile import _cbids
from graphtree.profile._buffers import step
from graphtree.profile._errors import ProfilerBusyError, ProfilerUnavailableError
from graphtree.profile._model import ProfileData

SUBSCRIBER_NAME = "graphtree.profile"
MULTIPLE_SUBSCRIBERS = 39  # cupti.Result.ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED


class Subscription:
    """The callbacks of one session. ``data`` counts the callbacks' own errors; ``sink`` takes what
    they report; ``capture()`` returns the calling thread's Python stack id."""

    def __init__(self, cupti: Any, data: ProfileData, sink: Any, capture: Callable[[], int]) -> None:
        self.cupti = cupti
        self._data = data
        self._sink = sink
        self._capture = capture
        self.subscriber: Any = None
        self.enabled: list[tuple[int, int]] = []  # (domain, cbid) of each callback turned on
        self.missing: list[str] = []  # callbacks this CUPTI release does not have
        self._params: Any = None
        self._callback: Any = None  # CUPTI keeps a raw pointer to it: kept alive here
        self._ids: tuple[dict[str, int], list[tuple[int, int]], dict[str, int]] | None = None
        self._resource_ids: dict[str, int] = {}

    def subscribe(self) -> None:
        """Name the callbacks of this CUPTI release (the sink learns the launch APIs), then subscribe."""
        domains, api_table, launch_ids, resource_ids = self._resolve_ids(self.cupti)
        self._ids = (domains, launch_ids, resource_ids)
        self._sink.set_api_table(api_table)
        self._subscribe(self.cupti)

    def enable(self) -> None:
        """Turn the launch and resource callbacks on."""
        assert self._ids is not None, "subscribe() first"
        domains, launch_ids, resource_ids = self._ids
        for domain, cbid in launch_ids + [(domains["resource"], c) for c in resource_ids.values()]:
            self.cupti.enable_callback(1, self.subscriber, domain, cbid)
            self.enabled.append((domain, cbid))
        self._resource_ids = resource_ids

    def close(self, errors: list[str], timings: dict[str, float]) -> None:
        """Turn the callbacks off and unsubscribe (each step noted in ``errors`` if it fails)."""
        cupti = self.cupti
        if self.subscriber is not None:
            sub = self.subscriber

            def disable_callbacks() -> None:
                for domain, cbid in self.enabled:
                    step(
                        errors,
                        f"disable callback {domain}/{cbid}",
                        lambda: cupti.enable_callback(0, sub, domain, cbid),  # noqa: B023 - step calls it at once
                    )

            step(errors, "disable callbacks", disable_callbacks, timings)
            step(errors, "unsubscribe", lambda: cupti.unsubscribe(sub), timings)
            self.subscriber = None
        self.enabled = []

    def now(self) -> int:
        """CUPTI's timestamp now (ns), 0 where it cannot say."""
        try:
            return int(self.cupti.get_timestamp())
        except Exception:
            return 0

    def _resolve_ids(
        self, cupti: Any
    ) -> tuple[dict[str, int], dict[tuple[int, int], tuple[str, str]], list[tuple[int, int]], dict[str, int]]:
        dom = cupti.CallbackDomain
        domains = {
            "driver": int(dom.DRIVER_API),
            "runtime": int(dom.RUNTIME_API),
            "resource": int(dom.RESOURCE),
        }
        enums = {"runtime": cupti.runtime_api_trace_cbid, "driver": cupti.driver_api_trace_cbid}
        table: dict[tuple[int, int], tuple[str, str]] = {}
        launch_ids: list[tuple[int, int]] = []
        for d, name, kind in _cbids.LAUNCH_CALLBACKS:
            member = getattr(enums[d], name, None)
            if member is None:  # not in this CUPTI release
                self.missing.append(name)
                continue
            key = (domains[d], int(member))
            table[key] = (_cbids.display_name(name), kind)
            launch_ids.append(key)
        resource_ids: dict[str, int] = {}
        for name in _cbids.RESOURCE_CALLBACKS:
            member = getattr(cupti.CallbackIdResource, name, None)
            if member is None:
                self.missing.append(name)
                continue
            resource_ids[name] = int(member)
        return domains, table, launch_ids, resource_ids

    def _subscribe(self, cupti: Any) -> None:
        callback = self._make_callback(cupti)
        self._callback = callback  # CUPTI keeps a raw pointer; we keep the object alive
        try:
            try:
                params = cupti.SubscriberParams()
                params.struct_size = cupti.SUBSCRIBER_PARAMS_SIZE
                params.subscriber_name = SUBSCRIBER_NAME
                self._params = params
                self.subscriber = cupti.subscribe_v2(callback, 0, params.ptr)
            except (AttributeError, NotImplementedError):  # no cuptiSubscribe_v2 in this release
                self._params = None
                self.subscriber = cupti.subscribe(callback, 0)
            except Exception as e:
                if status_of(e) is not None or "FunctionNotFound" not in type(e).__name__:
                    raise
                self._params = None
                self.subscriber = cupti.subscribe(callback, 0)
        except Exception as e:
            status = status_of(e)
            if status == MULTIPLE_SUBSCRIBERS:
                old = ""
                if self._params is not None:
                    try:
                        raw = self._params.old_subscriber_name
                        old = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw or "")
                    except Exception:
                        old = ""
                raise ProfilerBusyError(busy_message(old.strip("\x00 "))) from e
            if status is not None:
                try:
                    name = cupti.Result(status).name
                except Exception:
                    name = str(status)
                raise ProfilerUnavailableError(f"CUPTI refused the subscription ({name}): {e}") from e
            raise ProfilerUnavailableError(f"CUPTI cannot be used here: {e}") from e

    def _make_callback(self, cupti: Any) -> Callable[..., None]:
        sink = self._sink
        data = self._data
        capture = self._capture
        timestamp = cupti.get_timestamp
        get_ident = threading.get_ident
        resource = int(cupti.CallbackDomain.RESOURCE)
        enter = int(cupti.ApiCallbackSite.API_ENTER)
        on_resource = self._on_resource

        def callback(userdata: Any, domain: int, cbid: int, cbdata: Any) -> None:
            try:
                if domain == resource:
                    on_resource(cbid, cbdata)
                elif cbdata.callback_site == enter:
                    sink.api_enter(domain, cbid, cbdata.correlation_id, get_ident(), timestamp(), capture)
                else:
                    sink.api_exit(domain, cbid, cbdata.correlation_id, get_ident(), timestamp())
            except BaseException:  # never raise into CUPTI
                data.callback_errors += 1

        return callback

    def _on_resource(self, cbid: int, cbdata: Any) -> None:
        cupti = self.cupti
        ids = self._resource_ids
        gd = _graph_data(cupti, cbdata)
        if gd is None:
            return
        if cbid == ids.get("GRAPHNODE_CREATED"):
            self._sink.node_created(
                _graph_id(cupti, gd.graph),
                _node_id(cupti, gd.node),
                int(gd.node_type),
                threading.get_ident(),
                self._capture,
            )
        elif cbid == ids.get("GRAPHNODE_CLONED"):
            self._sink.node_cloned(_node_id(cupti, gd.node), _node_id(cupti, gd.original_node))
        elif cbid == ids.get("GRAPH_CLONED"):
            self._sink.graph_cloned(_graph_id(cupti, gd.graph), _graph_id(cupti, gd.original_graph))


def status_of(exc: BaseException) -> int | None:
    status = getattr(exc, "status", None)
    try:
        return int(status) if status is not None else None
    except (TypeError, ValueError):
        return None


def guess_other_cupti_users(old_subscriber_name: str = "") -> list[str]:
    """Best guesses at who else holds CUPTI in this process, most likely first.

    Example::

        >>> isinstance(guess_other_cupti_users(), list)
        True
    """
    who: list[str] = []
    if old_subscriber_name and old_subscriber_name.strip("<>") != "not provided":
        who.append(f"the subscriber named {old_subscriber_name!r}")
    if "torch" in sys.modules:
        from graphtree import _torch

        if _torch.torch_profiler_active():
            who.append("torch.profiler (a torch.profiler.profile() / Kineto session is running)")
    inj = os.environ.get("CUDA_INJECTION64_PATH", "")
    low = inj.lower()
    keys = " ".join(os.environ).upper()
    if "sanitizer" in low or "SANITIZER" in keys:
        who.append("compute-sanitizer")
    if "nsys" in low or "nsight-systems" in low or "toolsinjection" in low or "NSYS_" in keys:
        who.append("Nsight Systems (nsys)")
    if "ncu" in low or "nsight-compute" in low or "nsight_compute" in low or "NV_COMPUTE_PROFILER" in keys:
        who.append("Nsight Compute (ncu)")
    if inj and not any(w for w in who if "Nsight" in w or "sanitizer" in w):
        who.append(f"the CUDA injection library {inj!r} (CUDA_INJECTION64_PATH)")
    if not who and "torch.profiler" in sys.modules:  # only a guess when nothing else explains it
        who.append("torch.profiler/Kineto from an earlier session (Kineto may keep its CUPTI subscription)")
    if "dcgm" in keys.lower():
        who.append("DCGM profiling")
    return who


def busy_message(old_subscriber_name: str = "") -> str:
    who = guess_other_cupti_users(old_subscriber_name)
    likely = (
        " or ".join(who)
        if who
        else "another CUPTI-based tool (torch.profiler, Nsight Systems/Compute, compute-sanitizer)"
    )
    return (
        "graphtree.profile cannot start: CUPTI already has a subscriber in this process "
        f"(CUPTI_ERROR_MULTIPLE_SUBSCRIBERS_NOT_SUPPORTED); likely {likely}. CUPTI allows one "
        "profiler at a time: stop the other one first (leave the torch.profiler.profile() block, or "
        "run without nsys/ncu/compute-sanitizer), or profile in a separate process."
    )


def _graph_data(cupti: Any, cbdata: Any) -> Any:
    if hasattr(cbdata, "node") and hasattr(cbdata, "original_node"):
        return cbdata
    ptr = getattr(cbdata, "resource_descriptor", 0)
    if not ptr:
        return None
    return cupti.GraphData.from_ptr(int(ptr), True)


def _graph_id(cupti: Any, handle: Any) -> int:
    h = int(handle or 0)
    return int(cupti.get_graph_id(h)) if h else 0


def _node_id(cupti: Any, handle: Any) -> int:
    h = int(handle or 0)
    return int(cupti.get_graph_node_id(h)) if h else 0
