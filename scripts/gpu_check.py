"""The Python half of the GPU check (`scripts/gpu-check.sh run`): torch tensors on the GPU
through `hotstart.Checkpointer` and torch.distributed.checkpoint, bit-exact, and the stall and
restore figures against what a user would do instead, in the same process.

    python gpu_check.py --out DIR [--gib 4 16] [--runs 3] [--device cuda] [--hotstart BIN]
    python gpu_check.py --out DIR --torchrun train.py --hotstart BIN [--device cuda]
    python gpu_check.py --out DIR --train-loop [--hotstart BIN] [--device cuda]

Writes DIR/python.json and prints one Markdown table. `--device cpu` runs the same code on CPU
tensors with small sizes: how the script itself is tested on machines without a GPU (the
figures then mean nothing).

Rows (every figure a median of `--runs`), measured in this order: the raw copies and the
sidecar's rows for every size, then the disk tier's and DCP's rows at the first size only, then
the floors; each row printed as it lands:
- checks: mixed host/device state dicts round trip bit-exact (new tensors, and in place into
  device tensors); DCP save/load of device tensors through hotstart.torch, bit-exact;
- stall: `Checkpointer.save()` → `wait_staged()` of device tensors (bf16 and fp32), against a
  copy into pinned host memory made ahead (`Tensor.copy_(non_blocking=True)`, then a
  synchronize: the raw D2H copy) and DCP `async_save`'s blocking part (its own file system
  writer);
- restore: `Checkpointer.load()` into device tensors from the local disk tier (every chunk
  verified, read with O_DIRECT), against the raw H2D copy of the same bytes from pinned memory
  and against reading the same file into memory, cold (its pages dropped first: the disk's
  floor) and from the page cache;
- sidecar (with `--hotstart`, the `hotstart` binary): the same save and restore through
  `hotstart serve`, the restore coming from the sidecar's host memory, copied into the device
  tensors by the sidecar from its memory pinned since the save was committed (who copied is
  reported: `Checkpointer.device_route`, and where the sidecar's copies spent their time); at
  the first size, beside it, the same restore of a 4 KiB tensor (what a restore costs beyond
  its copy: the request, the segment's hand-over, one IPC handle opened and closed), and the
  same restore from a sidecar started with `--no-gpu-pin`, which the process copies through
  its own pinned buffers;
- floors (with `--hotstart`): what the process's own copy cannot beat here, since the
  sidecar's bytes are not pinned in the restoring process: copying them out of shared memory on
  every core (no device copy), and registering them as pinned memory (no copy).

`--torchrun TRAIN_PY --hotstart BIN` runs, instead, a real PyTorch job under torchrun
(examples/torchrun/train.py): a worker killed after a save and restarted by torchrun resumes
from the sidecar's memory bit-exact, with its restart against its floor (torchrun.json,
torchrun.md).

`--train-loop` measures, instead, what checkpoints cost a training loop on the GPU (a stack of
large Linear layers, AdamW, bf16 autocast; see TRAIN_LOOP): the same steps run without
checkpoints, then with a checkpoint of the model's and optimizer's state every few steps, each
way in turn: the raw D2H copy into pinned memory made ahead (the floor), hotstart's Checkpointer
with a local disk tier and (with `--hotstart`) through `hotstart serve`, DCP `async_save` and
DCP `async_save` with pinned-memory staging (`DefaultStager`, torch 2.9+; a torch without it
gets a row of NaN and the reason). The figure: the training time lost per checkpoint (the wall
time of the steps with checkpoints, less without, over the checkpoints: background work slowing
the steps counts), beside the median time a checkpoint blocks the training thread, against the
raw D2H copy of the same bytes alone. hotstart's last checkpoint is loaded back and compared
with the state it saved, bit for bit (exit 1 if it differs). Writes train_loop.json and
train_loop.md.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch

import hotstart


def median_of(runs: int, fn: Callable[[], float]) -> float:
    return statistics.median(fn() for _ in range(runs))


def state(gib: float, device: str) -> Dict[str, torch.Tensor]:
    """`gib` GiB in 32 tensors, half bf16 and half fp32, filled on the device."""
    total = int(gib * (1 << 30))
    out: Dict[str, torch.Tensor] = {}
    for i in range(32):
        dtype = torch.bfloat16 if i % 2 else torch.float32
        n = total // 32 // torch.empty((), dtype=dtype).element_size()
        g = torch.Generator(device=device).manual_seed(i)
        out[f"layer{i:02d}"] = torch.rand(n, generator=g, device=device).to(dtype)
    return out


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class Timed:
    """Timed saves (`save()` → `wait_staged()`, each save waited for in full before the next)
    and loads into `into` of one Checkpointer's state `src`."""

    def __init__(self, ck: "hotstart.Checkpointer", src: Dict[str, torch.Tensor], device: str) -> None:
        self.ck, self.src, self.device, self.step = ck, src, device, 0
        self.into = {k: torch.empty_like(v) for k, v in src.items()}

    def save(self) -> float:
        self.step += 1
        sync(self.device)
        t = time.perf_counter()
        h = self.ck.save(self.step, self.src)
        h.wait_staged()
        took = time.perf_counter() - t
        h.wait()
        return took

    def load(self) -> float:
        for v in self.into.values():
            v.zero_()
        sync(self.device)
        t = time.perf_counter()
        self.ck.load(self.into)
        sync(self.device)
        took = time.perf_counter() - t
        if not same(self.src, self.into):
            raise SystemExit("the restored device tensors differ from the saved ones")
        return took


def bytes_of(t: torch.Tensor) -> torch.Tensor:
    # Flat first: a 0-dim tensor (AdamW's step) has no byte view of its own.
    return t.cpu().reshape(-1).view(torch.uint8)


def same(a: Dict[str, torch.Tensor], b: Dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and torch.equal(bytes_of(a[k]), bytes_of(b[k]))
        for k in a
    )


