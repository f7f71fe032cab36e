"""idemd_server.py: starts and stops idemd for the Python tests (temp dir, free 127.0.0.1 port,
unix socket), waits until it is ready, and gives redis-py clients for the worker (TCP) and
admin (unix socket) roles, and raw connections whose replies can be looked for without waiting.
Not a test itself."""

import atexit
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

import redis

HERE = os.path.dirname(os.path.abspath(__file__))
SOURCE_DIR = os.environ.get("IDEM_SOURCE_DIR", os.path.normpath(os.path.join(HERE, "..", "..")))
BUILD_DIR = os.environ.get("IDEM_BUILD_DIR", os.path.join(SOURCE_DIR, "build"))
IDEMD = os.path.join(BUILD_DIR, "idemd")


_live = set()  # idemd processes running
_tmps = set()  # temp dirs to remove at exit


def _kill_live():
    for p in list(_live):
        if p.poll() is None:
            p.kill()
            p.wait()
    if os.environ.get("KEEP_TMP") != "1":
        for d in list(_tmps):
            shutil.rmtree(d, ignore_errors=True)


atexit.register(_kill_live)
# SIGTERM (ctest's or timeout's) exits through atexit, which kills every idemd started here
signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))


def _die_with_parent():
    # PR_SET_PDEATHSIG: idemd gets SIGKILL if the thread that started it dies without cleaning
    # up (so start idemd from the main thread)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
    except Exception:
        pass


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


class Idemd:
    """One idemd process on its own store directory."""

    def __init__(self, *flags, tmp=None, port=None, name="idemd", auth=None):
        """auth: (user, password) of an admin, where flags configure users."""
        self.auth = auth
        self.own_tmp = tmp is None
        self.tmp = tmp or tempfile.mkdtemp(prefix="idem-py.")
        if self.own_tmp:
            _tmps.add(self.tmp)
        self.dir = os.path.join(self.tmp, "d")
        self.sock = os.path.join(self.dir, "idemd.sock")
        self.flags = list(flags)
        self.port = port
        self.name = name
        self.log_path = os.path.join(self.tmp, name + ".log")
        self.proc = None

    def spawn(self, port):
        """Starts the process without waiting for it (see wait_ready)."""
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [IDEMD, "--dir", self.dir, "--port", str(port)] + self.flags,
            stdout=log, stderr=log, stdin=subprocess.DEVNULL, preexec_fn=_die_with_parent)
        _live.add(self.proc)
        log.close()
        return self.proc

    def start(self, timeout=30.0):
        """Starts idemd and waits until it answers (port None: a free one; 0: no TCP)."""
        for _ in range(5):
            port = self.port if self.port is not None else free_port()
            self.spawn(port)
            if self.wait_ready(timeout):
                self.port = port
                return self
            self.kill()
            with open(self.log_path, "rb") as f:
                text = f.read().decode(errors="replace")
            if self.port is not None or "in use" not in text:
                raise RuntimeError("idemd did not start:\n" + text[-2000:])
        raise RuntimeError("idemd did not start (no free port)")

    def wait_ready(self, timeout):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            try:
                c = self.admin(socket_timeout=5)
                try:
                    if c.info("persistence").get("loading") == 0:
                        c.execute_command("DBSIZE")  # a command that needs the store
                        return True
                finally:
                    c.close()
            except (redis.ConnectionError, redis.BusyLoadingError, redis.ResponseError,
                    FileNotFoundError, OSError):
                pass
            time.sleep(0.02)
        return False

    def worker(self, **kw):
        """A client on TCP: role worker (no users configured)."""
        kw.setdefault("socket_timeout", 70)
        return redis.Redis(host="127.0.0.1", port=self.port, **kw)

    def admin(self, **kw):
        """A client on the unix socket: role admin (no users configured)."""
        kw.setdefault("socket_timeout", 70)
        if self.auth:
            kw.setdefault("username", self.auth[0])
            kw.setdefault("password", self.auth[1])
        return redis.Redis(unix_socket_path=self.sock, **kw)

    def kill(self, sig=9):
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(sig)
        if self.proc:
            rc = self.proc.wait()
            _live.discard(self.proc)
            self.proc = None
            return rc
        return None

    def stop(self, keep=False):
        """SIGTERM and wait; the temporary directory is removed unless keep (or KEEP_TMP=1)."""
        rc = self.kill(15)
        if self.own_tmp and not keep and os.environ.get("KEEP_TMP") != "1":
            shutil.rmtree(self.tmp, ignore_errors=True)
        return rc


def resp(*args):
    """One request in RESP's multi-bulk form."""
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        a = a if isinstance(a, bytes) else str(a).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(a), a))
    return b"".join(out)


class RawConn:
    """A connection on the unix socket driven by hand: a request is sent at once, and whether
    its reply has come can be asked without waiting (pending). Not a redis-py client: that one
    sends and reads in one call."""

    def __init__(self, path, timeout=70):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.sock.connect(path)
        self.buf = b""

    def send(self, *args):
        self.sock.sendall(resp(*args))

    def pending(self):
        """True while no byte of a reply has come: asks, never waits. (With a timeout set,
        Python polls for readability before recv, MSG_DONTWAIT or not: the socket is made
        non-blocking for the look.)"""
        if self.buf:
            return False
        timeout = self.sock.gettimeout()
        self.sock.settimeout(0)
        try:
            return not self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return True
        finally:
            self.sock.settimeout(timeout)

    def _line(self):
        while b"\r\n" not in self.buf:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise ConnectionError("closed before the reply's end: %r" % self.buf)
            self.buf += chunk
        line, self.buf = self.buf.split(b"\r\n", 1)
        return line

    def reply(self):
        """Reads one reply: bytes, int, None, a list, or redis.ResponseError for an error."""
        line = self._line()
        kind, rest = line[:1], line[1:]
        if kind == b"+":
            return rest
        if kind == b"-":
            return redis.ResponseError(rest.decode(errors="replace"))
        if kind == b":":
            return int(rest)
        if kind == b"$":
            n = int(rest)
            if n < 0:
                return None
            while len(self.buf) < n + 2:
                chunk = self.sock.recv(65536)
                if not chunk:
                    raise ConnectionError("closed in a bulk string")
                self.buf += chunk
            data, self.buf = self.buf[:n], self.buf[n + 2:]
            return data
        if kind == b"*":
            n = int(rest)
            return None if n < 0 else [self.reply() for _ in range(n)]
        raise ValueError("not a RESP reply: %r" % line)

    def close(self):
        self.sock.close()


def record(reply):
    """IDEM.GET's flat field/value array as a dict of str -> bytes (None for nil)."""
    if reply is None:
        return None
    return {reply[i].decode(): reply[i + 1] for i in range(0, len(reply), 2)}


def stats(client):
    reply = client.execute_command("IDEM.STATS")
    return {reply[i].decode(): reply[i + 1] for i in range(0, len(reply), 2)}
