"""The trusted harness of function-call tests: assert-style tests (HumanEval, MBPP) run
against a candidate's Python functions, judged by code the candidate never runs.

The code verifier runs it in the sandbox as `python3 -I -B function_harness.py <test>`,
the sandbox's PID 1 (no other process there ever holds its stdin), with stdin =
"<token>\\n<spec JSON>" (docs/verifiers.md, "Function-call tests"). It is two processes.
This one, the parent, reads stdin and closes it before the candidate exists, keeps the token
and the test code to itself, makes itself non-dumpable (so a process of the same uid can
neither ptrace it nor read its memory or file descriptors; the sandbox's seccomp filter
denies ptrace, pidfd_getfd and process_vm_readv besides), starts the candidate's program in a
child process, and runs the test code with each entry point bound to a proxy that calls into
the child over two pipes.
Only values cross back, through a tagged JSON codec of plain builtins; assertions are
evaluated here. It ends by writing one line on stdout, "<token> <outcome JSON>"; a run
without that line is the candidate's failure. Standalone on purpose: it runs under the
sandbox's /usr/bin/python3, which cannot see the rlax_tpu package.
"""

from __future__ import annotations

import base64
import builtins
import json
import linecache
import os
import re
import reprlib
import secrets
import select
import signal
import struct
import subprocess
import sys
import traceback
from typing import Any, NoReturn

# --- the codec ----------------------------------------------------------------------------
#
# A value is None, true, false, a JSON string (a str), or a list [tag, payload...]:
#   ["int", "-0x1f"]  ["float", float.hex]  ["complex", real hex, imag hex]
#   ["bytes", base64]  ["list" | "tuple" | "set" | "frozenset", [items]]
#   ["dict", [[key, value], ...]]
# Ints travel in hex (no 4300-digit str limit), floats as float.hex (exact, inf and nan
# included). Decoding builds only these builtin types, so nothing a value does when compared
# comes from the candidate. No pickle, no eval.

MAX_DEPTH = 100
MAX_MESSAGE_BYTES = 16 * 2**20

_INT_HEX = re.compile(r"-?0x[0-9a-f]+")
_SEQUENCE_TAGS: dict[str, type] = {
    "list": list,
    "tuple": tuple,
    "set": set,
    "frozenset": frozenset,
}


class CodecError(ValueError):
    """A value the codec cannot carry, or bytes that are not an encoded value."""


def _kind(value: object) -> str:
    cls = type(value)
    name = cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__name__}"
    name = name[:80]
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def encode(value: object, what: str = "the value") -> object:
    """`value` as JSON-able data. `what` names it in errors: "the return value of f"."""
    return _encode(value, what, 0)


def _encode(value: Any, what: str, depth: int) -> object:
    if depth > MAX_DEPTH:
        raise CodecError(f"{what} is nested deeper than {MAX_DEPTH} levels (or contains itself)")
    if value is None or value is True or value is False:
        return value
    # Subclasses (namedtuple, Counter, IntEnum) travel as their builtin base, read through the
    # base's own methods; type() rather than isinstance() so a spoofed __class__ is ignored.
    cls = type(value)
    if issubclass(cls, str):
        return str.__str__(value)
    if issubclass(cls, int):
        return ["int", hex(int.__index__(value))]
    if issubclass(cls, float):
        return ["float", float.hex(value)]
    if issubclass(cls, complex):
        z = complex.__complex__(value)
        return ["complex", z.real.hex(), z.imag.hex()]
    if issubclass(cls, bytes):
        return ["bytes", base64.b64encode(bytes.__bytes__(value)).decode("ascii")]
    for tag, base in _SEQUENCE_TAGS.items():
        if issubclass(cls, base):
            return [tag, [_encode(item, what, depth + 1) for item in base.__iter__(value)]]
    if issubclass(cls, dict):
        pairs = dict.items(value)
        return [
            "dict",
            [[_encode(k, what, depth + 1), _encode(v, what, depth + 1)] for k, v in pairs],
        ]
    verb = "is" if depth == 0 else "contains"
    raise CodecError(f"{what} {verb} {_kind(value)}, not a value the tests can compare")


