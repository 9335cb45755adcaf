"""The one Python harness that starts and stops coalesce-server processes.

A `ServerProcess` is a coalesce-server on free ports (`--host=127.0.0.1
--port=0 --metrics_port=0`: the server picks the ports and logs them): it
starts the binary so that it dies with its parent, keeps the server's log in
memory (a reader thread; optionally copied to a file as it comes), waits until
the server logs that it is serving (and, when asked, until the gRPC health
service says SERVING), reads its /metrics, and stops it (SIGTERM, then SIGKILL
after a grace period) or kills it. Every error raises `HarnessError`, with the
command and the log.

Used by the end-to-end tests (tests/service/e2e_support.py, and through it
tests/bench/), the Prometheus test (tests/deploy/test_prometheus.py), the
batching sweep (tools/bench/sweep.py) and the soak (tools/soak/soak.py). They
find this file through a path computed from their own:

    sys.path.insert(0, os.path.join(REPO, "tools", "harness"))
    import coalesce_harness

Standard library only; grpc is imported only by `health_serving`, when called.
"""

import re
import shlex
import shutil
import signal
import subprocess
import threading
import time
import urllib.request

__all__ = ["HarnessError", "ServerProcess", "die_with_parent", "parse_serving",
           "health_serving", "read_metrics_text", "metric_samples", "sum_metrics",
           "LISTEN_FLAGS", "SERVING_RE"]

# The flags every ServerProcess gets: loopback only, ports picked by the server.
LISTEN_FLAGS = ("--host=127.0.0.1", "--port=0", "--metrics_port=0")

# The server's start-up line: "serving MODEL on HOST:PORT (metrics port N), ..."
# (MODEL may hold spaces: a GGUF file's general.name does)
# (N is -1 with the metrics endpoint off).
SERVING_RE = re.compile(r"serving (.+?) on ([0-9.]+):(\d+) \(metrics port (-?\d+)\)")


class HarnessError(RuntimeError):
    """A server that would not start, answer or stop as asked."""


def die_with_parent(argv):
    """`argv` run so that the child gets SIGKILL if its parent dies (e.g. a test
    run or a sweep killed by a ctest timeout): util-linux's setpriv sets
    PR_SET_PDEATHSIG and execs it. Not a preexec_fn: Python code between fork
    and exec in a process with threads (gRPC's, the log readers) can crash or
    deadlock the child."""
    setpriv = shutil.which("setpriv")
    return ([setpriv, "--pdeathsig=KILL", "--"] if setpriv else []) + list(argv)


def parse_serving(line):
    """(model, host, port, metrics_port) from the server's 'serving' line, or
    None for any other line."""
    m = SERVING_RE.search(line)
    if not m:
        return None
    return m.group(1), m.group(2), int(m.group(3)), int(m.group(4))


def health_serving(address, timeout_s=2.0):
    """True when grpc.health.v1.Health/Check for the whole server answers
    SERVING. Raw bytes, so no stubs are needed: the request (service "") is
    empty and SERVING is field 1 = 1, encoded 08 01. Without grpcio it cannot
    ask and answers True (a client that waits for the server itself, such as
    coalesce-bench's --wait_for_server, waits instead)."""
    try:
        import grpc
    except ImportError:
        return True
    try:
        with grpc.insecure_channel(address) as channel:
            check = channel.unary_unary("/grpc.health.v1.Health/Check")
            return check(b"", timeout=timeout_s) == b"\x08\x01"
    except grpc.RpcError:
        return False


def read_metrics_text(metrics_port, timeout_s=10):
    """The Prometheus text of http://127.0.0.1:PORT/metrics (OSError if it
    cannot be read)."""
    url = "http://127.0.0.1:%d/metrics" % metrics_port
    with urllib.request.urlopen(url, timeout=timeout_s) as f:
        return f.read().decode("utf-8")


_SAMPLE_RE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)")


def metric_samples(text):
    """(name, labels, value) for each sample line of Prometheus text, where
    labels is the text between the braces as the server wrote it ('' for
    none): 'a{x="1"} 2' -> ('a', 'x="1"', 2.0). Comments and blank lines are
    skipped; any other line raises HarnessError."""
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE_RE.match(line)
        if not m:
            raise HarnessError("unparsable metrics line: %r" % line)
        try:
            value = float(m.group(4))
        except ValueError:
            raise HarnessError("unparsable metrics line: %r" % line) from None
        yield m.group(1), m.group(3) or "", value


def sum_metrics(text):
    """{series: value} of Prometheus text, where a series is 'name{labels}' as
    the server wrote it, or 'name' alone; a labelled family's name alone also
    holds the sum over its label sets (coalesce_requests_total: every status)."""
    out = {}
    for name, labels, value in metric_samples(text):
        key = "%s{%s}" % (name, labels) if labels else name
        out[key] = out.get(key, 0.0) + value
        if labels:
            out[name] = out.get(name, 0.0) + value
    return out


