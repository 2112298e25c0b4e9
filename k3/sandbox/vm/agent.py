"""The guest agent: PID 1 of a microVM sandbox, serving the host over a virtio-serial port.

Runs inside the guest under the image's ``python3`` (standard library only; it is copied into
the initramfs, not imported by the host). Frames both ways are a 4-byte big-endian length and a
JSON object; bytes travel base64-encoded. Each request carries an ``id`` that its answer repeats,
so the host can drop an answer that comes after it stopped waiting.

PID 1 only reaps orphans; a forked child serves requests, so ``subprocess`` keeps the exit
status of its own children (a reaping PID 1 would steal them).

Commands and REPLs run in the cgroup ``/sys/fs/cgroup/k3`` whose ``pids.max`` each request sets
(``Limits.pids``): a fork bomb stops there and the agent, outside it, keeps answering. A REPL
(``repl_call``) is the image's ``python3`` running ``repl_server.py`` with frames on fds 3 and 4,
as in the local backend; it lives in guest memory, so a snapshot keeps it, variables and all.
The offline web relay (``web_on``) is a child listening on a Unix socket in the guest that passes
each request over a second virtio-serial port to the host.
"""

import base64
import json
import marshal
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import time

PORT_NAME = "k3.agent"
WEB_PORT_NAME = "k3.web"
MAX_REQUEST = 256 << 20
CGROUP = "/sys/fs/cgroup/k3"
REPL_GRACE_S = 2.0
REPLY_OVERHEAD = 1 << 16
REPLS = {}  # name -> {"process", "to", "from", "out", "err"}
WEB = {"pid": None}


def find_port(name=PORT_NAME):
    for entry in sorted(os.listdir("/sys/class/virtio-ports")):
        try:
            with open("/sys/class/virtio-ports/%s/name" % entry) as f:
                if f.read().strip() == name:
                    return "/dev/" + entry
        except OSError:
            continue
    raise SystemExit("k3 agent: no virtio port named " + name)


def setup_cgroup():
    """The cgroup commands run in (pids.max per request); the agent stays outside it."""
    try:  # /init mounted cgroup2 at /sys/fs/cgroup
        with open("/sys/fs/cgroup/cgroup.subtree_control", "w") as f:
            f.write("+pids")
        os.makedirs(CGROUP, exist_ok=True)
    except OSError as error:
        sys.stderr.write("k3 agent: no pids cgroup (%s)\n" % error)


def set_pids_limit(pids):
    try:
        with open(CGROUP + "/pids.max", "w") as f:
            f.write("max" if pids is None else str(int(pids)))
    except OSError:
        pass


def join_cgroup():  # runs in the child between fork and exec
    try:
        with open(CGROUP + "/cgroup.procs", "w") as f:
            f.write("0")
    except OSError:
        pass


def oom_kills():
    try:
        with open("/proc/vmstat") as f:
            for line in f:
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


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
    set_pids_limit(request.get("pids"))
    oom_before = oom_kills()
    try:
        process = subprocess.Popen(request["argv"], cwd=request.get("cwd") or "/", env=request.get("env") or {},
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   start_new_session=True, preexec_fn=join_cgroup)
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
            "duration": time.monotonic() - start, "start_error": None, "oom_killed": oom_kills() > oom_before}


# -- REPLs ------------------------------------------------------------------------------------

def frame(message):
    body = marshal.dumps(message)
    return struct.pack("<I", len(body)) + body


def repl_start(name, start):
    to_r, to_w = os.pipe()
    from_r, from_w = os.pipe()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()

    def child():  # between fork and exec: fds 3 and 4 are the REPL server's request and answer pipes
        copies = os.dup(to_r), os.dup(from_w)
        os.dup2(copies[0], 3)
        os.dup2(copies[1], 4)
        for fd in copies:
            if fd not in (3, 4):
                os.close(fd)
        join_cgroup()
        try:
            with open("/proc/self/oom_score_adj", "w") as f:
                f.write("500")  # past the guest's memory the REPL goes, not the agent
        except OSError:
            pass

    try:  # close_fds=False: the dup2 copies must stay (every other fd of the agent is close-on-exec)
        process = subprocess.Popen([start["python"], "-u", "-c", start["code"]], cwd=start.get("cwd") or "/",
                                   env=start.get("env") or {}, stdin=subprocess.DEVNULL, stdout=out_w, stderr=err_w,
                                   close_fds=False, start_new_session=True, preexec_fn=child)
    finally:
        for fd in (to_r, from_w, out_w, err_w):
            os.close(fd)
    REPLS[name] = {"process": process, "to": to_w, "from": from_r, "out": out_r, "err": err_r}


def repl_kill(name):
    repl = REPLS.pop(name, None)
    if repl is None:
        return False
    try:
        os.killpg(repl["process"].pid, signal.SIGKILL)  # the REPL and whatever its cells started
    except OSError:
        pass
    repl["process"].wait()
    for key in ("to", "from", "out", "err"):
        os.close(repl[key])
    return True