def checks(tmp: Path, device: str) -> Dict[str, bool]:
    src = state(1 / 64, device)
    mixed = {"gpu": src, "host": {"w": torch.arange(1000, dtype=torch.float64)}, "step": 7}
    ok: Dict[str, bool] = {}
    with hotstart.Checkpointer(local_dir=tmp / "checks", job="gpu-check", rank=0, world_size=1) as ck:
        ck.save(1, mixed).wait()
        back = ck.load()
        ok["mixed state dict, new tensors"] = (
            same(src, back["gpu"]) and torch.equal(back["host"]["w"], mixed["host"]["w"]) and back["step"] == 7
        )
        into = {"gpu": {k: torch.zeros_like(v) for k, v in src.items()},
                "host": {"w": torch.zeros(1000, dtype=torch.float64)}, "step": 0}
        ck.load(into)
        ok["in place into device tensors"] = same(src, into["gpu"]) and all(
            t.device.type == device for t in into["gpu"].values()
        )
    import torch.distributed.checkpoint as dcp
    from hotstart.torch import StorageReader, StorageWriter

    dcp.save({"gpu": src}, storage_writer=StorageWriter(local_dir=tmp / "dcp", job="gpu-dcp"), checkpoint_id=1)
    dst = {"gpu": {k: torch.zeros_like(v) for k, v in src.items()}}
    dcp.load(dst, storage_reader=StorageReader(local_dir=tmp / "dcp", job="gpu-dcp"), checkpoint_id=1)
    ok["torch.distributed.checkpoint through hotstart.torch"] = same(src, dst["gpu"])
    return ok


class Rows(dict):  # type: ignore[type-arg]
    """One size's figures, each printed as it is measured with the seconds since the check began:
    a part stopped at its time limit shows how far it came."""

    def __init__(self, gib: float) -> None:
        super().__init__()
        self.gib = gib

    def __setitem__(self, key: str, value: Any) -> None:
        super().__setitem__(key, value)
        print(f"[{time.perf_counter() - STARTED:6.1f} s] {self.gib} GiB: {key}: {value}", flush=True)


STARTED = time.perf_counter()


def raw_rows(rows: Rows, src: Dict[str, torch.Tensor], runs: int, device: str) -> None:
    """The floors every ratio is taken against: the state copied into pinned host memory made
    ahead (`copy_(non_blocking=True)`, then a synchronize) and back."""
    pinned = device == "cuda"
    host = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=pinned) for k, v in src.items()}
    into = {k: torch.empty_like(v) for k, v in src.items()}

    def copy(dst: Dict[str, torch.Tensor], frm: Dict[str, torch.Tensor]) -> float:
        sync(device)
        t = time.perf_counter()
        for k, v in frm.items():
            dst[k].copy_(v, non_blocking=True)
        sync(device)
        return time.perf_counter() - t

    copy(host, src)
    rows["raw D2H into pinned memory (s)"] = median_of(runs, lambda: copy(host, src))
    copy(into, host)
    rows["raw H2D from pinned memory (s)"] = median_of(runs, lambda: copy(into, host))


def disk_rows(rows: Rows, tmp: Path, src: Dict[str, torch.Tensor], runs: int, device: str) -> None:
    """The engine in the process with a local disk tier: the save's stall, and the restore into
    device tensors against reading the same file."""
    where = tmp / f"stall-{rows.gib}"
    with hotstart.Checkpointer(local_dir=where, job="stall", keep=1, rank=0, world_size=1) as ck:
        timed = Timed(ck, src, device)
        timed.save()  # the first save allocates and registers its staging memory
        rows["hotstart save() → wait_staged() (s)"] = median_of(runs, timed.save)
        rows["hotstart load() into device tensors, local disk tier (s)"] = median_of(runs, timed.load)
        (file,) = (where / "stall" / f"step-{timed.step}").glob("rank-0.safetensors")
        # The engine reads with O_DIRECT: compare with a read whose pages are dropped first (cold,
        # like for like), and show the page cache's speed beside it.
        rows["read the same file into memory, cold, one thread (s)"] = median_of(runs, lambda: read_file(file, cold=True))
        rows["read the same file into memory, page cache, one thread (s)"] = median_of(runs, lambda: read_file(file))
    shutil.rmtree(where)  # 16 GiB: the rows after this write as much again


def dcp_rows(rows: Rows, tmp: Path, src: Dict[str, torch.Tensor], runs: int, device: str) -> None:
    """DCP `async_save`'s blocking part, with its own file system writer."""
    import torch.distributed.checkpoint as dcp

    n = [0]

    def dcp_async() -> float:
        n[0] += 1
        sync(device)
        t = time.perf_counter()
        where = tmp / f"dcp-{rows.gib}-{n[0]}"
        fut = dcp.async_save({"s": src}, checkpoint_id=str(where))
        took = time.perf_counter() - t
        fut.result()
        shutil.rmtree(where)  # 16 GiB a run: the disk is not that large
        return took

    try:
        dcp_async()
        rows["DCP async_save, blocking part (s)"] = median_of(runs, dcp_async)
    except Exception as e:  # recorded, not fatal: this row is a peer's, not ours
        rows["DCP async_save, blocking part (s)"] = float("nan")
        print(f"DCP async_save failed: {e}", file=sys.stderr)


