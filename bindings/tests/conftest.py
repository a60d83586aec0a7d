"""Shared fixtures: checkpoint directories, a real SeaweedFS S3 server, and the CI rule.

With CI set (non-empty, not "false"/"0"), a test that needs a real part (SeaweedFS, torch)
fails instead of skipping. Only tests that need a GPU skip in CI, and they say so.
"""

from __future__ import annotations

import ctypes
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Dict, Iterator, List, Optional

import pytest

ROOT = Path(__file__).resolve().parents[2]
CI = os.environ.get("CI", "") not in ("", "false", "0")


def need(what: str, reason: str) -> None:
    """Skips a test that lacks `what`, or fails it in CI."""
    msg = f"{what} not available: {reason}"
    if CI:
        pytest.fail(f"{msg} (CI is set: real parts are required)")
    pytest.skip(msg)


@pytest.fixture
def local_dir(tmp_path: Path) -> Path:
    d = tmp_path / "disk"
    d.mkdir()
    return d


@pytest.fixture
def unreachable_s3(monkeypatch: pytest.MonkeyPatch) -> None:
    """S3 settings whose endpoint refuses connections (a loopback port nothing listens on):
    a store that is down."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("AWS_ALLOW_HTTP", "true")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "y")


def _die_with_parent() -> None:
    # The kernel kills weed if pytest dies (PR_SET_PDEATHSIG = 1, SIGKILL).
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)


def _free_ports(n: int) -> List[int]:
    """Loopback TCP ports free now, for servers started on them a moment later. They come from
    below the kernel's ephemeral range (where it leaves room), which the kernel never hands to
    another socket: not to weed's own connections while its servers start one by one, not to
    a bind to port 0."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = 32768
    lowest = 10000
    socks: List[socket.socket] = []
    try:
        span = ephemeral - lowest
        start = random.randrange(span) if span > 0 else 0
        for k in range(max(span, 0)):
            if len(socks) == n:
                break
            s = socket.socket()
            try:
                s.bind(("127.0.0.1", lowest + (start + k) % span))
            except OSError:
                s.close()
                continue
            socks.append(s)
        while len(socks) < n:
            s = socket.socket()
            socks.append(s)
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class SeaweedFs:
    """`weed server -s3` on free loopback ports, its data in a temp dir (as crate
    hotstart-testkit starts it for the Rust tests)."""

    def __init__(self, weed: str) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix=f"hotstart-weed-{os.getpid()}-"))
        (self.dir / "data").mkdir()
        p = _free_ports(8)
        self.ports = p
        self.endpoint = f"http://127.0.0.1:{p[6]}"
        args = [
            weed, "server", f"-dir={self.dir / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-master.port={p[0]}", f"-master.port.grpc={p[1]}", "-master.volumeSizeLimitMB=64",
            f"-volume.port={p[2]}", f"-volume.port.grpc={p[3]}", "-volume.max=10000",
            "-master.telemetry=false", "-volume.preStopSeconds=0",
            "-filer", f"-filer.port={p[4]}", f"-filer.port.grpc={p[5]}",
            f"-filer.localSocket={self.dir / 'filer.sock'}",
            "-s3", f"-s3.port={p[6]}", f"-s3.port.grpc={p[7]}",
            f"-s3.localSocket={self.dir / 's3.sock'}", "-s3.port.iceberg=0", "-s3.port.lance=0",
        ]
        log = open(self.dir / "weed.log", "wb")
        self.proc = subprocess.Popen(
            args, cwd=self.dir, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
            env=dict(os.environ, TMPDIR=str(self.dir)), preexec_fn=_die_with_parent,
        )
        log.close()
        self._wait_ready(60)
        self.buckets = 0

    def request(self, method: str, path: str, body: bytes = b"") -> int:
        req = urllib.request.Request(self.endpoint + path, data=body or None, method=method)
        try:
            with urllib.request.urlopen(req, timeout=10) as r:
                r.read()
                return int(r.status)
        except urllib.error.HTTPError as e:
            return int(e.code)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                if self.request("PUT", "/pytest-ready-probe") in (200, 409) and self.request(
                    "PUT", "/pytest-ready-probe/p", b"ready"
                ) == 200:
                    return
            except OSError as e:
                last = str(e)
            time.sleep(0.1)
        tail = (self.dir / "weed.log").read_text(errors="replace")[-4000:]
        self.stop()
        raise RuntimeError(f"SeaweedFS did not start ({last}); weed.log:\n{tail}")

    def env(self) -> Dict[str, str]:
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ALLOW_HTTP": "true",
            "AWS_REGION": "us-east-1",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ACCESS_KEY_ID": "hotstart-test",
            "AWS_SECRET_ACCESS_KEY": "hotstart-test-secret",
        }

    def fresh_bucket(self, prefix: str = "py") -> str:
        self.buckets += 1
        name = f"{prefix}-{self.buckets}-{os.getpid()}"
        status = self.request("PUT", f"/{name}")
        if status not in (200, 409):
            raise RuntimeError(f"cannot create bucket {name}: HTTP {status}")
        return f"s3://{name}"

    def again(self, tmp: Path) -> "Sidecar":
        """The same node started anew (its memory empty; its disk kept)."""
        return Sidecar(tmp, node=self.node, listen=self.listen, peers=self.peers, store=self.store)

    def kill(self) -> None:
        """SIGKILL: the node is lost, and the memory with it."""
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        shutil.rmtree(self.dir, ignore_errors=True)
        # The sockets weed makes in /tmp, whatever -localSocket says (as the Rust helper names
        # them).
        p = self.ports
        for what, port in (("master-grpc", p[1]), ("volume-grpc", p[3]), ("filer-grpc", p[5]),
                           ("s3-grpc", p[7]), ("filer", p[4]), ("s3", p[6])):
            Path(f"/tmp/seaweedfs-{what}-{port}.sock").unlink(missing_ok=True)