def repl_call(request):
    """Send one message to the REPL ``name`` (started from ``start`` when it is not running, or
    answered with ``missing``), capture its output until it answers, dies or times out."""
    name = request["name"]
    repl = REPLS.get(name)
    if repl is not None and repl["process"].poll() is not None:
        repl_kill(name)
        repl = None
    set_pids_limit(request.get("pids"))
    if repl is None:
        if not request.get("start"):
            return {"ok": True, "missing": True}
        repl_start(name, request["start"])
        repl = REPLS[name]
    limit = int(request.get("max_output", 1 << 20))
    outputs = {repl["out"]: bytearray(), repl["err"]: bytearray()}
    truncated = died = timed_out = interrupted = oversized = False
    reply_buffer = bytearray()
    reply = None
    started = time.monotonic()
    oom_before = oom_kills()
    timeout = request.get("timeout")
    deadline = None if timeout is None else started + float(timeout)
    data = memoryview(frame(request["message"]))
    os.set_blocking(repl["to"], False)
    poller = select.poll()
    for fd in (repl["from"], repl["out"], repl["err"]):
        poller.register(fd, select.POLLIN)
    writing = True
    poller.register(repl["to"], select.POLLOUT)
    while reply is None and not died:
        wait_ms = None
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                if interrupted or writing:
                    break  # no answer even to SIGINT (or the message never went in): killed below
                timed_out = interrupted = True
                try:
                    os.kill(repl["process"].pid, signal.SIGINT)
                except OSError:
                    died = True
                deadline = time.monotonic() + REPL_GRACE_S
                continue
            wait_ms = int(left * 1000) + 1
        for fd, event in poller.poll(wait_ms):
            if fd == repl["to"]:
                try:
                    data = data[os.write(fd, data):]
                except BlockingIOError:
                    continue
                except OSError:
                    died = True
                    break
                if not data:
                    writing = False
                    poller.unregister(fd)
                continue
            chunk = os.read(fd, 1 << 20)
            if fd == repl["from"]:
                if not chunk:
                    died = True
                    break
                reply_buffer += chunk
                if len(reply_buffer) >= 4:
                    size = struct.unpack("<I", reply_buffer[:4])[0]
                    if size > limit + REPLY_OVERHEAD:
                        oversized = died = True
                        break
                    if len(reply_buffer) >= 4 + size:
                        reply = marshal.loads(bytes(reply_buffer[4:4 + size]))
                continue
            if not chunk:
                poller.unregister(fd)
                continue
            room = limit - len(outputs[fd])
            outputs[fd] += chunk[:max(room, 0)]
            truncated |= room < len(chunk)
    if timed_out is False and reply is None and not died:
        timed_out = True
    for fd in (repl["out"], repl["err"]):  # the REPL flushed before answering: take the rest
        os.set_blocking(fd, False)
        try:
            while True:
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    break
                room = limit - len(outputs[fd])
                outputs[fd] += chunk[:max(room, 0)]
                truncated |= room < len(chunk)
        except BlockingIOError:
            pass
        os.set_blocking(fd, True)
    out, err = bytes(outputs[repl["out"]]), bytes(outputs[repl["err"]])
    killed = reply is None
    if killed:
        repl_kill(name)
    if oversized:
        err += b"k3 sandbox: the REPL sent a reply larger than max_output; it was killed\n"
    return {"ok": True, "reply": reply, "stdout": base64.b64encode(out).decode(), "stderr": base64.b64encode(err).decode(),
            "timed_out": timed_out, "died": died, "killed": killed, "truncated": truncated,
            "oom_killed": oom_kills() > oom_before, "duration": time.monotonic() - started}


# -- the offline web relay ----------------------------------------------------------------------

def read_frame(read):
    data = bytearray()
    size = None
    while True:
        need = (4 if size is None else 4 + size) - len(data)
        if need <= 0:
            if size is None:
                size = struct.unpack("<I", data[:4])[0]
                if size > 1 << 20:
                    return None  # a request is a query or a URL: a megabyte is already absurd
                continue
            return bytes(data[4:])
        chunk = read(min(need, 1 << 20))
        if not chunk:
            return None
        data += chunk


def web_on(request):
    """Start the relay: a Unix socket at ``path`` whose requests go to the host over the web port."""
    if WEB["pid"] is not None:
        try:
            pid, _ = os.waitpid(WEB["pid"], os.WNOHANG)
            if pid == 0:
                return {"ok": True, "path": request["path"]}
        except ChildProcessError:
            pass
        WEB["pid"] = None  # it died: start another
    try:
        port = os.open(find_port(WEB_PORT_NAME), os.O_RDWR)
    except SystemExit as error:  # a machine without the port: an error for the host, not the agent's end
        return {"ok": False, "error": str(error)}
    path = request["path"]
    os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
    if os.path.lexists(path):
        os.unlink(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    os.chmod(path, 0o666)
    listener.listen(16)
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            web_relay(listener, port)
        except BaseException:  # noqa: BLE001 - the relay dies; clients see a closed socket
            code = 1
        os._exit(code)
    listener.close()
    os.close(port)
    WEB["pid"] = pid
    return {"ok": True, "path": path}


def web_relay(listener, port):
    def read_port(n):
        while True:  # an empty read: the host end is not connected (between restores); wait for it
            chunk = os.read(port, n)
            if chunk:
                return chunk
            time.sleep(0.01)

    while True:  # one request per connection, served in turn
        connection, _ = listener.accept()
        try:
            connection.settimeout(10.0)
            body = read_frame(connection.recv)
            if body is None:
                continue
            data = memoryview(struct.pack("<I", len(body)) + body)
            while data:
                data = data[os.write(port, data):]
            answer = read_frame(read_port)
            if answer is None:
                continue
            connection.sendall(struct.pack("<I", len(answer)) + answer)
        except OSError:
            pass
        finally:
            connection.close()


def handle(request):
    op = request.get("op")
    if op == "ping":
        return {"ok": True, "pid": os.getpid()}
    if op == "exec":
        return run_command(request)
    if op == "repl_call":
        return repl_call(request)
    if op == "repl_alive":
        repl = REPLS.get(request["name"])
        return {"ok": True, "alive": repl is not None and repl["process"].poll() is None}
    if op == "repl_stop":
        return {"ok": True, "stopped": repl_kill(request["name"])}
    if op == "web_on":
        return web_on(request)
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
    setup_cgroup()
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
