"""Ops of the sandbox's PID 1 for long-lived processes: Python REPLs and the offline-web relay.

Not a module: ``supervisor.py`` reads and runs this file into its own globals at start (before
``pivot_root`` hides the host's files), so everything here may use its helpers (``send``,
``drop_privileges``, ``execvpe``, ...). Like the supervisor, it imports nothing after start.

A REPL is a ``python3`` of the image, started with no capabilities like any command, that runs
``repl_server.py`` (sent by the host as a string, so no file of ours lands in the sandbox). It
talks frames (4-byte length + marshal) on fds 3 (in) and 4 (out); its fds 1 and 2 are pipes that
the supervisor reads during a call, so output of the cell and of its subprocesses is captured per
call. A cell past its timeout gets SIGINT (KeyboardInterrupt: the REPL and its variables stay);
if it does not answer within ``REPL_GRACE_S`` the REPL's process group is killed, and only it.

The web relay is a child that listens on a Unix socket inside the sandbox and passes each request
to the host over the upcall socket pair (``UPCALL_FD``): the sandbox reaches the host's offline
web through its PID 1, with no network device and no path of the host in view.
"""

REPL_GRACE_S = 2.0
REPLY_OVERHEAD = 1 << 16  # a REPL's reply frame may exceed the call's max_output by this much
REPLS = {}  # name -> {"pid", "pidfd", "to", "from", "out", "err"}


def _frame(message):
    body = marshal.dumps(message)
    return struct.pack("<I", len(body)) + body


def _write_all(fd, data):
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _write_until(fd, data, deadline):
    """Write all of ``data`` to the pipe ``fd``; False when ``deadline`` passes first."""
    if deadline is None:
        _write_all(fd, data)
        return True
    view = memoryview(data)
    poller = select.poll()
    poller.register(fd, select.POLLOUT)
    os.set_blocking(fd, False)
    try:
        while view:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if poller.poll(int(left * 1000) + 1):
                try:
                    view = view[os.write(fd, view) :]
                except BlockingIOError:
                    pass
        return True
    finally:
        os.set_blocking(fd, True)


def repl_start(request):
    name = request["name"]
    if name in REPLS:
        repl_kill(REPLS.pop(name))
    to_r, to_w = os.pipe()
    from_r, from_w = os.pipe()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            null = os.open("/dev/null", os.O_RDONLY)
            # Move the pipes to 0..4 through high numbers first, so no dup2 clobbers a source.
            high = [os.dup(fd) for fd in (null, out_w, err_w, to_r, from_w)]
            for target, fd in enumerate(high):
                os.dup2(fd, target)
            os.closerange(5, 65536)
            for sig in (signal.SIGPIPE, signal.SIGCHLD, signal.SIGINT, signal.SIGTERM, signal.SIGXFSZ):
                signal.signal(sig, signal.SIG_DFL)
            os.setsid()
            os.setpriority(os.PRIO_PROCESS, 0, 0)
            try:
                with open("/proc/self/oom_score_adj", "w") as f:
                    f.write("500")  # past the memory limit the REPL goes, not PID 1
            except OSError:
                pass
            os.umask(0o022)
            os.chdir(request["cwd"])
            drop_privileges()
            # Only when this interpreter's own files are in the sandbox's root too (the host
            # checked that the image's python3 is this one; this checks its stdlib is there).
            if request.get("fork_server") and all(os.path.isdir(p) for p in sys.path if not p.endswith(".zip")):
                become_repl(request)  # never returns
            execvpe([request["python"], "-u", "-c", request["code"]], request["env"])
        except BaseException:  # noqa: BLE001 - the host sees the REPL die at start
            pass
        os._exit(127)
    for fd in (to_r, from_w, out_w, err_w):
        os.close(fd)
    REPLS[name] = {"pid": pid, "pidfd": os.pidfd_open(pid), "to": to_w, "from": from_r, "out": out_r, "err": err_r}
    return repl_call({"name": name, "message": {"op": "hello"}, "timeout": request.get("timeout", 30.0),
                      "max_output": 1 << 16})