@pytest.fixture(scope="session")
def seaweed() -> Iterator[SeaweedFs]:
    """One SeaweedFS for the whole test session; its AWS_* settings are put in os.environ
    (the engine's store client reads them)."""
    weed = os.environ.get("HOTSTART_WEED") or str(ROOT / ".venv" / "bin" / "weed")
    if not os.access(weed, os.X_OK):
        weed = shutil.which("weed") or ""
    if not weed:
        need("SeaweedFS", "no `weed` binary (run scripts/setup.sh)")
    server = SeaweedFs(weed)
    saved = {k: os.environ.get(k) for k in server.env()}
    os.environ.update(server.env())
    try:
        yield server
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()


@pytest.fixture
def bucket(seaweed: SeaweedFs) -> str:
    return seaweed.fresh_bucket()


def torch_or_fail():  # type: ignore[no-untyped-def]
    try:
        import torch
    except ImportError as e:
        need("torch", str(e))
    return torch


def run_python(args: List[str], env: Dict[str, str] | None = None, timeout: float = 300,
               check: bool = True) -> subprocess.CompletedProcess:
    """Runs this interpreter on `args`; output captured, a watchdog timeout."""
    full = dict(os.environ, **(env or {}))
    r = subprocess.run([sys.executable, *args], env=full, capture_output=True, text=True,
                       timeout=timeout)
    if check and r.returncode != 0:
        raise AssertionError(f"{args} exited {r.returncode}\nstdout:\n{r.stdout}\nstderr:\n{r.stderr}")
    return r


def _hotstart_bin() -> str:
    exe = os.environ.get("HOTSTART_BIN") or str(ROOT / "target" / "debug" / "hotstart")
    if not os.access(exe, os.X_OK):
        need("the hotstart binary", f"{exe} is missing (`cargo build --bin hotstart`)")
    return exe


class Sidecar:
    """`hotstart serve` on loopback with a disk tier (insecure: loopback only): alone, or as
    node `node` of a cluster whose other nodes listen on `peers` ({node id: peer port}), its own
    peer port `listen`, each shard copied to one peer. Its socket, disk and log are in `home`
    (default `tmp`)."""

    def __init__(self, tmp: Path, *, node: str = "py-0", listen: Optional[int] = None,
                 peers: Optional[Dict[str, int]] = None, store: Optional[str] = None) -> None:
        home = tmp if not peers else tmp / node
        home.mkdir(parents=True, exist_ok=True)
        peer, http = _free_ports(2)
        peer = listen or peer
        self.node, self.listen, self.peers, self.store = node, peer, peers, store
        self.socket = home / "sidecar.sock"
        self.http = f"http://127.0.0.1:{http}"
        self.log = home / "sidecar.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("HOTSTART_")}
        env["HOTSTART_LOG"] = "info"
        cluster: List[str] = []
        if peers:
            cluster = ["--peers", ",".join(f"{n}=127.0.0.1:{p}" for n, p in peers.items()),
                       "--replicas", "1", "--probe-interval", "1s", "--recovery-timeout", "5s"]
        if store:
            cluster += ["--store", store]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [
                    _hotstart_bin(), "serve", "--insecure", "--node-id", node,
                    "--listen", f"127.0.0.1:{peer}", "--http", f"127.0.0.1:{http}",
                    "--socket", str(self.socket), "--disk-dir", str(home / "disk"),
                    "--memory-budget", "256MiB", *cluster,
                ],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env,
                preexec_fn=_die_with_parent,
            )
        deadline = time.monotonic() + 60
        while not self._ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"the sidecar did not become ready:\n{self.log.read_text()}")
            time.sleep(0.05)

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(self.http + "/readyz", timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def metric(self, name: str, labels: str) -> float:
        """The sample of `name` with `labels`; 0 when that label set has no sample yet, an error
        when the sidecar exports no such metric at all (a renamed metric must not read as 0)."""
        with urllib.request.urlopen(self.http + "/metrics", timeout=5) as r:
            text = r.read().decode()
        m = re.search(rf"^{re.escape(name)}\{{{re.escape(labels)}\}} (\S+)$", text, re.M)
        if m:
            return float(m.group(1))
        if not re.search(rf"^# TYPE {re.escape(name)} ", text, re.M):
            raise AssertionError(f"the sidecar exports no metric {name}")
        return 0.0

    def again(self, tmp: Path) -> "Sidecar":
        """The same node started anew (its memory empty; its disk kept)."""
        return Sidecar(tmp, node=self.node, listen=self.listen, peers=self.peers, store=self.store)

    def kill(self) -> None:
        """SIGKILL: the node is lost, and the memory with it."""
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def sidecar(tmp_path: Path) -> Iterator[Sidecar]:
    s = Sidecar(tmp_path)
    try:
        yield s
    finally:
        s.stop()
