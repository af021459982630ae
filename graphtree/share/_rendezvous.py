"""The rendezvous of ``graphtree.share``: a Unix-domain socket that hands out file descriptors to
processes it trusts.

GPU memory exported as a POSIX file descriptor (``cuMemExportToShareableHandle``) is opened by
whoever holds the descriptor, so descriptors must travel only to trusted peers. This channel is
that path, and nothing else: a producer runs a :class:`Server` on a socket file; a consumer sends a
small JSON request with :func:`request` and gets a JSON reply plus descriptors (``SCM_RIGHTS``).

Trust, checked by the kernel, not claimed by the peer: the server reads the connecting process's
credentials (``SO_PEERCRED``) and serves only its own user and the uids in ``allow_uids``; the
socket file is created owner-only (0600) inside an owner-only directory (0700). Nothing is
written to disk but the socket file, and no handle is ever printed.

Every wait has a timeout; a malformed or oversized request gets an error reply and never stops the
server. The GPU side is :mod:`graphtree.share._memory`; the public API is
:class:`graphtree.share.Publisher` and :func:`graphtree.share.attach`.

Example::

    server = Server(path, handler=lambda req, peer: ({"echo": req}, []))
    reply, fds = request(path, {"name": "logits"})
    server.close()
"""

from __future__ import annotations

import json
import os
import socket
import struct
import threading
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

__all__ = ["MAX_MESSAGE", "Peer", "RefusedError", "Server", "default_path", "request"]

MAX_MESSAGE = 64 * 1024
"""Bytes a request or reply may have (they carry names and metadata, never tensor data)."""

_HEADER = struct.Struct("!I")  # message length, then the JSON bytes
_MAX_FDS = 64


class Peer(NamedTuple):
    """The connecting process, as the kernel reports it (``SO_PEERCRED``)."""

    pid: int
    uid: int
    gid: int


class RefusedError(PermissionError):
    """The server would not serve this process (its user is not allowed), or refused the request."""


def default_path(name: str) -> str:
    """``$XDG_RUNTIME_DIR/graphtree/<name>.sock``, else ``/tmp/graphtree-<uid>/<name>.sock``.

    Example::

        default_path("decoder")   # '/run/user/1000/graphtree/decoder.sock'
    """
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"a rendezvous name is a plain file name, got {name!r}")
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    folder = os.path.join(runtime, "graphtree") if runtime else f"/tmp/graphtree-{os.getuid()}"
    return os.path.join(folder, f"{name}.sock")


def _private_dir(folder: str) -> None:
    os.makedirs(folder, mode=0o700, exist_ok=True)
    st = os.stat(folder)
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PermissionError(
            f"{folder} must belong to you and be private (mode 0700) to hold a rendezvous socket; "
            f"it is owned by uid {st.st_uid} with mode {oct(st.st_mode & 0o777)}"
        )


def _send(sock: socket.socket, message: dict[str, Any], fds: Iterable[int] = ()) -> None:
    data = json.dumps(message).encode()
    if len(data) > MAX_MESSAGE:
        raise ValueError(f"message of {len(data)} bytes is larger than {MAX_MESSAGE}")
    fds = list(fds)
    payload = _HEADER.pack(len(data)) + data
    if fds:
        socket.send_fds(sock, [payload], fds)
    else:
        sock.sendall(payload)


def _recv_exact(sock: socket.socket, n: int, fds: list[int]) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk, got, _flags, _addr = socket.recv_fds(sock, n - len(buf), _MAX_FDS)
        fds.extend(got)
        if not chunk:
            raise ConnectionError("the other side closed the connection mid-message")
        buf += chunk
    return buf


def _recv(sock: socket.socket) -> tuple[dict[str, Any], list[int]]:
    fds: list[int] = []
    try:
        (n,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size, fds))
        if n > MAX_MESSAGE:
            raise ValueError(f"message of {n} bytes is larger than {MAX_MESSAGE}")
        message = json.loads(_recv_exact(sock, n, fds))
        if not isinstance(message, dict):
            raise ValueError("a message is a JSON object")
        return message, fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


class Server:
    """Serve requests on a socket file, to this user's processes and ``allow_uids``.

    ``handler(request, peer) -> (reply, fds)`` runs in the server's thread for each request of a
    trusted peer; the descriptors are sent with the reply (the server keeps its own copies: the
    handler decides their lifetime). An exception in the handler becomes an error reply.
    ``close()`` stops the thread and removes the socket file.

    Example::

        with Server(default_path("decoder"), handler=serve) as server:
            run_producer()
    """

    def __init__(
        self,
        path: str,
        *,
        handler: Callable[[dict[str, Any], Peer], tuple[dict[str, Any], list[int]]],
        allow_uids: Iterable[int] = (),
        timeout: float = 5.0,
    ) -> None:
        self.path = path
        self.allowed = {os.getuid(), *(int(u) for u in allow_uids)}
        self.timeout = timeout
        self._handler = handler
        _private_dir(os.path.dirname(path) or ".")
        if os.path.exists(path):
            raise FileExistsError(f"{path} exists: another producer serves it, or one died (remove it)")
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # the socket file is born 0600: no window where others may connect
        try:
            self._sock.bind(path)
        finally:
            os.umask(old)
        self._sock.listen(16)
        self._sock.settimeout(0.2)  # so that close() is noticed
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=f"graphtree.share {path}", daemon=True)
        self._thread.start()

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop serving and remove the socket file (idempotent)."""
        if self._closing.is_set():
            return
        self._closing.set()
        self._thread.join()
        self._sock.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def _serve(self) -> None:
        while not self._closing.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with conn:
                conn.settimeout(self.timeout)
                try:
                    self._one(conn)
                except (OSError, ValueError):
                    pass  # a peer that went away or spoke nonsense: the next one is served

    def _one(self, conn: socket.socket) -> None:
        pid, uid, gid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))
        peer = Peer(pid, uid, gid)
        if uid not in self.allowed:
            _send(conn, {"error": f"refused: uid {uid} is not allowed (pass allow_uids= to the producer)"})
            return
        try:
            message, fds = _recv(conn)
        except (ValueError, json.JSONDecodeError) as e:
            _send(conn, {"error": f"bad request: {e}"})
            return
        for fd in fds:  # a consumer has nothing to send us
            os.close(fd)
        try:
            reply, out_fds = self._handler(message, peer)
        except Exception as e:  # noqa: BLE001 - the consumer gets the reason, the server goes on
            _send(conn, {"error": f"{type(e).__name__}: {e}"})
            return
        _send(conn, reply, out_fds)


def request(path: str, message: dict[str, Any], *, timeout: float = 5.0) -> tuple[dict[str, Any], list[int]]:
    """Send ``message`` to the server at ``path``; returns its reply and the descriptors it sent
    (the caller owns them and must close them).

    Raises ``FileNotFoundError`` when nobody serves ``path``, :class:`RefusedError` when the
    server refuses this process or the request, ``TimeoutError`` after ``timeout`` seconds.

    Example::

        reply, fds = request(default_path("decoder"), {"name": "logits"})
    """
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        try:
            sock.connect(path)
        except (FileNotFoundError, ConnectionRefusedError) as e:
            raise FileNotFoundError(f"no graphtree.share producer serves {path} ({e.strerror})") from None
        try:
            _send(sock, message)
        except (BrokenPipeError, ConnectionResetError):
            pass  # refused before reading: the reply says why
        reply, fds = _recv(sock)
    if "error" in reply:
        for fd in fds:
            os.close(fd)
        raise RefusedError(f"{path}: {reply['error']}")
    return reply, fds