def render(result: Dict[str, Any]) -> str:
    lines: List[str] = [f"device: {result['device']}, torch {result['torch']}", ""]
    lines += ["| check | bit-exact |", "|---|---|"]
    lines += [f"| {k} | {'yes' if v else 'NO'} |" for k, v in result["checks"].items()]
    for g, rows in result["sizes"].items():
        nan = float("nan")
        raw, h2d = rows.get("raw D2H into pinned memory (s)", nan), rows.get("raw H2D from pinned memory (s)", nan)
        stall = rows.get("hotstart save() → wait_staged() (s)", nan)
        lines += ["", f"{g} GiB in 32 tensors (bf16 and fp32), median of {rows['runs']:.0f}:", ""]
        lines += ["| what | seconds | ratio | target |", "|---|---|---|---|"]

        def row(what: str, key: str, ratio: Callable[[float], str] = lambda v: "", target: str = "") -> None:
            # Only what was measured: a run stopped at its limit leaves the rest out.
            if key in rows:
                lines.append(f"| {what} | {rows[key]:.3f} | {ratio(rows[key])} | {target} |")

        row("raw D2H into pinned memory", "raw D2H into pinned memory (s)")
        row("raw H2D from pinned memory", "raw H2D from pinned memory (s)")
        row("sidecar: save → wait_staged", "sidecar: save() → wait_staged() (s)", lambda v: f"{v / raw:.2f}× raw D2H", "≤ 1.1×")
        row("sidecar: load into device tensors from its memory", "sidecar: load() into device tensors, from its memory (s)",
            lambda v: f"{h2d / v:.2f}× raw H2D speed", "≥ 0.9×")
        if "sidecar: who copied into the device tensors" in rows:
            lines.append(f"| … copied by | {rows['sidecar: who copied into the device tensors']} | | sidecar |")
        if "sidecar: its copies, by phase" in rows:
            lines.append(uploads_row(rows["sidecar: its copies, by phase"]))
        row("sidecar: load of 4 KiB into a device tensor (the cost per restore)",
            "sidecar: load() of 4 KiB into a device tensor, the cost per restore (s)", lambda v: f"{v * 1e3:.2f} ms")
        if "sidecar: 4 KiB, its copies, by phase" in rows:
            lines.append(uploads_row(rows["sidecar: 4 KiB, its copies, by phase"]))
        if "sidecar: pinning each step for the GPU, in the background" in rows:
            lines.append(pins_row(rows["sidecar: pinning each step for the GPU, in the background"]))
        for k in rows:
            if k.startswith("sidecar --no-gpu-pin: ") and k.endswith(" (s)"):
                row(f"sidecar `--no-gpu-pin`: {k[len('sidecar --no-gpu-pin: '):-len(' (s)')]}", k,
                    lambda v: f"{h2d / v:.2f}× raw H2D speed")
        if "sidecar --no-gpu-pin: who copied" in rows:
            lines.append(f"| … copied by | {rows['sidecar --no-gpu-pin: who copied']} | | |")
        row("hotstart save → wait_staged", "hotstart save() → wait_staged() (s)", lambda v: f"{v / raw:.2f}× raw D2H", "≤ 1.1×")
        load_key = "hotstart load() into device tensors, local disk tier (s)"
        row("hotstart load into device tensors (disk tier)", load_key, lambda v: f"{h2d / v:.2f}× raw H2D speed")
        load = rows.get(load_key, nan)
        for how in ("cold", "page cache"):
            row(f"read the same file into memory, {how}", f"read the same file into memory, {how}, one thread (s)",
                lambda v: f"hotstart takes {load / v:.2f}× this")
        row("DCP async_save, blocking part", "DCP async_save, blocking part (s)", lambda v: f"{v / stall:.2f}× hotstart", "≥ 3×")
        for k in rows:
            if k.startswith("floor: "):
                row(f"floor of the process copying: {k[len('floor: '):-len(' (s)')]}", k,
                    lambda v: f"at most {h2d / v:.2f}× raw H2D speed")
    return "\n".join(lines)


def uploads_row(u: Dict[str, float]) -> str:
    """A table row of where the sidecar's copies into device tensors spent their time (see
    Served.uploads): what a restore through the sidecar pays beyond the copy."""
    if not u["restores copied"]:
        return "| … the sidecar's copies, by phase | none copied | | |"
    return (f"| … the sidecar's copies, by phase (ms each) | open {u['open (ms each)']:.2f} "
            f"({u['handles each']:.0f} handles), copy {u['copy (ms each)']:.2f}, close "
            f"{u['close (ms each)']:.2f} | | |")


def pins_row(p: Any) -> str:
    """A table row of what the sidecar's pinning thread did (see Served.pins)."""
    if not p:
        return "| sidecar: steps pinned for the GPU | not measured | | |"
    each = f"{p['seconds each']:.3f} s each" if p["pinned"] else "none"
    return (f"| sidecar: steps pinned for the GPU, in the background | {p['pinned']:.0f} pinned, "
            f"{p['failed']:.0f} failed, {p['waiting']:.0f} still waiting | {each} | |")


def read_file(path: Path, cold: bool = False) -> float:
    """Seconds to read `path` with 8 MiB buffered reads; `cold` drops its cached pages first."""
    buf = bytearray(8 << 20)
    with open(path, "rb", buffering=0) as f:
        if cold:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        t = time.perf_counter()
        while f.readinto(buf):
            pass
        return time.perf_counter() - t