def become_repl(request):
    """Run the REPL in this forked copy of PID 1 instead of starting a new python3: no interpreter
    start (tens of ms). The host asks for it only when the image's python3 is this interpreter,
    so the REPL is the same Python either way; its standard library is read from the image."""
    import io  # noqa: PLC0415 - built in and loaded at start: no file is read

    signal.signal(signal.SIGPIPE, signal.SIG_IGN)  # as python3 itself sets them:
    signal.signal(signal.SIGINT, signal.default_int_handler)  # SIGINT -> KeyboardInterrupt (timeouts)
    os.environ.clear()
    os.environ.update(request["env"])
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True, line_buffering=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True, line_buffering=True,
                                  errors="backslashreplace")
    code = 0
    try:
        try:
            import site  # noqa: PLC0415 - the image's site-packages, as a started python3 would have

            site.main()
        except Exception:  # noqa: BLE001 - a REPL without site-packages still works
            pass
        exec(compile(request["code"], "<string>", "exec"), {"__name__": "__k3_repl__", "__builtins__": __builtins__})
    except BaseException as error:  # noqa: BLE001 - the host sees the REPL die, and why
        try:
            sys.stderr.write(f"k3 REPL failed at start: {type(error).__name__}: {error}\n")
            sys.stderr.flush()
        except Exception:  # noqa: BLE001
            pass
        code = 1
    os._exit(code)


def repl_kill(repl):
    try:
        os.killpg(repl["pid"], signal.SIGKILL)  # the REPL and whatever its cells started
    except (ProcessLookupError, PermissionError):
        pass
    try:
        signal.pidfd_send_signal(repl["pidfd"], signal.SIGKILL)
    except ProcessLookupError:
        pass
    select.select([repl["pidfd"]], [], [], 5.0)
    for key in ("pidfd", "to", "from", "out", "err"):
        try:
            os.close(repl[key])
        except OSError:
            pass
    try:
        os.waitpid(repl["pid"], os.WNOHANG)
    except ChildProcessError:
        pass  # reaped by the SIGCHLD handler


def repl_call(request):
    """Send one message to a REPL, capture its output until it answers, dies or times out."""
    name = request["name"]
    repl = REPLS.get(name)
    if repl is None:
        return {"ok": False, "error": f"no REPL named {name!r} is running"}
    limit = request["max_output"]
    outputs = {repl["out"]: bytearray(), repl["err"]: bytearray()}
    truncated = False
    reply_buffer = bytearray()
    reply = None
    died = timed_out = interrupted = oversized = False
    started = time.monotonic()
    timeout = request.get("timeout")
    deadline = None if timeout is None else started + timeout
    try:
        # A REPL that does not read (stopped, say) must not hold PID 1: past the deadline and its
        # grace, the message is abandoned and the REPL killed below.
        if not _write_until(repl["to"], _frame(request["message"]), None if deadline is None else deadline + REPL_GRACE_S):
            timed_out = True
    except BrokenPipeError:
        died = True
    # The answer is a few small fields (a repr is cut at 4000 characters): a bigger frame is not
    # one the REPL server wrote, and is not kept.
    reply_limit = limit + REPLY_OVERHEAD
    poller = select.poll()
    for fd in (repl["from"], repl["out"], repl["err"]):
        poller.register(fd, select.POLLIN)
    poller.register(IN.fileno(), 0)  # POLLHUP only: the host died during the call
    while reply is None and not died and not (timed_out and not interrupted):
        wait_ms = None
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                if interrupted:
                    break  # no answer even to SIGINT: the REPL is killed below
                timed_out = interrupted = True
                try:
                    signal.pidfd_send_signal(repl["pidfd"], signal.SIGINT)
                except ProcessLookupError:
                    died = True
                deadline = time.monotonic() + REPL_GRACE_S
                continue
            wait_ms = int(left * 1000) + 1
        for fd, _event in poller.poll(wait_ms):
            if fd == IN.fileno():
                owner_gone()  # noqa: F821 - supervisor.py
            chunk = os.read(fd, 1 << 20)
            if fd == repl["from"]:
                if not chunk:
                    died = True
                    break
                reply_buffer += chunk
                if len(reply_buffer) >= 4:
                    size = struct.unpack("<I", reply_buffer[:4])[0]
                    if size > reply_limit:
                        oversized = died = True
                        break
                    if len(reply_buffer) >= 4 + size:
                        reply = marshal.loads(bytes(reply_buffer[4 : 4 + size]))
                continue
            if not chunk:
                poller.unregister(fd)
                continue
            room = limit - len(outputs[fd])
            outputs[fd] += chunk[: max(room, 0)]
            truncated |= room < len(chunk)
    # The REPL flushed before answering: what it wrote itself is in the pipes now.
    for fd in (repl["out"], repl["err"]):
        os.set_blocking(fd, False)
        try:
            while chunk := os.read(fd, 1 << 20):
                room = limit - len(outputs[fd])
                outputs[fd] += chunk[: max(room, 0)]
                truncated |= room < len(chunk)
        except BlockingIOError:
            pass
        os.set_blocking(fd, True)
    killed = reply is None
    if killed:
        REPLS.pop(name, None)
        repl_kill(repl)
    if oversized:
        outputs[repl["err"]] += b"k3 sandbox: the REPL sent a reply larger than max_output; it was killed\n"
    return {"ok": True, "reply": reply, "stdout": bytes(outputs[repl["out"]]), "stderr": bytes(outputs[repl["err"]]),
            "timed_out": timed_out, "died": died, "killed": killed, "truncated": truncated,
            "duration": time.monotonic() - started}


