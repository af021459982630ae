"""The rendezvous socket of graphtree.share (CPU only): descriptors reach trusted peers only."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
import threading

import pytest

from graphtree.share._rendezvous import MAX_MESSAGE, RefusedError, Server, default_path, request


@pytest.fixture
def sock_path(tmp_path):
    folder = tmp_path / "rv"
    return str(folder / "p.sock")


def _file_fd(text: str) -> int:
    with tempfile.TemporaryFile() as f:
        f.write(text.encode())
        f.flush()
        return os.dup(f.fileno())  # the file object goes; the descriptor stays


def test_a_request_gets_the_reply_and_working_descriptors(sock_path):
    fd = _file_fd("shared bytes")
    seen = []

    def handler(req, peer):
        seen.append(peer)
        return {"name": req["name"], "size": 12}, [fd]

    with Server(sock_path, handler=handler):
        reply, fds = request(sock_path, {"name": "logits"})
    assert reply == {"name": "logits", "size": 12} and len(fds) == 1
    assert os.pread(fds[0], 100, 0) == b"shared bytes"  # the same open file
    os.close(fds[0])
    os.close(fd)
    assert seen[0].pid == os.getpid() and seen[0].uid == os.getuid()
    assert not os.path.exists(sock_path)  # close() removed the socket file


def test_the_socket_is_owner_only_in_an_owner_only_directory(sock_path):
    with Server(sock_path, handler=lambda r, p: ({}, [])):
        assert stat.S_IMODE(os.stat(sock_path).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(os.path.dirname(sock_path)).st_mode) == 0o700


def test_a_shared_directory_is_refused(tmp_path):
    folder = tmp_path / "open"
    folder.mkdir()
    folder.chmod(0o777)
    with pytest.raises(PermissionError, match="private"):
        Server(str(folder / "p.sock"), handler=lambda r, p: ({}, []))


_OTHER_USER = """
import os, sys
from graphtree.share._rendezvous import RefusedError, request  # imported as root: /root is private
os.setgid(65534); os.setuid(65534)
try:
    reply, fds = request(sys.argv[1], {"name": "x"}, timeout=5)
    print("SERVED", reply, len(fds))
except RefusedError as e:
    print("REFUSED", e)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a child as another user")
@pytest.mark.parametrize("allowed", [False, True])
def test_another_user_is_refused_unless_allowed(allowed):
    base = tempfile.mkdtemp(dir="/tmp")  # pytest's tmp_path lies under a private directory
    os.chmod(base, 0o755)
    folder = os.path.join(base, "rv")
    path = os.path.join(folder, "p.sock")
    fd = _file_fd("secret")
    with Server(path, handler=lambda r, p: ({"ok": True}, [fd]), allow_uids=[65534] if allowed else []):
        os.chmod(folder, 0o711)  # let the other user reach the socket: only the server's own check remains
        os.chmod(path, 0o666)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        out = subprocess.run(
            [sys.executable, "-c", _OTHER_USER, path], check=False, capture_output=True, text=True, timeout=60, env=env
        )
    os.close(fd)
    shutil.rmtree(base)
    assert out.returncode == 0, out.stderr
    if allowed:
        assert out.stdout.startswith("SERVED {'ok': True} 1"), out.stdout
    else:
        assert out.stdout.startswith("REFUSED") and "uid 65534 is not allowed" in out.stdout, out.stdout


def test_bad_input_gets_clear_errors_and_the_server_goes_on(sock_path):
    def handler(req, peer):
        if req.get("name") != "logits":
            raise KeyError(f"no tensor named {req.get('name')!r}")
        return {"ok": True}, []

    with Server(sock_path, handler=handler):
        with pytest.raises(RefusedError, match="no tensor named 'nope'"):
            request(sock_path, {"name": "nope"})
        with pytest.raises(ValueError, match="larger than"):
            request(sock_path, {"name": "x" * (MAX_MESSAGE + 1)})
        assert request(sock_path, {"name": "logits"})[0] == {"ok": True}  # still serving
    with pytest.raises(FileNotFoundError, match=r"no graphtree\.share producer serves"):
        request(sock_path, {"name": "logits"})
    with pytest.raises(ValueError, match="plain file name"):
        default_path("../x")


def test_a_silent_server_times_out(sock_path):
    release = threading.Event()

    def slow(req, peer):
        release.wait(10)
        return {}, []

    with Server(sock_path, handler=slow):
        with pytest.raises(TimeoutError):
            request(sock_path, {"name": "x"}, timeout=0.3)
        release.set()


def test_a_thousand_requests_leak_no_descriptor(sock_path):
    fd = _file_fd("x")
    before = len(os.listdir("/proc/self/fd"))
    with Server(sock_path, handler=lambda r, p: ({}, [fd])):
        for _ in range(1000):
            _, fds = request(sock_path, {})
            for f in fds:
                os.close(f)
    os.close(fd)
    assert len(os.listdir("/proc/self/fd")) <= before