class Served:
    """A running `hotstart serve`: its socket, and its metrics."""

    def __init__(self, sock: Path, http: int) -> None:
        self.sock, self.http = sock, http

    def metrics(self) -> Dict[str, float]:
        """Every sample of `/metrics`, by its name with labels."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.http}/metrics", timeout=10) as r:
            page = r.read().decode()
        out: Dict[str, float] = {}
        for line in page.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def pins(self, wait_s: float = 120) -> Dict[str, float]:
        """Waits until no committed step waits to be pinned for the GPU (none does where the
        sidecar does not pin), then what pinning did: steps pinned and failed, and the mean
        seconds per step."""
        deadline = time.monotonic() + wait_s
        while True:
            m = self.metrics()
            if m["hotstart_gpu_pin_waiting_steps"] == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        pinned = m['hotstart_gpu_pins_total{result="pinned"}']
        return {"pinned": pinned, "failed": m['hotstart_gpu_pins_total{result="failed"}'],
                "waiting": m["hotstart_gpu_pin_waiting_steps"],
                "seconds each": m["hotstart_gpu_pin_seconds_total"] / pinned if pinned else float("nan")}


    def uploads(self, since: Optional[Dict[str, float]] = None) -> Dict[str, float]:
        """Where the sidecar's copies into device tensors spent their time, per restore it copied
        (milliseconds opening the IPC handles, copying, closing them), and the handles opened;
        of the restores after the `metrics()` taken as `since`, if given."""
        m = self.metrics()
        if since is not None:
            m = {k: v - since.get(k, 0.0) for k, v in m.items()}
        n = m['hotstart_gpu_uploads_total{result="copied"}']
        per = (lambda v: v / n) if n else (lambda v: float("nan"))
        out = {"restores copied": n, "handles each": per(m["hotstart_gpu_upload_handles_total"])}
        for phase in ("open", "copy", "close"):
            out[f"{phase} (ms each)"] = per(m[f'hotstart_gpu_upload_seconds_total{{phase="{phase}"}}'] * 1e3)
        return out


@contextlib.contextmanager
def serve(where: Path, binary: Path, budget_gib: float, *extra: str) -> Iterator[Served]:
    """`hotstart serve` (memory tier and a disk tier, no peers, and `extra` flags) in `where`,
    until the block ends."""
    with socket.socket() as a, socket.socket() as b:
        a.bind(("127.0.0.1", 0))
        b.bind(("127.0.0.1", 0))
        peer, http = a.getsockname()[1], b.getsockname()[1]
    where.mkdir()
    # The socket in a short folder of its own: a Unix socket's path holds at most 107 bytes, and
    # `where` can be deep (each part's temporary folder, a test's).
    sock_dir = Path(tempfile.mkdtemp(prefix="gpu-check-sock-", dir="/tmp"))
    sock = sock_dir / "sidecar.sock"
    log = open(where / "sidecar.log", "wb")
    proc = subprocess.Popen(
        [str(binary), "serve", "--insecure", "--node-id", "gpu-0", "--listen", f"127.0.0.1:{peer}",
         "--http", f"127.0.0.1:{http}", "--socket", str(sock), "--disk-dir", str(where / "disk"),
         "--memory-budget", f"{int(budget_gib) + 1}GiB", *extra],
        stdin=subprocess.DEVNULL, stdout=log, stderr=log,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{http}/readyz", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the sidecar did not start:\n{(where / 'sidecar.log').read_text()}")
            time.sleep(0.05)
        yield Served(sock, http)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
        # The sidecar's warnings and errors (a step it could not pin, say) outlive its folder;
        # when the block is left by an error or the part's time limit, its last lines too.
        logged = (where / "sidecar.log").read_text(errors="replace").splitlines()
        bad = [l for l in logged if " WARN " in l or " ERROR " in l][:20]
        if sys.exc_info()[0] is not None:
            bad += [l for l in logged[-20:] if l not in bad]
        for l in bad:
            print(f"sidecar ({where.name}): {l}", file=sys.stderr, flush=True)
        shutil.rmtree(where, ignore_errors=True)
        shutil.rmtree(sock_dir, ignore_errors=True)


def sidecar_rows(rows: Rows, tmp: Path, src: Dict[str, torch.Tensor], runs: int, device: str, binary: Path,
                 compare: bool) -> None:
    """Save and restore through `hotstart serve` (memory tier and a disk tier, no peers): the
    restore into device tensors copied by the sidecar from its memory, pinned since the save
    was committed; and, with `compare`, from a second sidecar started with `--no-gpu-pin`, the
    same restore copied by the process through its own pinned buffers, as before the sidecar
    pinned (with every core as well: the default is at most 8 threads)."""
    gib = rows.gib
    with serve(tmp / f"sidecar-{gib}", binary, 3 * gib) as sc:
        with hotstart.Checkpointer(sidecar=sc.sock, job="sc", keep=1, rank=0, world_size=1) as ck:
            timed = Timed(ck, src, device)
            timed.save()
            rows["sidecar: save() → wait_staged() (s)"] = median_of(runs, timed.save)
            # A restarted process comes seconds after the save; this one would come before the
            # step is pinned (about 0.1 s per GB), and be copied by the process (and say so).
            rows["sidecar: pinning each step for the GPU, in the background"] = sc.pins()
            rows["sidecar: load() into device tensors, from its memory (s)"] = median_of(runs, timed.load)
            rows["sidecar: who copied into the device tensors"] = ck.device_route
            rows["sidecar: its copies, by phase"] = sc.uploads()
        if compare:
            # What a restore through the sidecar costs beyond its copy: the same, of 4 KiB.
            tiny = {"t": torch.arange(1024, dtype=torch.float32, device=device)}
            with hotstart.Checkpointer(sidecar=sc.sock, job="tiny", keep=1, rank=0, world_size=1) as ck:
                timed = Timed(ck, tiny, device)
                timed.save()
                sc.pins()
                since = sc.metrics()
                rows["sidecar: load() of 4 KiB into a device tensor, the cost per restore (s)"] = \
                    median_of(max(runs, 9), timed.load)
                rows["sidecar: 4 KiB, its copies, by phase"] = sc.uploads(since)
    if not compare:
        return
    cores = os.cpu_count() or 1
    with serve(tmp / f"sidecar-nopin-{gib}", binary, 3 * gib, "--no-gpu-pin") as sc:
        with hotstart.Checkpointer(sidecar=sc.sock, job="sc", keep=1, rank=0, world_size=1) as ck:
            timed = Timed(ck, src, device)
            timed.save()
            rows["sidecar --no-gpu-pin: load() into device tensors, the process copies (s)"] = median_of(runs, timed.load)
            rows["sidecar --no-gpu-pin: who copied"] = ck.device_route
        with hotstart.Checkpointer(sidecar=sc.sock, job="sc", keep=1, rank=0, world_size=1, threads=cores) as ck:
            timed.ck = ck
            rows[f"sidecar --no-gpu-pin: the same, {cores} threads (s)"] = median_of(runs, timed.load)


def floor_rows(rows: Rows, runs: int, device: str) -> None:
    """What a restore from the sidecar's memory cannot beat on this machine: its bytes live in
    shared memory (a memfd) that is not pinned in the restoring process, so before the device can
    read them they are either copied into pinned memory by the CPU (here: `pread` into 8 MiB
    buffers on every core, no device copy at all) or registered as pinned memory (here: one
    `cudaHostRegister` of a read-only mapping, no copy at all)."""
    import ctypes
    import mmap
    import threading

    n = int(rows.gib * (1 << 30))
    fd = os.memfd_create("gpu-check-floor")
    try:
        os.ftruncate(fd, n)
        block = os.urandom(64 << 20)
        for at in range(0, n, len(block)):
            os.pwrite(fd, block[: n - at], at)
        cores = os.cpu_count() or 1

        def copy_out() -> float:
            windows = iter(range(0, n, 8 << 20))
            lock = threading.Lock()

            def work() -> None:
                buf = bytearray(8 << 20)
                while True:
                    with lock:
                        at = next(windows, None)
                    if at is None:
                        return
                    os.preadv(fd, [buf], at)

            t = time.perf_counter()
            threads = [threading.Thread(target=work) for _ in range(cores)]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            return time.perf_counter() - t

        rows[f"floor: copy the bytes out of shared memory, {cores} threads (s)"] = median_of(runs, copy_out)
        if device == "cuda":
            libc = ctypes.CDLL(None, use_errno=True)
            libc.mmap.restype = ctypes.c_void_p
            libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
            libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
            cudart = torch.cuda.cudart()

            def register() -> float:
                at = libc.mmap(None, n, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
                if at in (None, ctypes.c_void_p(-1).value):
                    raise OSError(ctypes.get_errno(), "mmap of the shared memory failed")
                try:
                    t = time.perf_counter()
                    err = cudart.cudaHostRegister(at, n, 0x1 | 0x8)  # portable, read-only
                    took = time.perf_counter() - t
                    if int(err) != 0:
                        raise RuntimeError(f"cudaHostRegister failed: {err}")
                    cudart.cudaHostUnregister(at)
                    return took
                finally:
                    libc.munmap(at, n)

            rows["floor: register the bytes in shared memory as pinned (s)"] = median_of(runs, register)
    finally:
        os.close(fd)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def timeline(out: str) -> Dict[tuple, float]:
    """(event, attempt) → unix time, from train.py's `--timeline` lines."""
    found: Dict[tuple, float] = {}
    for line in out.splitlines():
        f = line.split()
        if len(f) == 7 and f[0] == "at" and f[3] == "rank":
            found[(f[1], int(f[6]))] = float(f[2])
    return found