def decode(data: object) -> Any:
    """The value `data` (parsed JSON) encodes; `CodecError` unless it is exactly an encoding."""
    return _decode(data, 0)


def _decode(data: object, depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise CodecError(f"a value nested deeper than {MAX_DEPTH} levels")
    if data is None or data is True or data is False or type(data) is str:
        return data
    if type(data) is not list or not data or type(data[0]) is not str:
        raise CodecError(f"not an encoded value: {_preview(data)}")
    tag, payload = data[0], data[1:]
    if tag == "int":
        if len(payload) != 1 or type(payload[0]) is not str or not _INT_HEX.fullmatch(payload[0]):
            raise CodecError(f"bad int: {_preview(data)}")
        return int(payload[0], 16)
    if tag in ("float", "complex"):
        if len(payload) != (1 if tag == "float" else 2) or any(type(p) is not str for p in payload):
            raise CodecError(f"bad {tag}: {_preview(data)}")
        try:
            parts = [float.fromhex(p) for p in payload]
        except (ValueError, OverflowError):
            raise CodecError(f"bad {tag}: {_preview(data)}") from None
        return parts[0] if tag == "float" else complex(parts[0], parts[1])
    if tag == "bytes":
        if len(payload) != 1 or type(payload[0]) is not str:
            raise CodecError(f"bad bytes: {_preview(data)}")
        try:
            return base64.b64decode(payload[0], validate=True)
        except ValueError:
            raise CodecError(f"bad bytes: {_preview(data)}") from None
    if tag in _SEQUENCE_TAGS or tag == "dict":
        if len(payload) != 1 or type(payload[0]) is not list:
            raise CodecError(f"bad {tag}: {_preview(data)}")
        items = payload[0]
        try:
            if tag == "dict":
                pairs = []
                for pair in items:
                    if type(pair) is not list or len(pair) != 2:
                        raise CodecError(f"bad dict item: {_preview(pair)}")
                    pairs.append((_decode(pair[0], depth + 1), _decode(pair[1], depth + 1)))
                return dict(pairs)
            return _SEQUENCE_TAGS[tag](_decode(item, depth + 1) for item in items)
        except TypeError as e:  # an unhashable set item or dict key
            raise CodecError(f"bad {tag}: {e}") from None
    raise CodecError(f"unknown tag {tag!r}")


def _preview(data: object) -> str:
    text = repr(data)
    return text if len(text) <= 60 else text[:60] + "…"


def _frame(message: dict) -> bytes:
    payload = json.dumps(message, ensure_ascii=True, separators=(",", ":")).encode("ascii")
    if len(payload) > MAX_MESSAGE_BYTES:
        raise CodecError(f"over {MAX_MESSAGE_BYTES // 2**20} MiB encoded")
    return struct.pack(">I", len(payload)) + payload


def _short(text: str, limit: int = 300) -> str:
    text = " ".join(text.split()) if "\n" in text else text
    return text if len(text) <= limit else text[:limit] + "…"


# --- the child: the candidate's process ---------------------------------------------------
#
# Nothing below is trusted: the candidate's code runs in this process and may replace any of
# it. It is the ordinary path an honest program takes; the parent believes none of it.

CANDIDATE_FILE = "main.py"


def _error(e: BaseException) -> dict:
    where = ""
    for frame in traceback.extract_tb(e.__traceback__):
        if frame.filename == CANDIDATE_FILE:
            where = f"{CANDIDATE_FILE} line {frame.lineno}"
    return {"type": type(e).__name__, "message": str(e)[:2000], "where": where}


def child_main(request_fd: int, response_fd: int) -> NoReturn:
    """Load main.py (after the problem's setup, as HumanEval joins prompt and completion)
    and answer call requests until the parent closes the pipe."""
    requests = os.fdopen(request_fd, "rb", buffering=0)
    responses = os.fdopen(response_fd, "wb", buffering=0)

    def read_exact(n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = requests.read(n - len(data))
            if not chunk:
                os._exit(0)  # the parent is done
            data += chunk
        return data

    def receive() -> dict:
        (size,) = struct.unpack(">I", read_exact(4))
        return json.loads(read_exact(size))

    def send(message: dict) -> None:
        try:
            frame = _frame(message)
        except CodecError as e:
            frame = _frame({"ok": False, "invalid": f"the message is {e}"})
        responses.write(frame)

    sys.argv = [CANDIDATE_FILE]
    load = receive()
    namespace: dict = {"__name__": "solution", "__file__": CANDIDATE_FILE, "__builtins__": builtins}
    module = type(sys)("solution")
    module.__dict__.update(namespace)
    namespace = module.__dict__
    sys.modules["solution"] = module
    functions = {}
    try:
        if load.get("setup"):
            exec(compile(load["setup"], "setup.py", "exec"), namespace)
        before = {name: namespace.get(name) for name in load["entry_points"]}
        with open(CANDIDATE_FILE, "rb") as f:
            source = f.read()
        exec(compile(source, CANDIDATE_FILE, "exec"), namespace)
        for name in load["entry_points"]:
            function = namespace.get(name)
            if function is None or function is before[name]:
                raise NameError(f"{CANDIDATE_FILE} does not define {name} (the tests call it)")
            if not callable(function):
                raise TypeError(f"{name} in {CANDIDATE_FILE} is {_kind(function)}, not a function")
            functions[name] = function
    except BaseException as e:  # noqa: BLE001 - SystemExit at import is a failure too
        send({"ok": False, "error": _error(e)})
        os._exit(0)
    send({"ok": True})
    while True:
        request = receive()
        name = request["function"]
        try:
            args = decode(request["args"])
            kwargs = decode(request["kwargs"])
            result = functions[name](*args, **kwargs)
        except BaseException as e:  # noqa: BLE001 - report everything, even SystemExit
            send({"ok": False, "error": _error(e)})
            continue
        try:
            value = encode(result, f"the return value of {name}")
        except (CodecError, RecursionError) as e:
            send({"ok": False, "invalid": str(e)})
            continue
        send({"ok": True, "value": value})


# --- the parent: trusted --------------------------------------------------------------------

PR_GET_DUMPABLE = 3
PR_SET_DUMPABLE = 4
STDERR_TAIL_BYTES = 4096
_STOP_WAIT_S = 1.0


class CandidateError(Exception):
    """An exception the candidate's function raised, re-raised in the test. Its class also
    derives from the builtin exception of the same name when there is one, so a test's
    `except ValueError` sees a ValueError."""

    type_name = "Exception"
    where = ""


class CandidateFault(BaseException):
    """The candidate broke the call protocol: its process ended, or it sent something other
    than a value. A BaseException, so a test's `except Exception` cannot swallow it; once
    raised, every later call raises it again."""

    def __init__(self, reason: str, verdict: str = "runtime_error") -> None:
        super().__init__(reason)
        self.reason = reason
        self.verdict = verdict


class ProblemFault(BaseException):
    """The test code itself cannot be run (it passed a value the codec cannot carry)."""


_exception_classes: dict[str, type[CandidateError]] = {}
# Exceptions that end iteration or a generator: `all(map(f, xs))` stops quietly when f raises
# StopIteration, so a candidate raising one would pass every assert left in the loop. These
# stay plain CandidateErrors.
_NOT_MIRRORED = frozenset({"StopIteration", "StopAsyncIteration", "GeneratorExit"})


def _candidate_error(error: object) -> CandidateError:
    if not isinstance(error, dict):
        error = {}
    type_name = _short(str(error.get("type", "Exception")), 80)
    message = _short(str(error.get("message", "")), 500)
    cls = _exception_classes.get(type_name)
    if cls is None:
        cls = CandidateError
        base = getattr(builtins, type_name, None)
        if (
            type_name not in _NOT_MIRRORED
            and type_name.isidentifier()
            and isinstance(base, type)
            and issubclass(base, Exception)
            and not issubclass(base, CandidateError)
        ):
            try:
                cls = type(type_name, (CandidateError, base), {})
                cls(message)  # some (UnicodeError...) take other arguments
            except TypeError:
                cls = CandidateError
        _exception_classes[type_name] = cls
    exc = cls(message)
    exc.type_name = type_name
    exc.where = _short(str(error.get("where", "")), 80)
    return exc


def _describe_status(returncode: int | None) -> str:
    if returncode is None:
        return "did not exit"
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited (code {returncode})"


class Candidate:
    """The child process and the call protocol, seen from the parent."""

    def __init__(self, harness_path: str) -> None:
        request_r, self._request_w = os.pipe()
        self._response_r, response_w = os.pipe()
        # stdin and stdout are /dev/null, stderr a pipe of ours: nothing the child writes can
        # reach the run's stdout, and it gets no descriptor but these.
        self.proc = subprocess.Popen(
            [sys.executable, "-I", "-B", harness_path, "--child", str(request_r), str(response_w)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            pass_fds=(request_r, response_w),
            close_fds=True,
        )
        os.close(request_r)
        os.close(response_w)
        assert self.proc.stderr is not None
        self._stderr_fd = self.proc.stderr.fileno()
        os.set_blocking(self._request_w, False)
        self.stderr_tail = bytearray()
        self._buffer = bytearray()
        self.fault: CandidateFault | None = None
        self.calls = 0
        self.last_call = ""

    # Both directions go through one select loop that also drains the child's stderr, so a
    # child writing much to stderr can never deadlock against a large request.
    def _exchange(self, out: bytes) -> dict:
        """Send `out` (a framed request) and return the next message from the child."""
        readers = [self._response_r] + ([self._stderr_fd] if self._stderr_fd >= 0 else [])
        while True:
            if not out and len(self._buffer) >= 4:
                (size,) = struct.unpack(">I", self._buffer[:4])
                if size > MAX_MESSAGE_BYTES:
                    raise self._fail(f"sent a message over {MAX_MESSAGE_BYTES // 2**20} MiB")
                if len(self._buffer) >= 4 + size:
                    payload = bytes(self._buffer[4 : 4 + size])
                    del self._buffer[: 4 + size]
                    try:
                        message = json.loads(payload)
                    except (ValueError, RecursionError):
                        raise self._fail("sent bytes that are not a message") from None
                    if not isinstance(message, dict):
                        raise self._fail("sent bytes that are not a message")
                    return message
            writers = [self._request_w] if out else []
            readable, writable, _ = select.select(readers, writers, [])
            if writable:
                try:
                    out = out[os.write(self._request_w, out) :]
                except BlockingIOError:
                    pass
                except OSError:
                    raise self._fail("stopped reading the harness's requests") from None
            for fd in readable:
                data = os.read(fd, 65536)
                if fd == self._stderr_fd:
                    if not data:
                        readers.remove(fd)
                        self._stderr_fd = -1
                    self.stderr_tail += data
                    del self.stderr_tail[:-STDERR_TAIL_BYTES]
                elif not data:
                    raise self._fail("", closed=True)
                else:
                    self._buffer += data
                    if len(self._buffer) > MAX_MESSAGE_BYTES + 4:
                        raise self._fail(f"sent a message over {MAX_MESSAGE_BYTES // 2**20} MiB")

    def _fail(self, what: str, *, closed: bool = False) -> CandidateFault:
        """Stop the child and record why the protocol ended; the fault is sticky."""
        exited = self._stop()
        status = self.proc.returncode
        during = f"during {self.last_call}" if self.last_call else f"while loading {CANDIDATE_FILE}"
        if closed and exited and status == 0:
            reason = f"the program exited (code 0) {during} instead of returning"
        elif closed and exited:
            reason = f"the program {_describe_status(status)} {during}"
        elif closed:
            reason = f"the program closed the harness's pipe {during}"
        else:
            reason = f"the program {what} {during}"
        last = self.stderr_line()
        if last:
            reason += f"; its stderr: {last}"
        if b"MemoryError" in self.stderr_tail:
            verdict = "memory_limit"
        elif exited and status == -signal.SIGXCPU:
            verdict = "time_limit"
        else:
            verdict = "runtime_error"
        self.fault = CandidateFault(_short(reason, 600), verdict)
        return self.fault

    def stderr_line(self) -> str:
        lines = [ln for ln in bytes(self.stderr_tail).decode(errors="replace").splitlines()]
        lines = [ln.strip() for ln in lines if ln.strip()]
        return _short(lines[-1], 200) if lines else ""

    def request(self, message: dict) -> dict:
        if self.fault is not None:
            raise self.fault
        try:
            frame = _frame(message)
        except CodecError as e:
            raise ProblemFault(f"the arguments of {self.last_call} are {e}") from None
        return self._exchange(frame)

    def load(self, setup: str | None, entry_points: list[str]) -> None:
        response = self.request({"op": "load", "setup": setup, "entry_points": entry_points})
        if response.get("ok") is True:
            return
        error = _candidate_error(response.get("error"))
        where = f" ({error.where})" if error.where else ""
        verdict = "memory_limit" if error.type_name == "MemoryError" else "runtime_error"
        reason = f"{CANDIDATE_FILE} failed to load: {error.type_name}: {error}{where}"
        self.fault = CandidateFault(_short(reason, 600), verdict)
        raise self.fault

    def call(self, name: str, args: tuple, kwargs: dict) -> Any:
        self.calls += 1
        self.last_call = f"{name}({_short(_arguments(args, kwargs), 120)})"
        try:
            message = {
                "op": "call",
                "function": name,
                "args": encode(list(args), f"an argument of {name}"),
                "kwargs": encode(kwargs, f"an argument of {name}"),
            }
        except (CodecError, RecursionError) as e:
            raise ProblemFault(f"the test cannot call {name}: {e}") from None
        response = self.request(message)
        if response.get("ok") is True:
            try:
                value = decode(response.get("value"))
            except (CodecError, RecursionError, MemoryError) as e:
                raise self._fail(f"sent a return value the harness cannot read ({e})") from None
            self.last_call += f" returned {_short(_show(value), 120)}"
            return value
        if "invalid" in response:
            self.fault = CandidateFault(_short(str(response["invalid"]), 300))
            raise self.fault
        raise _candidate_error(response.get("error"))

    def _stop(self) -> bool:
        """Wait a moment for the child to end by itself (then kill it); whether it did."""
        try:
            self.proc.wait(timeout=_STOP_WAIT_S)
            return True
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return False

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        # What the child wrote to stderr, for whoever reads the run's stderr.
        if self._stderr_fd >= 0:
            try:
                os.set_blocking(self._stderr_fd, False)
                self.stderr_tail += os.read(self._stderr_fd, STDERR_TAIL_BYTES)
            except OSError:
                pass
            del self.stderr_tail[:-STDERR_TAIL_BYTES]


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 60
_REPR.maxlist = _REPR.maxtuple = _REPR.maxset = _REPR.maxfrozenset = _REPR.maxdict = 8
_REPR.maxlong = 40


def _show(value: object) -> str:
    """A bounded repr for reasons: never the whole of a large argument or result."""
    try:
        return _REPR.repr(value)
    except ValueError:  # an int over the 4300-digit str limit
        return f"<int of {value.bit_length()} bits>" if isinstance(value, int) else "<?>"


def _arguments(args: tuple, kwargs: dict) -> str:
    parts = [_show(a) for a in args] + [f"{k}={_show(v)}" for k, v in kwargs.items()]
    return ", ".join(parts)


def _proxy(candidate: Candidate, name: str):  # noqa: ANN202 - a function standing in for name
    def call(*args: Any, **kwargs: Any) -> Any:
        return candidate.call(name, args, kwargs)

    call.__name__ = call.__qualname__ = name
    return call


def _failed_line(e: BaseException, filename: str) -> str:
    """`<file> line N: <source line>` of the deepest frame of the test code in e's traceback."""
    found = ""
    for frame in traceback.extract_tb(e.__traceback__):
        if frame.filename == filename:
            text = linecache.getline(filename, frame.lineno or 0).strip() or (frame.line or "")
            found = f"{filename} line {frame.lineno}" + (f": {_short(text, 160)}" if text else "")
    return found


def _outcome(verdict: str, reason: str) -> dict:
    return {"passed": verdict == "accepted", "verdict": verdict, "reason": _short(reason, 1000)}


def _register_source(filename: str, source: str) -> None:
    # Lets tracebacks and _failed_line show the test's source lines.
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)


def run_test(spec: dict, harness_path: str) -> dict:
    """Run one test of `spec` (test, entry_points, setup, code) against main.py; the outcome."""
    name = spec["test"]
    entry_points = list(spec["entry_points"])
    setup = spec.get("setup")
    test_file = f"tests/{name}.py"
    namespace: dict = {"__name__": "__main__", "__builtins__": builtins}
    # The problem's own code first, before the candidate runs: a failure here is the
    # problem's, never the candidate's.
    try:
        if setup:
            _register_source("setup.py", setup)
            exec(compile(setup, "setup.py", "exec"), namespace)
        _register_source(test_file, spec["code"])
        test_code = compile(spec["code"], test_file, "exec")
    except BaseException as e:  # noqa: BLE001
        return _outcome("problem_error", f"the problem's setup or test does not run: {e!r}")
    try:
        candidate = Candidate(harness_path)
    except OSError as e:  # before any of the candidate's code ran
        return _outcome("harness_error", f"cannot start the candidate's process: {e}")
    try:
        candidate.load(setup, entry_points)
        for entry in entry_points:
            namespace[entry] = _proxy(candidate, entry)
        exec(test_code, namespace)
    except CandidateFault as e:
        return _outcome(e.verdict, e.reason)
    except ProblemFault as e:
        return _outcome("problem_error", str(e))
    except CandidateError as e:
        where = f" ({e.where})" if e.where else ""
        verdict = "memory_limit" if e.type_name == "MemoryError" else "runtime_error"
        return _outcome(verdict, f"{candidate.last_call} raised {e.type_name}: {e}{where}")
    except AssertionError as e:
        message = f": {_short(str(e), 200)}" if str(e) else ""
        at = _failed_line(e, test_file)
        return _outcome(
            "wrong_answer",
            f"assertion failed ({at}){message}; last call {candidate.last_call or 'none'}",
        )
    except MemoryError:
        return _outcome("memory_limit", f"out of memory after {candidate.last_call}")
    except BaseException as e:  # noqa: BLE001 - the test failed in another way
        at = _failed_line(e, test_file)
        return _outcome(
            "wrong_answer",
            f"the test failed with {type(e).__name__}: {_short(str(e), 200)} ({at}); "
            f"last call {candidate.last_call or 'none'}",
        )
    finally:
        candidate.kill()
        if candidate.stderr_tail:
            sys.stderr.buffer.write(bytes(candidate.stderr_tail))
            sys.stderr.flush()
    if candidate.fault is not None:  # raised, then swallowed by a bare except in the test
        return _outcome(candidate.fault.verdict, candidate.fault.reason)
    if candidate.calls == 0:
        return _outcome("problem_error", f"{test_file} never calls {', '.join(entry_points)}")
    return _outcome("accepted", f"{candidate.calls} calls, all assertions held")


def _libc() -> Any:
    import ctypes

    return ctypes.CDLL(None, use_errno=True)


def _errno() -> int:
    import ctypes

    return ctypes.get_errno()


def _make_undumpable() -> str:
    """Set PR_SET_DUMPABLE 0; '' on success, else why it failed."""
    try:
        libc = _libc()
        if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
            return f"prctl(PR_SET_DUMPABLE) failed with errno {_errno()}"
        if libc.prctl(PR_GET_DUMPABLE, 0, 0, 0, 0) != 0:
            return "prctl(PR_GET_DUMPABLE) still says dumpable"
    except (OSError, AttributeError) as e:
        return f"cannot call prctl: {e}"
    return ""


def _kill_everyone_else() -> None:
    """SIGKILL every process of the sandbox but us, its PID 1 (kill(-1) spares the caller):
    no process of the candidate is left to write to the sandbox's stdout or stderr."""
    for _ in range(2):
        try:
            os.kill(-1, signal.SIGKILL)
        except OSError:
            pass


def _check_spec(spec: object, test_name: str) -> dict:
    if not isinstance(spec, dict):
        raise ValueError("not a JSON object")
    if spec.get("test") != test_name:
        raise ValueError(f"the spec is for test {spec.get('test')!r}, not {test_name!r}")
    entry_points = spec.get("entry_points")
    if not isinstance(entry_points, list) or not entry_points:
        raise ValueError("entry_points must be a non-empty list")
    if not all(isinstance(e, str) and e.isidentifier() for e in entry_points):
        raise ValueError(f"entry_points must be identifiers, got {entry_points!r}")
    if not isinstance(spec.get("code"), str):
        raise ValueError("code must be a string")
    if spec.get("setup") is not None and not isinstance(spec["setup"], str):
        raise ValueError("setup must be null or a string")
    return spec


def parent_main(test_name: str) -> NoReturn:
    # As the sandbox's PID 1 we receive no signal from inside it that we have no handler
    # for; Python's SIGINT handler would raise KeyboardInterrupt inside the test code, where
    # a bare `except:` could swallow it. (Not sandboxed, SIGINT kills us: we report nothing.)
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    # Before anything else, while no other process of the run exists: from here on no
    # process of our uid can read our memory or open our descriptors.
    unprotected = _make_undumpable()
    data = sys.stdin.buffer.read()
    token_line, _, spec_text = data.partition(b"\n")
    token = token_line.decode("ascii", errors="replace").strip()
    if not re.fullmatch(r"[0-9a-f]{16,128}", token):
        token = "-"
    # The key exists only in this process and in the stdout pipe, which nothing in the
    # sandbox can read; announced before any candidate code runs, it is what makes the
    # report line unforgeable even by a process that could read the token from stdin.
    key = secrets.token_hex(16)
    _write_all(1, f"{token} {key}\n".encode("ascii"))
    # stdin is closed; stdout stays on a private descriptor for the report, and fd 1 and
    # sys.stdout go to /dev/null so that nothing the problem's code prints reaches it.
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    report = os.dup(1)
    os.dup2(devnull, 1)
    os.close(devnull)
    sys.stdin = open(os.devnull)  # noqa: SIM115
    sys.stdout = open(os.devnull, "w")  # noqa: SIM115
    spec: dict = {}
    if unprotected:
        outcome = _outcome("harness_error", f"the harness cannot protect itself: {unprotected}")
    elif token == "-":
        outcome = _outcome("harness_error", "stdin does not start with a token line")
    else:
        try:
            spec = _check_spec(json.loads(spec_text), test_name)
        except ValueError as e:
            outcome = _outcome("harness_error", f"bad spec on stdin: {e}")
    # In the sandbox the harness is PID 1; a PID 1 of the host (init) is never us.
    isolated = spec.get("sandboxed") is True and os.getpid() == 1
    if spec.get("sandboxed") is True and not isolated:
        outcome = _outcome(
            "harness_error",
            f"the harness runs as PID {os.getpid()}, not as the sandbox's PID 1 (bwrap "
            "--as-pid-1): another process of the sandbox could hold its stdin",
        )
    elif spec:
        outcome = run_test(spec, os.path.abspath(__file__))
    if isolated:
        _kill_everyone_else()
    outcome["test"] = test_name
    _write_all(report, f"{token} {key} {json.dumps(outcome, ensure_ascii=True)}\n".encode("ascii"))
    os._exit(0)


def _write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data) :]


def main(argv: list[str]) -> NoReturn:
    if len(argv) == 4 and argv[1] == "--child":
        child_main(int(argv[2]), int(argv[3]))
    if len(argv) != 2:
        sys.stderr.write("usage: function_harness.py <test name> (stdin: token, spec)\n")
        os._exit(2)
    parent_main(argv[1])


if __name__ == "__main__":
    main(sys.argv)
