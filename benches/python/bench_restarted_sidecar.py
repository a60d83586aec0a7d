"""New tensors on a restarted node: ``Checkpointer.load()`` through a sidecar started fresh over
the disk that holds the step (its memory empty), which hands the step's file over.

    (cd bindings && maturin develop --release) && cargo build --release --bin hotstart
    .venv/bin/python benches/python/bench_restarted_sidecar.py --gib 2 --runs 4 --dir /var/tmp

Compares, on ``--gib`` GiB of random torch CPU tensors in ``--tensors`` tensors, in one process:

* **mapped**: what ``load()`` does, the handed file mapped privately and verified where it lies;
* **new memory**: the same load with the mapping refused, so the file is read with ``O_DIRECT``
  into new ``torch.empty`` memory (what ``load()`` did before the plan was handed the file).

Each load goes through a new sidecar, the page cache dropped first (root), the two ways in turn
(ABBA). Three memory states, since this VM hands freed memory back to its host and new memory then
costs far more, and what kind of memory was freed last decides which way is faster: as much
memory faulted in and freed right before (as ``bench_py.py`` does before every load), in 4 KiB
pages or in huge pages, or 3 s idle after the cache drop. Prints medians in seconds.
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Callable, Dict, List

import hotstart
from hotstart import _mapped

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_py  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


def free_ports(n: int) -> List[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


class Sidecar:
    """`hotstart serve` (the release build) on loopback over `work/disk`, no peers, no store."""

    def __init__(self, work: Path) -> None:
        peer, http = free_ports(2)
        self.socket = work / "sidecar.sock"
        self.url = f"http://127.0.0.1:{http}"
        exe = os.environ.get("HOTSTART_BIN") or str(ROOT / "target" / "release" / "hotstart")
        with open(work / "sidecar.log", "ab") as log:
            self.proc = subprocess.Popen(
                [exe, "serve", "--insecure", "--node-id", "bench-0", "--listen", f"127.0.0.1:{peer}",
                 "--http", f"127.0.0.1:{http}", "--socket", str(self.socket),
                 "--disk-dir", str(work / "disk"), "--memory-budget", "8GiB"],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(self.url + "/readyz", timeout=1):
                    return
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise SystemExit(f"the sidecar did not start: see {work / 'sidecar.log'}")
                time.sleep(0.05)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait()


def huge_pages_freed(nbytes: int) -> None:
    """Faults in `nbytes` of new memory in huge pages (``MADV_HUGEPAGE``), and frees it."""
    m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        m.madvise(mmap.MADV_HUGEPAGE)
        m.madvise(23)  # MADV_POPULATE_WRITE
    finally:
        m.close()


# What ran just before each load, after the page cache was dropped.
STATES: Dict[str, Callable[[int], object]] = {
    "as much memory faulted in (4 KiB pages) and freed": bench_py.first_touch,
    "as much memory faulted in as huge pages and freed": huge_pages_freed,
    "3 s idle": lambda _: time.sleep(3),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    bench_py.state_arguments(ap)
    ap.add_argument("--runs", type=int, default=4, help="loads of each way in each state")
    args = ap.parse_args()
    state = bench_py.make_state(args)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    work = Path(tempfile.mkdtemp(prefix="hotstart-bench-restarted-", dir=args.dir))
    mapping = _mapped.map_private
    times: Dict[str, List[float]] = {}
    try:
        sidecar = Sidecar(work)
        with hotstart.Checkpointer(sidecar=sidecar.socket, job="bench") as ck:
            ck.save(1, state).wait()
        sidecar.stop()
        del state
        ways = ["mapped", "new memory"]
        for memory in STATES:
            for run in range(args.runs):
                for way in ways if run % 2 == 0 else ways[::-1]:
                    _mapped.map_private = mapping if way == "mapped" else (lambda fd, n: None)
                    sidecar = Sidecar(work)
                    try:
                        bench_py.drop_caches()
                        STATES[memory](nbytes)
                        ck = hotstart.Checkpointer(sidecar=sidecar.socket, job="bench")
                        t = time.perf_counter()
                        out = ck.load(step=1)
                        bench_py.touch(out)
                        seconds = time.perf_counter() - t
                        assert set(ck.loaded_from) == {"disk"}, ck.loaded_from
                        del out, ck
                    finally:
                        sidecar.stop()
                    times.setdefault(f"{memory}/{way}", []).append(seconds)
                    print(f"  {memory}, {way}: {seconds:.3f} s", flush=True)
    finally:
        _mapped.map_private = mapping
        shutil.rmtree(work, ignore_errors=True)
    size = f"{nbytes / (1 << 30):.2f} GiB in {args.tensors} tensors"
    print(f"\n| memory just before the load ({size}, medians of {args.runs}) | mapped | new memory |")
    print("|---|---:|---:|")
    for memory in STATES:
        m, n = (statistics.median(times[f"{memory}/{w}"]) for w in ways)
        print(f"| {memory} | {m:.2f} s | {n:.2f} s |")


if __name__ == "__main__":
    main()
