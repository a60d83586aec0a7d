"""The Python package against what a PyTorch user would use instead, same tensors, same run.

    (cd bindings && maturin develop --release)      # an optimised extension into .venv
    .venv/bin/python benches/python/bench_py.py --gib 2 --runs 3 --dir /var/tmp

Measures, on ``--gib`` GiB of random torch CPU tensors in ``--tensors`` tensors:

* **Stall**: ``Checkpointer.save()`` + ``wait_staged()`` (the only wait a training loop has)
  against the floor, ``Tensor.copy_`` of the same tensors into preallocated buffers (target:
  at most 1.3x its time), and against the blocking part of ``torch.save``,
  ``safetensors.torch.save_file`` (target: 3x shorter) and ``dcp.async_save`` with
  ``FileSystemWriter(thread_count=4)`` (target: shorter).
* **Durable**: save until the bytes are on the local disk (hotstart's disk tier, with
  ``wait_persisted("disk")``) against ``torch.save`` + fsync, ``save_file`` + fsync, and
  ``dcp.save`` with ``FileSystemWriter(thread_count=4)`` (fsyncs its files).
* **Cold load** (page cache dropped before each load when running as root; every loader's
  tensors then have one byte per page read, so a loader that maps the file lazily pays for
  reading it too): hotstart, verifying every byte, into new tensors against ``torch.load`` and
  ``safetensors.torch.load_file``, and in place against ``load_file`` and ``dcp.load`` with
  ``FileSystemReader``; both against the disk's floor, fio reading the same bytes sequentially
  (the fastest of buffered, ``O_DIRECT``, and ``O_DIRECT`` into huge pages as hotstart's reads
  are, checking nothing; target 0.9x its speed). New
  tensors (of 1 MiB and more; smaller ones are copied out) are views of a private mapping of
  the file, as ``load_file``'s are, so they are also
  compared with the floor of that way of reading: the file mapped and read in with
  ``MADV_POPULATE_READ``, 64 MiB at a time on as many threads as hotstart's load workers,
  nothing checked. A restart loads once, in a new process: new tensors
  are also loaded that way, each loader in a Python process of its own (imports untimed).
  hotstart's checkpoint is a safetensors file, so fio and the mapped read read that same file,
  right beside hotstart's loads and in turn before and after them.

Each figure is the median of ``--runs`` runs, after one warm-up save that allocates hotstart's
staging buffer; ratios are hotstart's throughput over the peer's (higher is better).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file

import hotstart

MiB = 1 << 20
TITLE = "hotstart Python package against torch, safetensors and torch.distributed.checkpoint"


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


# fio's O_DIRECT reads: 16 requests of 8 MiB in flight.
FIO_DEPTH, FIO_BLOCK = 16, 8 << 20


def fio_read(path: Path, direct: bool, huge: bool = False) -> float:
    """Seconds for fio to read `path` once, sequentially, in 8 MiB blocks (the caller drops the
    page cache first): buffered (one thread, as a plain read loop) or O_DIRECT (16 in flight),
    into huge pages with `huge` (``--mem=shmhuge``, which needs `huge_pages` reserved)."""
    cmd = ["fio", "--name=floor", f"--filename={path}", "--readonly", "--rw=read", "--bs=8M",
           f"--direct={int(direct)}", "--output-format=json"]
    cmd += ["--ioengine=libaio", f"--iodepth={FIO_DEPTH}"] if direct else ["--ioengine=psync"]
    if huge:
        cmd.append("--mem=shmhuge")
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    read = json.loads(out)["jobs"][0]["read"]
    return read["io_bytes"] / read["bw_bytes"]


@contextlib.contextmanager
def huge_pages(n: int) -> Iterator[bool]:
    """Reserves at least `n` 2 MiB huge pages (needs root) and gives the old count back after;
    yields whether they are there."""
    knob = Path("/proc/sys/vm/nr_hugepages")
    try:
        old = int(knob.read_text())
        if old < n:
            knob.write_text(f"{n}\n")
        ok = int(knob.read_text()) >= n
    except OSError:
        yield False
        return
    try:
        yield ok
    finally:
        knob.write_text(f"{old}\n")


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return libc


def _populate(n: int, advice: int, prot: int, flags: int, fd: int = -1, threads: int = 1) -> float:
    """Seconds for ``madvise(advice)`` (``MADV_POPULATE_READ`` or ``_WRITE``, Linux 5.14) over a
    new mapping of `n` bytes (``mmap(prot, flags, fd)``), unmapped after: one call, or with
    `threads` > 1 one per 64 MiB piece, that many at once."""
    libc = _libc()
    addr = libc.mmap(None, n, prot, flags, fd, 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "mmap")
    piece = n if threads == 1 else 64 << 20

    def advise(at: int) -> None:
        if libc.madvise(addr + at, min(piece, n - at), advice) != 0:
            raise OSError(ctypes.get_errno(), f"madvise({advice})")

    try:
        t = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(advise, range(0, n, piece)))
        return time.perf_counter() - t
    finally:
        libc.munmap(addr, n)


def first_touch(nbytes: int) -> float:
    """Seconds to fault in ``nbytes`` of never-touched memory (``MADV_POPULATE_WRITE``, one
    thread): what any load into new tensors pays on top of reading, and fio, which reuses one
    buffer, does not. The kernel zeroes and maps every page."""
    return _populate(nbytes, 23, mmap.PROT_READ | mmap.PROT_WRITE,
                     mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def touch(state: object) -> None:
    """Reads one byte of every page of every tensor in ``state``, in the order of their
    addresses. A loader may hand back tensors whose pages are read from the file only when first
    touched (``safetensors`` maps the file, and its tensors are then in file order by address,
    whatever order its dict has); a load is finished when the bytes are in memory, so every
    loader's result is touched, at the same small cost for those that already read everything."""
    tensors = state.values() if isinstance(state, dict) else []
    tensors = sorted((t for t in tensors if isinstance(t, torch.Tensor)), key=lambda t: t.data_ptr())
    for t in tensors:
        if t.numel() > 0:
            int(t.view(-1).view(torch.uint8)[::4096].sum())


