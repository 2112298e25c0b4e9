"""The persistent Python REPL that runs inside a sandbox (the image's python3, no capabilities).

Sent by the host as a ``-c`` string (see ``repl.py``), so it uses the standard library only and
must run on any Python 3.8+. It reads requests from fd 3 and answers on fd 4 (4-byte length +
marshal of a dict); fds 1 and 2 are pipes its supervisor reads, so ``print`` and the output of
subprocesses are captured per call.

Requests:
  {"op": "hello"}                     -> {"ok", "python"}
  {"op": "run", "code": str}          -> {"ok", "error", "value"}: exec the cell in the namespace;
                                         the value of a last bare expression is returned as repr.
  {"op": "dump", "path": str}         -> {"ok", "names", "skipped", "bytes"}: pickle the namespace.
  {"op": "load", "path": str}         -> {"ok", "names"}: restore a namespace dumped by "dump".

Checkpointing (dump/load) is k3's own memory snapshot for the REPL: variables are pickled, and
what the REPL itself defined (functions, classes, lambdas) is pickled by value (code objects via
marshal), modules by name. Values that cannot be pickled (open files, sockets, threads,
generators) are reported in "skipped" and are missing after a restore.
"""

import ast
import builtins
import importlib
import marshal
import os
import pickle
import struct
import sys
import traceback
import types

IN_FD, OUT_FD = 3, 4
MAX_REPR = 4000

user = types.ModuleType("__main__")
user.__dict__["__builtins__"] = builtins
sys.modules["__main__"] = user
namespace = user.__dict__
sys.argv = [""]

support = types.ModuleType("k3_repl_support")  # helpers that pickles made here refer to by name
sys.modules["k3_repl_support"] = support


class _EmptyCell:
    """Stands for a closure cell not yet assigned; pickled by name as k3_repl_support.EMPTY."""

    def __reduce__(self):
        return "EMPTY"


_EmptyCell.__module__ = "k3_repl_support"
_EMPTY = support.EMPTY = _EmptyCell()


def _read_exact(n):
    chunks = []
    while n:
        chunk = os.read(IN_FD, n)
        if not chunk:
            return None
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def _send(message):
    body = marshal.dumps(message)
    view = memoryview(struct.pack("<I", len(body)) + body)
    while view:
        view = view[os.write(OUT_FD, view) :]


def _make_cell(value):
    if value is _EMPTY:
        return types.CellType() if hasattr(types, "CellType") else (lambda: None).__closure__
    return (lambda: value).__closure__[0]


def rebuild_function(code, name, qualname, defaults, kwdefaults, closure, attrs):
    cells = None if closure is None else tuple(_make_cell(value) for value in closure)
    function = types.FunctionType(marshal.loads(code), namespace, name, defaults, cells)
    function.__qualname__ = qualname
    function.__kwdefaults__ = kwdefaults
    if attrs:
        function.__dict__.update(attrs)
    return function


def rebuild_class(metaclass, name, qualname, bases, attrs):
    cls = metaclass(name, bases, attrs)
    cls.__qualname__ = qualname
    return cls


for _helper in (rebuild_function, rebuild_class):
    _helper.__module__ = "k3_repl_support"
    setattr(support, _helper.__name__, _helper)


class Pickler(pickle.Pickler):
    """Pickles what the REPL defined by value, so a fresh REPL can rebuild it."""

    def reducer_override(self, obj):
        if isinstance(obj, types.FunctionType) and obj.__globals__ is namespace:
            closure = None
            if obj.__closure__ is not None:
                closure = []
                for cell in obj.__closure__:
                    try:
                        closure.append(cell.cell_contents)
                    except ValueError:
                        closure.append(_EMPTY)
                closure = tuple(closure)
            return rebuild_function, (marshal.dumps(obj.__code__), obj.__name__, obj.__qualname__, obj.__defaults__,
                                      obj.__kwdefaults__, closure, dict(obj.__dict__) or None)
        if isinstance(obj, type) and obj.__module__ == "__main__":
            attrs = {key: value for key, value in obj.__dict__.items() if key not in ("__dict__", "__weakref__")}
            return rebuild_class, (type(obj), obj.__name__, obj.__qualname__, obj.__bases__, attrs)
        if isinstance(obj, types.ModuleType) and obj is not user:
            return importlib.import_module, (obj.__name__,)
        return NotImplemented


class _Sink:
    def write(self, data):
        return len(data)


def _picklable(value):
    try:
        Pickler(_Sink(), protocol=pickle.HIGHEST_PROTOCOL).dump(value)
        return True
    except Exception:  # noqa: BLE001 - any failure means "cannot be saved"
        return False


def dump(path):
    names = sorted(key for key in namespace if key != "__builtins__")
    state = {key: namespace[key] for key in names}
    skipped = []
    tmp = path + ".tmp"
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    for attempt in range(2):
        try:
            with open(tmp, "wb") as f:
                Pickler(f, protocol=pickle.HIGHEST_PROTOCOL).dump(state)
            break
        except Exception:  # noqa: BLE001 - find the values that cannot be pickled, drop them
            if attempt:
                raise
            skipped = [key for key in names if not _picklable(state[key])]
            for key in skipped:
                del state[key]
    os.replace(tmp, path)
    return {"ok": True, "names": sorted(state), "skipped": skipped, "bytes": os.path.getsize(path)}


def load(path):
    with open(path, "rb") as f:
        state = pickle.Unpickler(f).load()
    namespace.update(state)
    return {"ok": True, "names": sorted(state)}


def run(code):
    try:
        tree = ast.parse(code, "<cell>", "exec")
        last = None
        if tree.body and isinstance(tree.body[-1], ast.Expr):
            last = ast.Expression(tree.body.pop().value)
        exec(compile(tree, "<cell>", "exec"), namespace)
        value = None
        if last is not None:
            result = eval(compile(last, "<cell>", "eval"), namespace)
            if result is not None:
                namespace["_"] = result
                value = repr(result)
                if len(value) > MAX_REPR:
                    value = value[:MAX_REPR] + f"... ({len(value)} characters)"
        return {"ok": True, "error": None, "value": value}
    except BaseException as error:  # noqa: BLE001 - KeyboardInterrupt (a timeout) included
        if isinstance(error, SystemExit):
            pass  # a cell that calls exit() ends the cell, not the REPL
        lines = traceback.format_exception(type(error), error, error.__traceback__)
        # Drop this file's own frames: the user wants the cell's traceback only.
        text = "".join(line for line in lines if 'File "<string>"' not in line)
        sys.stderr.write(text)
        return {"ok": False, "error": f"{type(error).__name__}: {error}", "value": None}


def main():
    while True:
        header = _read_exact(4)
        if header is None:
            return
        body = _read_exact(struct.unpack("<I", header)[0])
        if body is None:
            return
        request = marshal.loads(body)
        op = request.get("op")
        try:
            if op == "hello":
                answer = {"ok": True, "python": sys.version.split()[0]}
            elif op == "run":
                answer = run(request["code"])
            elif op == "dump":
                answer = dump(request["path"])
            elif op == "load":
                answer = load(request["path"])
            else:
                answer = {"ok": False, "error": f"unknown REPL request {op!r}"}
        except BaseException as error:  # noqa: BLE001 - answer, whatever happened
            answer = {"ok": False, "error": f"{type(error).__name__}: {error}"}
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed stdout must not stop the answer
                pass
        _send(answer)


main()