COPY = "floor: the state's copy (s)"


def torchrun_check(tmp: Path, binary: Path, train: Path, device: str) -> Dict[str, Any]:
    """examples/torchrun/train.py under torchrun, one process (NCCL on the GPU, gloo on CPU),
    FSDP2 and AdamW, checkpointing through `hotstart serve`: an uninterrupted run, and a run whose
    worker kills itself after its step-10 save is staged, which torchrun restarts and which
    resumes from the sidecar's memory. The resumed run must give the uninterrupted run's losses
    of steps 11 and 12 and its final state digest (sha256 of every tensor) bit for bit. Then the
    floor (start, import torch, group, model build, a host-to-device copy of the state from
    pinned memory) and the restart's phases."""
    size = ["--width", "4096", "--depth", "5"] if device == "cuda" else ["--width", "64", "--depth", "1"]
    result: Dict[str, Any] = {"model": " ".join(size)}
    with serve(tmp / "torchrun", binary, 8) as sc:
        def run(job: str, restarts: int, *extra: str) -> str:
            cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1",
                   f"--max-restarts={restarts}", "--monitor-interval=0.1", "--master-addr=127.0.0.1",
                   f"--master-port={free_port()}", str(train), *size, "--timeline", "--job", job, *extra]
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=300,
                               env=dict(os.environ, OMP_NUM_THREADS="4"))
            if r.returncode != 0:
                raise SystemExit(f"torchrun {' '.join(extra)}: exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}")
            return r.stdout

        common = ["--steps", "12", "--save-every", "5", "--sidecar", str(sc.sock)]
        plain = run("plain", 0, *common)
        killed = run("killed", 1, *common, "--kill-rank", "0", "--kill-step", "10")
        result["the state read: the sidecar's copies, by phase"] = sc.uploads()
        floor = run("floor", 0, "--floor", "--steps", "1")

    def tail(out: str) -> List[str]:
        lines = out.splitlines()
        return [l for l in lines if l.startswith(("loss 11 ", "loss 12 "))] + [l for l in lines if l.startswith("state ")][-1:]

    result["bit-exact"] = "resumed 10 " in killed and len(tail(plain)) == 3 and tail(plain) == tail(killed)
    t, f = timeline(killed), timeline(floor)
    copy = next(float(l.split()[1]) for l in floor.splitlines() if l.startswith("floor-copy "))
    result["kill → state loaded (s)"] = t[("loaded", 1)] - t[("kill", 0)]
    result["floor: start → built, plus the state's copy (s)"] = f[("built", 0)] - f[("start", 0)] + copy
    phases = ["start", "imported", "group", "built", "ready", "read", "loaded"]
    at = t[("kill", 0)]
    for p in phases:
        result[f"phase: {p} (s)"] = t[(p, 1)] - at
        at = t[(p, 1)]
    result[COPY] = copy
    result["the state read: copied by"] = next(
        (l.split(" ", 1)[1] for l in killed.splitlines() if l.startswith("copied-by ")), "not reported")
    return result