def timed(f: Callable[[], object]) -> float:
    t = time.perf_counter()
    f()
    return time.perf_counter() - t


# hotstart's load workers for new tensors mapped from the file: four per thread, one thread
# per core up to 8.
LOAD_WORKERS = 4 * min(8, os.cpu_count() or 1)


def map_read(path: Path) -> float:
    """Seconds to read `path` through a private mapping (the caller drops the page cache first):
    ``MADV_POPULATE_READ`` 64 MiB at a time on as many threads as hotstart's load has workers,
    which the kernel fills with read-ahead, and nothing checked or copied. The floor of a load
    that hands out views of the mapped file, as hotstart's new tensors and ``load_file``'s are."""
    with open(path, "rb") as f:
        return _populate(path.stat().st_size, 22, mmap.PROT_READ, mmap.MAP_PRIVATE, f.fileno(),
                         threads=LOAD_WORKERS)


# One load in a process of its own, as a restart makes it: the page cache dropped and memory
# fresh as before every load (`Bench.cold_load`), the imports and the Checkpointer untimed.
_NEW_PROCESS = """
import sys, time
sys.path.insert(0, sys.argv[1])
import bench_py
kind, where, step, nbytes = sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
if kind == "hotstart":
    ck = bench_py.hotstart.Checkpointer(local_dir=where, job="bench")
    load = lambda: ck.load(step=step)
else:
    load = lambda: bench_py.load_file(where)
bench_py.drop_caches()
bench_py.first_touch(nbytes)
print(bench_py.timed(lambda: bench_py.touch(load())))
"""


