"""The host side of the guest agent's protocol (see ``agent.py``): framed JSON over a socket.

The guest is untrusted: every wait has a deadline, a frame longer than ``max_bytes`` is refused
before it is read, and anything that is not a JSON object with the expected ``id`` is an error.
After any such failure the channel is *broken* (the stream may be mid-frame) and refuses calls;
the sandbox must be restored or closed.
"""

from __future__ import annotations

import json
import math
import select
import socket
import struct
import time

from k3.sandbox.local import SandboxError


class AgentError(SandboxError):
    """The guest agent did not answer as the protocol says (late, oversized or malformed)."""


class AgentTimeout(AgentError, TimeoutError):
    """The guest agent did not answer within its deadline."""


class Channel:
    """One connection to a guest agent. ``call`` sends a request and waits for its answer."""

    def __init__(self, sock: socket.socket, max_bytes: int) -> None:
        self.sock = sock
        self.max_bytes = max_bytes
        self.broken: str | None = None
        self._next_id = 1
        self._buffer = bytearray()
        sock.setblocking(False)

    def call(self, request: dict, timeout: float) -> dict:
        """Send ``request`` and return the answer with the same id, within ``timeout`` seconds."""
        if self.broken:
            raise AgentError(f"the guest agent's channel is broken ({self.broken}); restore or close the sandbox")
        request_id = self._next_id
        self._next_id += 1
        deadline = time.monotonic() + timeout
        try:
            self._send(dict(request, id=request_id), deadline)
            while True:
                answer = self.receive(deadline)
                if answer.get("id") == request_id:
                    return answer
                # An answer to an earlier request the host stopped waiting for: drop it.
        except AgentError as error:
            self.broken = str(error)
            raise

    def receive(self, deadline: float) -> dict:
        """The next frame as a dict (the hello of a freshly booted agent, or an answer)."""
        header = self._read(4, deadline)
        size = struct.unpack(">I", header)[0]
        if size > self.max_bytes:
            self.broken = f"a frame of {size} bytes, over the limit of {self.max_bytes}"
            raise AgentError(f"the guest agent sent a frame of {size} bytes, over the limit of {self.max_bytes} "
                             "(raise VmConfig.max_reply_bytes, or lower max_output)")
        body = self._read(size, deadline)
        try:
            message = json.loads(body)
        except ValueError as error:
            raise AgentError(f"the guest agent sent a frame that is not JSON: {error}") from None
        if not isinstance(message, dict):
            raise AgentError(f"the guest agent sent a {type(message).__name__}, not a JSON object")
        return message

    def _send(self, message: dict, deadline: float) -> None:
        body = json.dumps(message).encode()
        view = memoryview(struct.pack(">I", len(body)) + body)
        poller = select.poll()
        poller.register(self.sock, select.POLLOUT)
        while view:
            if not poller.poll(_left_ms(deadline)):
                raise AgentTimeout("the guest agent did not take a request before its deadline")
            try:
                view = view[self.sock.send(view):]
            except BlockingIOError:
                continue
            except OSError as error:
                raise AgentError(f"the guest agent's connection failed: {error}") from None

    def _read(self, n: int, deadline: float) -> bytes:
        poller = select.poll()
        poller.register(self.sock, select.POLLIN)
        while len(self._buffer) < n:
            if not poller.poll(_left_ms(deadline)):
                raise AgentTimeout("the guest agent did not answer before its deadline")
            try:
                chunk = self.sock.recv(min(1 << 20, max(n - len(self._buffer), 1 << 16)))
            except BlockingIOError:
                continue
            except OSError as error:
                raise AgentError(f"the guest agent's connection failed: {error}") from None
            if not chunk:
                raise AgentError("the guest agent's connection closed (QEMU exited?)")
            self._buffer += chunk
        data = bytes(self._buffer[:n])
        del self._buffer[:n]
        return data

    def close(self) -> None:
        self.broken = self.broken or "closed"
        self.sock.close()


def _left_ms(deadline: float) -> int:
    return max(0, math.ceil((deadline - time.monotonic()) * 1000))  # never wake before the deadline