def render_torchrun(r: Dict[str, Any]) -> str:
    restart, floor = r["kill → state loaded (s)"], r["floor: start → built, plus the state's copy (s)"]
    lines = [f"examples/torchrun/train.py ({r['model']}), a worker killed after its step-10 save and "
             f"restarted by torchrun: resumed bit-exact: {'yes' if r['bit-exact'] else 'NO'}", "",
             "| what | seconds | ratio | target |", "|---|---|---|---|",
             f"| kill → state loaded from the sidecar's memory | {restart:.3f} | {restart / floor:.2f}× the floor | ≤ 1.5× |",
             f"| floor: start, import torch, group, build, copy of the state | {floor:.3f} | | |"]
    read, copy = r["phase: read (s)"], r[COPY]
    lines.append(f"| the state read into the model's and optimizer's tensors | {read:.3f} | "
                 f"{copy / read:.2f}× the copy's speed | ≥ 0.8× |")
    lines.append(f"| … copied by | {r.get('the state read: copied by', 'not reported')} | | sidecar |")
    if "the state read: the sidecar's copies, by phase" in r:
        lines.append(uploads_row(r["the state read: the sidecar's copies, by phase"]))
    lines += ["", "phases after the kill (s): " + ", ".join(
        f"{k[len('phase: '):-len(' (s)')]} {v:.3f}" for k, v in r.items() if k.startswith("phase: "))]
    return "\n".join(lines)


# The --train-loop model and schedule. On the GPU: 3 × Linear 8192×8192 (0.75 GiB of fp32
# parameters, 2.25 GiB of state with AdamW's) on batches of 98304 rows, steps of about 0.2 s on
# an H200, a checkpoint after every 10th: about 2 s of training after each save, the time its
# background work (hashing, writing 2.25 GiB to a disk of about 1.5 GB/s) has before the next
# one, as a real loop leaves it (minutes, usually); a large batch, not a short interval, keeps
# the run within its time. About 80 s in all. On CPU: tiny, for the self-test.
TRAIN_LOOP = {"cuda": dict(width=8192, depth=3, batch=98304, steps=40, every=10),
              "cpu": dict(width=256, depth=2, batch=64, steps=12, every=5)}


def flat_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> Dict[str, torch.Tensor]:
    """Every tensor of the model's and the optimizer's state dicts (views of the live state, not
    copies), by dotted path: one flat dict that every variant saves, so each moves the same bytes
    (the optimizer's few hyperparameters, not tensors, are left out)."""
    out: Dict[str, torch.Tensor] = {}

    def walk(tree: Any, path: str) -> None:
        if isinstance(tree, torch.Tensor):
            out[path] = tree.detach()
        elif isinstance(tree, (dict, list, tuple)):
            for k, v in (tree.items() if isinstance(tree, dict) else enumerate(tree)):
                walk(v, f"{path}.{k}")

    walk(model.state_dict(), "model")
    walk(opt.state_dict(), "optim")
    return out


class Saver:
    """One way to checkpoint in the loop: `save` after a step's optimizer step, `ready` before the
    next optimizer step changes the state, `drain` (untimed) waits for everything in flight.
    `untimed` counts seconds spent inside them on the check's own work, not the checkpoint's."""

    warmups = 1
    untimed = 0.0

    def save(self, step: int, st: Dict[str, torch.Tensor]) -> None: ...
    def ready(self) -> None: ...
    def drain(self) -> None: ...
    def close(self) -> None: ...


class RawSaver(Saver):
    """The floor: the state copied into pinned host buffers allocated once, ahead."""

    def __init__(self, st: Dict[str, torch.Tensor], device: str) -> None:
        self.device = device
        self.host = {k: torch.empty(v.shape, dtype=v.dtype, pin_memory=device == "cuda") for k, v in st.items()}

    def save(self, step: int, st: Dict[str, torch.Tensor]) -> None:
        for k, v in st.items():
            self.host[k].copy_(v, non_blocking=True)
        sync(self.device)


class HotstartSaver(Saver):
    """`Checkpointer.save()` after the step, `wait_staged()` before the next optimizer step. The
    state of the last checkpoint is copied aside (untimed) to check the saved bytes."""

    warmups = 2  # both staging buffers (max_inflight=2) allocated and registered before the loop

    def __init__(self, ck: "hotstart.Checkpointer", last: int) -> None:
        self.ck, self.last, self.step, self.kept = ck, last, -1, {}

    def save(self, step: int, st: Dict[str, torch.Tensor]) -> None:
        self.handle, self.step, self.st = self.ck.save(step, st), step, st

    def ready(self) -> None:
        self.handle.wait_staged()
        if self.step == self.last:
            t = time.perf_counter()
            self.kept = {k: v.to("cpu", copy=True) for k, v in self.st.items()}
            self.untimed += time.perf_counter() - t

    def drain(self) -> None:
        self.ck.wait()

    def exact(self) -> bool:
        return same(self.kept, self.ck.load(step=self.last))

    def close(self) -> None:
        self.ck.close()


class DCPSaver(Saver):
    """`dcp.async_save` (optionally through `stager`), one save in flight as in a real loop: the
    next save first waits for the previous upload. With asynchronous staging the next optimizer
    step waits for the staging, like hotstart's `wait_staged()`."""

    def __init__(self, tmp: Path, name: str, stager: Optional[Callable[[], Any]] = None) -> None:
        import torch.distributed.checkpoint as dcp

        self.dcp, self.tmp, self.name, self.make_stager = dcp, tmp, name, stager
        self.stager = stager() if stager else None
        self.upload: Any = None
        self.staged: Any = None

    def save(self, step: int, st: Dict[str, torch.Tensor]) -> None:
        self.finish_upload()
        self.where = self.tmp / f"{self.name}-{step}"
        if self.stager is not None and self.make_stager is not None and stager_spent(self.stager):
            self.stager.close()
            self.stager = self.make_stager()
        kw = {} if self.stager is None else {"async_stager": self.stager}
        r = self.dcp.async_save(st, checkpoint_id=str(self.where), **kw)
        # With asynchronous staging, torch returns both futures (AsyncSaveResponse).
        self.upload, self.staged = getattr(r, "upload_completion", r), getattr(r, "staging_completion", None)

    def ready(self) -> None:
        if self.staged is not None:
            self.staged.result()
            self.staged = None

    def finish_upload(self) -> None:
        if self.upload is not None:
            self.upload.result()
            self.upload = None
            t = time.perf_counter()
            shutil.rmtree(self.where)  # the disk is not that large; not DCP's cost
            self.untimed += time.perf_counter() - t

    def drain(self) -> None:
        self.ready()
        self.finish_upload()

    def close(self) -> None:
        if self.stager is not None:
            self.stager.close()


