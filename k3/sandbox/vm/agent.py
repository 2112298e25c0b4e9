"""The guest agent: PID 1 of a microVM sandbox, serving the host over a virtio-serial port.

Runs inside the guest under the image's ``python3`` (standard library only; it is copied into
the initramfs, not imported by the host). Frames both ways are a 4-byte big-endian length and a
JSON object; bytes travel base64-encoded. Each request carries an ``id`` that its answer repeats,
so the host can drop an answer that comes after it stopped waiting.

PID 1 only reaps orphans; a forked child serves requests, so ``subprocess`` keeps the exit
status of its own children (a reaping PID 1 would steal them).
"""

import base64
import json
import os
import select
import signal
import struct
import subprocess
import sys
import time

PORT_NAME = "k3.agent"
MAX_REQUEST = 256 << 20


def find_port():
    for entry in sorted(os.listdir("/sys/class/virtio-ports")):
        try:
            with open("/sys/class/virtio-ports/%s/name" % entry) as f:
                if f.read().strip() == PORT_NAME:
                    return "/dev/" + entry
        except OSError:
            continue
    raise SystemExit("k3 agent: no virtio port named " + PORT_NAME)


def read_exact(fd, n):
    chunks = []
    while n:
        chunk = os.read(fd, min(n, 1 << 20))
        if not chunk:
            time.sleep(0.01)  # the host end is not connected (between restores): wait for it
            continue
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def send(fd, message):
    body = json.dumps(message).encode()
    view = memoryview(struct.pack(">I", len(body)) + body)
    while view:
        view = view[os.write(fd, view):]


def run_command(request):
    max_output = int(request.get("max_output", 16 << 20))
    timeout = request.get("timeout")
    stdin = base64.b64decode(request.get("stdin") or "")
    start = time.monotonic()
    try:
        process = subprocess.Popen(request["argv"], cwd=request.get("cwd") or "/", env=request.get("env") or {},
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   start_new_session=True)
    except OSError as error:
        return {"ok": True, "stdout": "", "stderr": "", "exit_code": 127, "timed_out": False, "truncated": False,
                "duration": time.monotonic() - start, "start_error": str(error)}
    if stdin:
        try:
            process.stdin.write(stdin)
        except OSError:
            pass
    process.stdin.close()
    out_fd, err_fd = process.stdout.fileno(), process.stderr.fileno()
    outputs = {out_fd: bytearray(), err_fd: bytearray()}
    open_fds = list(outputs)
    truncated = timed_out = False
    deadline = None if timeout is None else start + float(timeout)
    while open_fds:
        wait = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, _, _ = select.select(open_fds, [], [], wait)
        if not ready:
            timed_out = True
            break
        for fd in ready:
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                open_fds.remove(fd)
                continue
            room = max_output - len(outputs[fd])
            if len(chunk) > room:
                truncated = True
                chunk = chunk[:room]
            outputs[fd] += chunk
    if timed_out:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except OSError:
            pass
    # Background children may keep the pipes open no longer: the exec ends with its command.
    exit_code = process.wait()
    process.stdout.close()
    process.stderr.close()
    if exit_code < 0:
        exit_code = 128 - exit_code
    out, err = bytes(outputs[out_fd]), bytes(outputs[err_fd])
    return {"ok": True, "stdout": base64.b64encode(out).decode(), "stderr": base64.b64encode(err).decode(),
            "exit_code": exit_code, "timed_out": timed_out, "truncated": truncated,
            "duration": time.monotonic() - start, "start_error": None}


def handle(request):
    op = request.get("op")
    if op == "ping":
        return {"ok": True, "pid": os.getpid()}
    if op == "exec":
        return run_command(request)
    if op == "read":
        with open(request["path"], "rb") as f:
            return {"ok": True, "data": base64.b64encode(f.read()).decode()}
    if op == "write":
        for entry in request["entries"]:
            path = entry["path"]
            if entry.get("dir"):
                os.makedirs(path, exist_ok=True)
            else:
                os.makedirs(os.path.dirname(path) or "/", exist_ok=True)
                with open(path, "wb") as f:
                    f.write(base64.b64decode(entry["data"]))
            if entry.get("mode") is not None:
                os.chmod(path, entry["mode"])
        return {"ok": True}
    return {"ok": False, "error": "unknown op %r" % (op,)}


def serve():
    fd = os.open(find_port(), os.O_RDWR)
    send(fd, {"id": 0, "ok": True, "hello": True, "pid": os.getpid()})
    while True:
        size = struct.unpack(">I", read_exact(fd, 4))[0]
        if size > MAX_REQUEST:
            raise SystemExit("k3 agent: request of %d bytes is over the limit" % size)
        request = json.loads(read_exact(fd, size))
        try:
            answer = handle(request)
        except OSError as error:
            answer = {"ok": False, "error": str(error), "errno": error.errno}
        except Exception as error:  # noqa: BLE001 - every failure goes back to the host as text
            answer = {"ok": False, "error": "%s: %s" % (type(error).__name__, error)}
        answer["id"] = request.get("id")
        send(fd, answer)


def main():
    if os.getpid() != 1:
        serve()
        return
    child = os.fork()
    if child == 0:
        serve()
        os._exit(0)
    while True:  # PID 1 reaps every orphan; the machine powers off if the agent dies
        try:
            pid, _ = os.wait()
        except ChildProcessError:
            time.sleep(1)
            continue
        if pid == child:
            sys.stderr.write("k3 agent: the serving process exited\n")
            os.system("echo o > /proc/sysrq-trigger")


if __name__ == "__main__":
    main()