def load_in_new_process(kind: str, where: Path, step: int, nbytes: int) -> float:
    """Seconds for one cold load into new tensors in a new Python process: `kind` "hotstart"
    (step `step` of the Checkpointer at `where`) or "load_file" (the file `where`)."""
    here = str(Path(__file__).resolve().parent)
    cmd = [sys.executable, "-c", _NEW_PROCESS, here, kind, str(where), str(step), str(nbytes)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return float(out.split()[-1])


# (what, hotstart's timing, the peer's timing, target ratio): the table's rows.
ROWS: List[Tuple[str, str, str, Optional[str]]] = [
    ("stall save→wait_staged", "hotstart stall", "copy_", "≥ 0.77"),  # ≤ 1.3x the time
    ("stall save→wait_staged", "hotstart stall", "torch.save stall", "≥ 3"),
    ("stall save→wait_staged", "hotstart stall", "save_file stall", "≥ 3"),
    ("stall save→wait_staged", "hotstart stall", "dcp.async_save stall", "≥ 1"),
    ("durable on local disk", "hotstart durable", "torch.save durable", "≥ 1"),
    ("durable on local disk", "hotstart durable", "save_file durable", "≥ 1"),
    ("durable on local disk", "hotstart durable", "dcp.save durable", "≥ 1"),
    ("cold load, new tensors", "hotstart load new", "torch.load", "≥ 1"),
    ("cold load, new tensors", "hotstart load new", "load_file", "≥ 1"),
    ("cold load, new tensors", "hotstart load new", "read floor", "≥ 0.9"),
    ("cold load, new tensors", "hotstart load new", "map floor", "≥ 0.9"),
    ("cold load, new tensors, each in a new process", "hotstart new process", "load_file new process", "≥ 1"),
    ("cold load, in place", "hotstart load in place", "load_file", "≥ 1"),
    ("cold load, in place", "hotstart load in place", "dcp.load in place", "≥ 1"),
    ("cold load, in place", "hotstart load in place", "read floor", "≥ 0.9"),
]
# The peers' names in the table.
PEERS = {
    "copy_": "Tensor.copy_ into preallocated tensors",
    "torch.save stall": "torch.save",
    "save_file stall": "safetensors.torch.save_file",
    "dcp.async_save stall": "dcp.async_save (FileSystemWriter, 4 threads), blocking part",
    "torch.save durable": "torch.save + fsync",
    "save_file durable": "safetensors.torch.save_file + fsync",
    "dcp.save durable": "dcp.save (FileSystemWriter, 4 threads)",
    "torch.load": "torch.load",
    "load_file": "safetensors.torch.load_file",
    "dcp.load in place": "dcp.load (FileSystemReader), in place",
    "read floor": "fio sequential read of the file, the fastest of buffered, O_DIRECT and O_DIRECT into huge pages (no checks)",
    "map floor": "the file read through a private mapping, MADV_POPULATE_READ 64 MiB at a time on as many threads as hotstart's load workers (no checks)",
    "load_file new process": "safetensors.torch.load_file, in a new process",
}


def state_arguments(ap: argparse.ArgumentParser) -> None:
    """The state's size and the disk its files go to, as the Python benches take them."""
    ap.add_argument("--gib", type=float, default=2.0, help="state size in GiB (default 2)")
    ap.add_argument("--tensors", type=int, default=32, help="number of tensors (default 32)")
    ap.add_argument("--dir", default="/var/tmp", help="directory on the disk to measure")


def make_state(args: argparse.Namespace) -> Dict[str, torch.Tensor]:
    """``--gib`` GiB of random fp32 CPU tensors in ``--tensors`` tensors, the same every time."""
    per = int(args.gib * (1 << 30)) // args.tensors // 4
    gen = torch.Generator().manual_seed(0)
    return {f"layer.{i}.weight": torch.randn(per, generator=gen) for i in range(args.tensors)}


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.state = make_state(args)
        self.nbytes = sum(t.numel() * t.element_size() for t in self.state.values())
        self.work = Path(tempfile.mkdtemp(prefix="hotstart-bench-py-", dir=args.dir))
        self.times: Dict[str, List[float]] = {}
        self.cold = drop_caches()

    def record(self, key: str, seconds: float, quiet: bool = False) -> float:
        self.times.setdefault(key, []).append(seconds)
        if not quiet:
            print(f"  {key}: {seconds:.3f} s ({self.nbytes / MiB / seconds:.0f} MiB/s)", flush=True)
        return seconds

    def fresh(self, name: str) -> Path:
        p = self.work / name
        shutil.rmtree(p, ignore_errors=True)
        p.mkdir(parents=True)
        return p

    def settle(self) -> None:
        """Drops the page cache. Right after that, faulting in new memory is several times
        slower on a VM whose balloon hands freed memory back to the host (2 GiB: 2.5-4.4 s
        against 0.67 s), and it hits whichever loader runs first. Faulting in as much memory and
        freeing it again, untimed, gives every loader and floor the same start."""
        drop_caches()
        self.record("touch after drop", first_touch(self.nbytes), quiet=True)

    def cold_load(self, key: str, f: Callable[[], object]) -> None:
        self.settle()
        self.record(key, timed(lambda: touch(f())))

    def floors(self, path: Path) -> None:
        """The disk's floors for the bytes of `path`, each from the same start as a load: fio's
        fastest way of reading it ("read floor"; O_DIRECT into 4 KiB pages runs at half the
        speed of huge pages on some VMs, and hotstart reads into huge pages, so fio gets them
        too where they can be reserved) and the private mapping's ("map floor")."""
        reads = []
        for key, direct in (("fio buffered", False), ("fio O_DIRECT", True)):
            self.settle()
            reads.append(self.record(key, fio_read(path, direct=direct)))
        # fio's buffers and a page of slack, rounded up to 2 MiB pages, and a margin.
        with huge_pages((FIO_DEPTH * FIO_BLOCK + 4096 + (2 << 20) - 1) // (2 << 20) + 4) as huge:
            if huge:
                self.settle()
                reads.append(self.record("fio O_DIRECT huge", fio_read(path, direct=True, huge=True)))
        self.record("read floor", min(reads))
        self.settle()
        self.record("map floor", map_read(path))

    def run(self) -> None:
        a = self.args
        dst = {k: torch.empty_like(v) for k, v in self.state.items()}
        ck_dir = self.fresh("hotstart")
        ck = hotstart.Checkpointer(local_dir=ck_dir, job="bench", keep=1, max_inflight=1)
        ck.save(0, self.state).wait()  # warm-up: allocates and faults in the staging buffer

        def copy() -> None:
            for k, v in self.state.items():
                dst[k].copy_(v)

        copy()  # warm-up: faults in the preallocated buffers, as the staging buffer was
        for run in range(a.runs):
            print(f"run {run + 1}/{a.runs}", flush=True)
            # The last run's peers left gigabytes in the page cache to write back; a stall
            # measured while the kernel flushes them measures the flush (0.10 s alone, up to
            # 0.28 s with them, here).
            os.sync()
            # Floor: a copy of every tensor into preallocated buffers.
            self.record("copy_", timed(copy))

            step = run + 1
            t = time.perf_counter()
            h = ck.save(step, self.state)
            h.wait_staged()
            self.record("hotstart stall", time.perf_counter() - t)
            h.wait_persisted("disk")
            self.record("hotstart durable", time.perf_counter() - t)
            ck.wait()

            def load_new() -> None:
                new: Dict[str, torch.Tensor] = {}
                self.cold_load("hotstart load new", lambda: new.update(ck.load(step=step)) or new)
                assert all(torch.equal(new[k], v) for k, v in self.state.items())

            # hotstart's file is a safetensors file: the disk's floors read that same file,
            # beside hotstart's loads, in turn after and before them (ABBA over the runs), since
            # on this VM a read's speed swings with what ran just before it.
            file = ck_dir / "bench" / f"step-{step}" / "rank-0.safetensors"
            parts = [
                load_new,
                lambda: self.cold_load("hotstart load in place", lambda: ck.load(dst, step=step)),
                lambda: self.floors(file),
            ]
            for part in parts if run % 2 == 0 else parts[::-1]:
                part()

            p = self.fresh("torch") / "state.pt"
            self.record("torch.save stall", timed(lambda: torch.save(self.state, p)))
            fsync_path(p)
            p.unlink()
            self.record("torch.save durable", timed(lambda: (torch.save(self.state, p), fsync_path(p))))
            self.cold_load("torch.load", lambda: torch.load(p))

            p = self.fresh("safetensors") / "state.safetensors"
            self.record("save_file stall", timed(lambda: save_file(self.state, str(p))))
            fsync_path(p)
            p.unlink()
            self.record("save_file durable", timed(lambda: (save_file(self.state, str(p)), fsync_path(p))))
            self.cold_load("load_file", lambda: load_file(str(p)))
            # One load per new process, as a restart makes it, two each in the order ABBA: on
            # this VM a load's time swings with what the one before left behind in memory (1.1
            # to 2.9 s for the same load_file), so neither loader always goes first.
            pair = [("hotstart", ck_dir, step), ("load_file", p, 0)]
            for kind, where, at in pair + pair[::-1]:
                self.record(f"{kind} new process", load_in_new_process(kind, where, at, self.nbytes))

            d = self.fresh("dcp")
            writer = lambda path: dcp.FileSystemWriter(str(path), thread_count=4)  # noqa: E731
            fut: List[object] = []
            self.record("dcp.async_save stall", timed(lambda: fut.append(
                dcp.async_save(self.state, storage_writer=writer(d / "async")))))
            fut[0].result()  # type: ignore[attr-defined]
            self.record("dcp.save durable", timed(lambda: dcp.save(self.state, storage_writer=writer(d / "sync"))))
            self.cold_load("dcp.load in place", lambda: dcp.load(
                dst, storage_reader=dcp.FileSystemReader(str(d / "sync"))) or dst)
            shutil.rmtree(self.work / "dcp", ignore_errors=True)
        ck.close()
        shutil.rmtree(self.work, ignore_errors=True)

    def median(self, key: str) -> float:
        return statistics.median(self.times[key])

    def rows(self) -> List[Dict[str, object]]:
        """Every comparison as hotstart-benches reports them (benches/src/report.rs): throughput
        figures in bytes per second, so `hotstart-benches all` charts them with the rest."""
        size = f"{self.nbytes / (1 << 30):.2f} GiB in {self.args.tensors} tensors"
        out: List[Dict[str, object]] = []
        for what, ours, theirs, target in ROWS:
            out.append({
                "what": f"{what}, {size}",
                "ours": {"rate": self.nbytes / self.median(ours)},
                "peer": PEERS[theirs],
                "theirs": {"rate": self.nbytes / self.median(theirs)},
                "target": None if target is None else float(target.split()[-1]),
            })
        return out

    def notes(self) -> List[str]:
        cache = "page cache dropped before each load" if self.cold else "page cache NOT dropped (not root)"
        return [f"Medians of {self.args.runs} runs; {cache}; torch {torch.__version__}, "
                f"hotstart {hotstart.__version__}, files in {self.args.dir}.",
                "New tensors of 1 MiB and more from the disk tier are views of a private mapping "
                "of the file, verified where they lie (smaller ones are copied out), as load_file's "
                "are views of a mapping (unverified); the map floor reads the file that way with "
                "nothing checked.",
                "The read floor is fio's fastest way of reading the file here: medians " + ", ".join(
                    f"{k[4:]} {self.nbytes / MiB / self.median(k):.0f} MiB/s"
                    for k in ("fio buffered", "fio O_DIRECT", "fio O_DIRECT huge") if k in self.times)
                + (" (no huge pages could be reserved for fio)" if "fio O_DIRECT huge" not in self.times else "")
                + ".",
                f"Before each load, right after the page cache was dropped, as much new memory was "
                f"faulted in and freed, untimed, so that every loader starts alike: that took "
                f"{min(self.times['touch after drop']):.2f}-{max(self.times['touch after drop']):.2f} s "
                f"(on a VM that hands freed memory back to its host, the first loader after a drop "
                f"otherwise pays it)."]

    def table(self) -> str:
        size = f"{self.nbytes / (1 << 30):.2f} GiB in {self.args.tensors} tensors"
        out = [
            "| measurement | hotstart | peer | peer's | ratio | target |",
            "|---|---:|---|---:|---:|---:|",
        ]
        for what, ours, theirs, target in ROWS:
            o, t = self.median(ours), self.median(theirs)
            ratio = t / o
            ok = ""
            if target:
                ok = " ✓" if ratio >= float(target.split()[-1]) else " ✗"
            out.append(
                f"| {what}, {size} | {self.nbytes / MiB / o:.0f} MiB/s | {PEERS[theirs]} | "
                f"{self.nbytes / MiB / t:.0f} MiB/s | {ratio:.2f}× | {target or '-'}{ok} |"
            )
        out.append("")
        out.extend(f"- {n}" for n in self.notes())
        return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    state_arguments(ap)
    ap.add_argument("--runs", type=int, default=3, help="repetitions; medians are reported")
    ap.add_argument("--markdown", help="also write the table to this file, and its rows as JSON "
                    "beside it (same name, .json)")
    args = ap.parse_args()
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    b = Bench(args)
    try:
        b.run()
    finally:
        # Gigabytes of checkpoints: gone even when a peer or fio fails part-way.
        shutil.rmtree(b.work, ignore_errors=True)
    table = b.table()
    print(table)
    if args.markdown:
        md = Path(args.markdown)
        md.write_text(f"### {TITLE}\n\n{table}\n")
        report = {"title": TITLE, "rows": b.rows(), "notes": b.notes()}
        md.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
