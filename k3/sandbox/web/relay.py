"""The host's side of the offline web in a sandbox: answers the requests PID 1 relays.

``attach(box, tools)`` asks the sandbox's supervisor to listen on a Unix socket inside the
sandbox (``web_on``, see ``supervisor_extra.py``), installs the client ``/usr/local/bin/web``, and
starts a host thread that reads requests from that supervisor's upcall socket pair, runs them
through ``WebTools.call`` and writes the answers back. The thread ends when the supervisor does
(its socket pair closes). A request is JSON; nothing in it is used as a host path.
"""

from __future__ import annotations

import json
import os
import socket
import struct
import threading

from k3.sandbox.local import SandboxError

CLIENT_PATH = "/usr/local/bin/web"
CLIENT_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "client.py")
MAX_REQUEST = 1 << 20
SEND_TIMEOUT_S = 10.0


def _read_exact(sock: socket.socket, n: int) -> bytes | None:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            return None
        data += chunk
    return bytes(data)


def serve(upcall: socket.socket, tools) -> None:
    """Answer framed JSON requests on ``upcall`` until it closes."""
    while True:
        try:
            header = _read_exact(upcall, 4)
            if header is None:
                return
            size = struct.unpack("<I", header)[0]
            body = _read_exact(upcall, size) if size <= MAX_REQUEST else None
            if body is None:
                return
            try:
                request = json.loads(body)
                answer = tools.call(request) if isinstance(request, dict) else {"ok": False, "error": "a request is a JSON object"}
            except Exception as error:  # noqa: BLE001 - a hostile request must not end the serving thread
                answer = {"ok": False, "error": f"bad request: {type(error).__name__}: {error}"}
            data = json.dumps(answer).encode()
            # The relay in the sandbox may stop reading (its code is the sandbox's to tamper with):
            # an answer that cannot be sent in time ends this thread, not the host.
            upcall.settimeout(SEND_TIMEOUT_S)
            try:
                upcall.sendall(struct.pack("<I", len(data)) + data)
            finally:
                upcall.settimeout(None)
        except OSError:
            return  # the supervisor is gone (sandbox closed or restored)


def attach(box, tools, socket_path: str = "/run/k3/web.sock") -> None:
    """Start the relay in ``box``'s current generation (idempotent per generation)."""
    supervisor = box._supervisor
    if getattr(supervisor, "web_thread", None) is not None:
        return
    answer = box._request({"op": "web_on", "path": socket_path})
    if not answer["ok"]:
        raise SandboxError(f"could not start the web relay in sandbox {box.id}: {answer['error']}")
    with open(CLIENT_SOURCE, "rb") as f:
        box.write_file(CLIENT_PATH, f.read(), mode=0o755)
    thread = threading.Thread(target=serve, args=(supervisor.upcall, tools), name=f"k3-web-{box.id}", daemon=True)
    supervisor.web_thread = thread
    thread.start()