def pinned_stager(device: str) -> Callable[[], Any]:
    """DCP's pinned-memory staging as torchtitan sets it up (torch 2.9+: an older one raises
    ImportError here), made once and kept across saves. Pinned memory and non-blocking copies
    need CUDA: on CPU, only async."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    cuda = device == "cuda"
    return lambda: DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                                use_async_staging=True, use_non_blocking_copy=cuda))


def stager_spent(stager: Any) -> bool:
    """Whether a DefaultStager closed itself after its last stage, as some torch versions do (2.11
    to at least 2.13: its cached pinned memory freed and its copier table cleared, so a second
    save fails with KeyError: <class 'type'>). Such a stager serves one save: the loop makes a
    new one, which pins its memory again, as a user of that torch gets."""
    inner = getattr(stager, "_state_dict_stager", None)
    table = getattr(inner, "_deepcopy_dispatch", None)
    return table is not None and not table


def train_loop(tmp: Path, device: str, binary: Any, write: Callable[[Dict[str, Any]], None]) -> Dict[str, Any]:
    """A training loop checkpointing every `every` steps, each way in turn on the same model, against
    the same loop without checkpoints; see render_train_loop."""
    c = TRAIN_LOOP[device]
    cuda, steps, every = device == "cuda", c["steps"], c["every"]
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    torch.manual_seed(0)
    layers: List[torch.nn.Module] = []
    for _ in range(c["depth"]):
        layers += [torch.nn.Linear(c["width"], c["width"], device=device), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batches = [(torch.randn(c["batch"], c["width"], device=device), torch.randn(c["batch"], c["width"], device=device))
               for _ in range(2)]

    def step(s: int) -> None:
        x, y = batches[s % 2]
        with torch.autocast(device, dtype=torch.bfloat16, enabled=cuda):
            out = model(x)
        torch.nn.functional.mse_loss(out.float(), y).backward()

    def update() -> None:
        opt.step()
        opt.zero_grad(set_to_none=True)

    def run(saver: Any = None) -> Dict[str, Any]:
        """Wall seconds of `steps` steps, and the seconds each checkpoint blocked the training
        thread (its save, and the wait before the next optimizer step)."""
        blocked: List[float] = []
        pending = False

        def held(fn: Callable[[], None]) -> float:
            u, t = saver.untimed, time.perf_counter()
            fn()
            return time.perf_counter() - t - (saver.untimed - u)

        u0 = saver.untimed if saver else 0.0
        sync(device)
        t0 = time.perf_counter()
        for s in range(1, steps + 1):
            step(s)
            if pending:
                blocked[-1] += held(saver.ready)
                pending = False
            update()
            if saver and s % every == 0 and s < steps:  # each save followed by `every` steps
                sync(device)  # what blocks is the checkpoint, not the step queued before it
                blocked.append(held(lambda: saver.save(s, flat_state(model, opt))))
                pending = True
        sync(device)
        wall = time.perf_counter() - t0 - ((saver.untimed - u0) if saver else 0.0)
        return {"wall (s)": wall, "blocked (s)": blocked}

    for s in range(3):  # kernels chosen, memory allocated, AdamW's state created
        step(s)
        update()
    st = flat_state(model, opt)
    last = (steps - 1) // every * every
    result: Dict[str, Any] = {
        "device": torch.cuda.get_device_name(0) if cuda else "cpu (self-test)", "torch": torch.__version__,
        "model": f"{c['depth']} × Linear {c['width']}×{c['width']}, AdamW, batch {c['batch']}",
        "state (GiB)": sum(v.numel() * v.element_size() for v in st.values()) / (1 << 30),
        "steps": steps, "every": every, "checkpoints": last // every, "baseline (s)": [],
        "rows": {}, "bit-exact": {}, "not measured": {},
    }
    result["baseline (s)"].append(run()["wall (s)"])
    raw = RawSaver(st, device)

    def raw_alone() -> float:
        sync(device)
        t = time.perf_counter()
        raw.save(0, st)
        return time.perf_counter() - t

    raw_alone()
    result["raw D2H alone (s)"] = median_of(3, raw_alone)

    def variant(name: str, make: Callable[[], Any], optional: bool = False) -> None:
        saver = None
        try:
            saver = make()
            for i in range(saver.warmups):
                saver.save(i, flat_state(model, opt))
                saver.ready()
            saver.drain()
            row = run(saver)
            t = time.perf_counter()
            saver.drain()
            row["left after the loop (s)"] = time.perf_counter() - t
            if isinstance(saver, HotstartSaver):
                result["bit-exact"][name] = saver.exact()
        except Exception as e:  # a peer's API this torch lacks: recorded, not fatal
            if not optional:
                raise
            row = {"wall (s)": float("nan"), "blocked (s)": [float("nan")]}
            result["not measured"][name] = f"{type(e).__name__}: {e}"
            print(f"{name}: not measured: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        finally:
            if saver is not None:
                saver.close()
        result["rows"][name] = row
        write(result)
        print(f"{name}: {row}", flush=True)

    variant("raw D2H copy into pinned memory, in the loop", lambda: raw)
    del raw
    variant("hotstart Checkpointer, local disk tier", lambda: HotstartSaver(
        hotstart.Checkpointer(local_dir=tmp / "hotstart", job="train-loop", keep=2, rank=0, world_size=1), last))
    if binary:
        with serve(tmp / "sidecar", binary, 3 * result["state (GiB)"]) as sc:
            variant("hotstart through the sidecar", lambda: HotstartSaver(
                hotstart.Checkpointer(sidecar=sc.sock, job="train-loop", rank=0, world_size=1), last))
            # Part of what the sidecar's row costs the loop: each step pinned on its own thread.
            result["sidecar: pinning each step for the GPU, in the background"] = sc.pins()
    variant("DCP async_save", lambda: DCPSaver(tmp, "dcp"), optional=True)
    variant("DCP async_save, pinned-memory staging", lambda: DCPSaver(tmp, "dcp-pinned", pinned_stager(device)),
            optional=True)
    result["baseline (s)"].append(run()["wall (s)"])  # again: the spread is the figures' noise
    write(result)
    return result


def render_train_loop(r: Dict[str, Any]) -> str:
    base = statistics.mean(r["baseline (s)"]) if r["baseline (s)"] else float("nan")
    raw, n = r["raw D2H alone (s)"], r["checkpoints"]
    exact = all(r["bit-exact"].values()) if r["bit-exact"] else None
    lines = [f"A training loop ({r['model']}, bf16 autocast on the GPU; {r['state (GiB)']:.2f} GiB of state), "
             f"{r['steps']} steps with a checkpoint after every {r['every']}th ({n} checkpoints), against the "
             f"same steps without ({' and '.join(f'{b:.3f}' for b in r['baseline (s)'])} s): the training "
             f"time each checkpoint costs. hotstart's last checkpoint loaded back bit-exact: "
             f"{'not checked' if exact is None else 'yes' if exact else 'NO'}", "",
             "| what | seconds lost per checkpoint | median blocking (s) | × raw D2H | target |",
             "|---|---|---|---|---|",
             f"| raw D2H copy of the state into pinned memory, alone | {raw:.3f} | | 1.00× | |"]
    for name, row in r["rows"].items():
        lost = (row["wall (s)"] - base) / n
        target = "≤ 1.2×" if name.startswith("hotstart") else ""
        lines.append(f"| {name} | {lost:.3f} | {statistics.median(row['blocked (s)']):.3f} | "
                     f"{lost / raw:.2f}× | {target} |")
    lines.append(pins_row(r.get("sidecar: pinning each step for the GPU, in the background")))
    if r["not measured"]:
        lines += [""] + [f"{k}: not measured: {v}" for k, v in r["not measured"].items()]
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--gib", type=float, nargs="+", default=[4.0, 16.0])
    p.add_argument("--runs", type=int, default=3, help="runs per figure (at most 2 above 8 GiB)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--hotstart", type=Path, help="the hotstart binary: adds the rows through `hotstart serve`")
    p.add_argument("--torchrun", type=Path, metavar="TRAIN_PY",
                   help="instead, the torchrun check of examples/torchrun/train.py (needs --hotstart)")
    p.add_argument("--train-loop", action="store_true",
                   help="instead, what checkpoints cost a training loop (the sidecar's row with --hotstart)")
    args = p.parse_args()
    # `timeout` stops a part with SIGTERM: leave through the `finally` blocks, so a sidecar is
    # stopped, its log shown, and the temporary files removed.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(124))
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device here (torch.cuda.is_available() is False): nothing to check")
        return 0
    args.out.mkdir(parents=True, exist_ok=True)
    if args.torchrun:
        if not args.hotstart:
            p.error("--torchrun needs --hotstart")
        with tempfile.TemporaryDirectory(dir=os.environ.get("GPU_CHECK_TMP")) as d:
            r = torchrun_check(Path(d), args.hotstart, args.torchrun, args.device)
        (args.out / "torchrun.json").write_text(json.dumps(r, indent=2))
        (args.out / "torchrun.md").write_text(render_torchrun(r) + "\n")
        print(render_torchrun(r))
        return 0 if r["bit-exact"] else 1
    if args.train_loop:
        def write_loop(r: Dict[str, Any]) -> None:
            # After every variant, so a run stopped at its time limit still leaves what it measured.
            (args.out / "train_loop.json").write_text(json.dumps(r, indent=2))
            (args.out / "train_loop.md").write_text(render_train_loop(r) + "\n")

        with tempfile.TemporaryDirectory(dir=os.environ.get("GPU_CHECK_TMP")) as d:
            r = train_loop(Path(d), args.device, args.hotstart, write_loop)
        print(render_train_loop(r))
        return 0 if all(r["bit-exact"].values()) else 1
    result: Dict[str, Any] = {
        "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu (self-test)",
        "torch": torch.__version__,
        "sizes": {},
    }

    def write() -> None:
        # After every part, so a run stopped at its time limit still leaves what it measured.
        (args.out / "python.json").write_text(json.dumps(result, indent=2))
        (args.out / "python.md").write_text(render(result) + "\n")

    with tempfile.TemporaryDirectory(dir=os.environ.get("GPU_CHECK_TMP")) as d:
        tmp = Path(d)
        result["checks"] = checks(tmp, args.device)
        write()
        print(f"checks: {result['checks']}", flush=True)
        # The figures the sidecar's targets are about first, for every size; then the disk tier's
        # and DCP's rows at the first size only (they take minutes at 16 GiB, where earlier runs
        # measured them; the Rust stall part measures the engine's save there), and the floors.
        for g in args.gib:
            rows = Rows(g)
            rows["runs"] = min(args.runs, 2) if g > 8 else args.runs
            result["sizes"][str(g)] = rows
            src = state(g, args.device)
            if g == args.gib[0]:
                first = src  # kept for the disk and DCP rows
            raw_rows(rows, src, rows["runs"], args.device)
            write()
            if args.hotstart:
                # The route before the sidecar pinned, beside it, at the first size only (time).
                sidecar_rows(rows, tmp, src, rows["runs"], args.device, args.hotstart, compare=src is first)
                write()
            del src
        rows = result["sizes"][str(args.gib[0])]
        disk_rows(rows, tmp, first, rows["runs"], args.device)
        write()
        dcp_rows(rows, tmp, first, rows["runs"], args.device)
        write()
        del first
        if args.hotstart:
            for rows in result["sizes"].values():
                floor_rows(rows, rows["runs"], args.device)
                write()
    print(render(result))
    return 0 if all(result["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