class ServerProcess:
    """One coalesce-server on free ports, started by the constructor.

    The command is [binary] + leading_flags + LISTEN_FLAGS + flags (a flag
    given twice: the last wins). The constructor returns once the server has
    logged that it is serving (and, with wait_health, once its health service
    says SERVING), within start_timeout_s; otherwise it kills the server and
    raises HarnessError. With log_path, the log is also written to that file
    as it comes.

    Attributes: cmd, proc (the subprocess.Popen), port, metrics_port, address
    ("127.0.0.1:PORT"), model (as the server names it), log_path.
    """

    def __init__(self, binary, flags=(), *, leading_flags=(), log_path=None,
                 start_timeout_s=60.0, wait_health=False, env=None):
        self.cmd = [binary] + list(leading_flags) + list(LISTEN_FLAGS) + list(flags)
        self.log_path = log_path
        self.port = self.metrics_port = self.address = self.model = None
        self._lines = []
        self._lock = threading.Lock()
        self._serving = threading.Event()
        tee = open(log_path, "wb") if log_path else None
        try:
            self.proc = subprocess.Popen(die_with_parent(self.cmd), stdin=subprocess.DEVNULL,
                                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                         env=env)
        except OSError as e:
            if tee:
                tee.close()
            raise HarnessError("cannot start %s: %s" % (self.command(), e)) from None
        self._reader = threading.Thread(target=self._drain, args=(tee,), daemon=True)
        self._reader.start()
        deadline = time.monotonic() + start_timeout_s
        if not self._serving.wait(start_timeout_s):
            self.kill()
            raise HarnessError("coalesce-server did not log 'serving' within %g s: %s\nlog:\n%s"
                               % (start_timeout_s, self.command(), self.log()))
        if self.port is None:
            self.kill()
            raise HarnessError("coalesce-server exited with status %s before serving: %s\n"
                               "log:\n%s" % (self.proc.returncode, self.command(), self.log()))
        self.address = "127.0.0.1:%d" % self.port
        if wait_health:
            self.wait_health(deadline - time.monotonic())

    def _drain(self, tee):
        try:
            for raw in iter(self.proc.stdout.readline, b""):
                line = raw.decode("utf-8", "replace")
                with self._lock:
                    self._lines.append(line)
                if tee:
                    tee.write(raw)
                    tee.flush()
                if self.port is None:
                    serving = parse_serving(line)
                    if serving:
                        self.model, _, self.port, self.metrics_port = serving
                        self._serving.set()
            self.proc.wait()
        finally:
            if tee:
                tee.close()
            self._serving.set()

    def command(self):
        """The command as a shell would take it."""
        return shlex.join(self.cmd)

    def running(self):
        return self.proc.poll() is None

    # -- the log ---------------------------------------------------------------
    def log(self, start=0):
        """The log from line `start` on, as one string."""
        with self._lock:
            return "".join(self._lines[start:])

    def log_lines(self):
        with self._lock:
            return list(self._lines)

    def log_len(self):
        """Lines logged so far: a mark for log(start)."""
        with self._lock:
            return len(self._lines)

    # -- health and metrics ----------------------------------------------------
    def wait_health(self, timeout_s):
        """Returns once the health service says SERVING; kills the server and
        raises HarnessError if it has not within timeout_s or exits first."""
        deadline = time.monotonic() + timeout_s
        while not health_serving(self.address):
            if time.monotonic() > deadline or not self.running():
                self.kill()
                raise HarnessError("coalesce-server never reported SERVING: %s\nlog:\n%s"
                                   % (self.command(), self.log()))
            time.sleep(0.1)

    def metrics_text(self):
        """The Prometheus text of its /metrics; HarnessError if unreadable."""
        try:
            return read_metrics_text(self.metrics_port)
        except OSError as e:
            rc = self.proc.poll()
            raise HarnessError("cannot read http://127.0.0.1:%s/metrics (%s); coalesce-server "
                               "%s: %s\nlog:\n%s" % (
                                   self.metrics_port, e,
                                   "is running" if rc is None else "exited with %d" % rc,
                                   self.command(), self.log())) from None

    def metrics(self):
        """Its /metrics as sum_metrics gives them: {series: value}."""
        return sum_metrics(self.metrics_text())

    # -- the end -----------------------------------------------------------------
    def stop(self, grace_s=15.0):
        """SIGTERM (the server drains within its --grace_period), then SIGKILL
        if it is still running after grace_s. Returns its exit status, or None
        if it had to be killed."""
        rc = self.proc.poll()
        if rc is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                rc = self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.kill()
                return None
        self._reader.join(5)
        return rc

    def kill(self):
        """SIGKILL, if it is still running; then wait for it and its log."""
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            pass
        self._reader.join(5)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
        return False