def repl_stop(request):
    repl = REPLS.pop(request["name"], None)
    if repl is not None:
        repl_kill(repl)
    return {"ok": True, "stopped": repl is not None}


def repl_list(request):
    return {"ok": True, "names": sorted(REPLS)}


WEB = {"pid": None}


def web_on(request):
    """Start the relay: a Unix socket at ``path`` whose requests go to the host's web tools."""
    if UPCALL_FD < 0:
        return {"ok": False, "error": "this supervisor was started without an upcall channel"}
    if WEB["pid"] is not None:
        try:
            os.kill(WEB["pid"], 0)
            return {"ok": True, "path": request["path"]}
        except ProcessLookupError:
            WEB["pid"] = None  # it died (and was reaped): start another
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
            os.closerange(0, 3)
            for fd in range(3, 1024):
                if fd not in (listener.fileno(), UPCALL_FD):
                    try:
                        os.close(fd)
                    except OSError:
                        pass
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            drop_privileges()
            web_relay(listener)
        except BaseException:  # noqa: BLE001 - the relay dies; clients see a closed socket
            code = 1
        os._exit(code)
    listener.close()
    WEB["pid"] = pid
    return {"ok": True, "path": path}


def _read_frame(read):
    """One frame through ``read(n)`` (os.read of a blocking fd, or a socket's recv)."""
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


def web_relay(listener):
    # One request per connection, served in turn: the web tools are quick, and a slow client
    # cannot hold the relay past the timeout below.
    while True:
        connection, _ = listener.accept()
        try:
            connection.settimeout(10.0)
            body = _read_frame(connection.recv)
            if body is None:
                continue
            _write_all(UPCALL_FD, struct.pack("<I", len(body)) + body)
            answer = _read_frame(lambda n: os.read(UPCALL_FD, n))
            if answer is None:
                return  # the host went away
            connection.sendall(struct.pack("<I", len(answer)) + answer)
        except OSError:
            pass
        finally:
            connection.close()


EXTRA_OPS = {"repl_start": repl_start, "repl_call": repl_call, "repl_stop": repl_stop, "repl_list": repl_list,
             "web_on": web_on}


def remove(request):
    """Remove files, then directories if empty (k3's own bookkeeping files, never the user's)."""
    for path in request.get("files", ()):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    for path in request.get("dirs", ()):
        try:
            os.rmdir(path)
        except OSError:
            pass
    return {"ok": True}


EXTRA_OPS["remove"] = remove
