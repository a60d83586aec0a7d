"""A fault campaign through the Python API: trainers written like the README's loop (resume
from ``latest_step()``, go back on ``CorruptCheckpoint``, wait on ``TierUnavailable``, save
every step) run while random faults hit them, and every restart is checked.

Two set-ups take turns: the trainer's own tiers (a disk tier on a small tmpfs and a store that
is a local directory), and the node's sidecar (``hotstart serve`` with a disk and the same kind
of store). Faults (each one counted):

* ``kill``: the trainer is killed with SIGKILL and started again;
* ``store-outage``: the job's folder in the store is replaced by a regular file for a while
  (every list, read and write there fails at once), with the trainer running; ``outage-restart``: the
  trainer is killed and started during the outage; ``outage-emptied-disk``: the same, with the
  disk (or the sidecar's memory and disk) emptied too, so that nothing readable holds a step:
  the trainer must wait (``TierUnavailable``), never start from scratch;
* ``corrupt-one`` / ``corrupt-all``: a byte flipped in the newest step's file on the disk, or
  in the same chunk of every copy, the trainer killed and started again;
* ``double-save``: the trainer saves a step twice at once (``StepInFlight``) and once more
  after (a replacement); ``second-writer``: another process saves as the same job and rank
  (``SecondWriter``); ``full-disk``: the disk's tmpfs filled for a while;
* ``sidecar-restart`` / ``sidecar-kill``: the sidecar stopped or killed and started again under
  the running trainer, which must not see an error.

Invariants, checked at every restart (the trainer reports the step it resumed from and
whether the state it loaded is bit-exact for that step, which it recomputes):

1. every resumed state is bit-exact;
2. a restart resumes from the newest complete step a reachable tier holds (the controller
   reads it with its own ``Checkpointer`` right before the restart), or the one before it when
   every copy of a chunk of the newest was corrupted;
3. never from scratch while a checkpoint exists anywhere reachable (an outage with nothing
   nearer makes the trainer wait for the store);
4. no trainer ever dies of an error it was not meant to see (a sidecar restart, a double
   save, a store outage, a full disk).

    .venv/bin/python bindings/tests/campaign.py --faults 300
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import queue
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

import hotstart

N = 96 * 1024  # float64 elements: 768 KiB of state, in chunks of 64 KiB
CHUNK = 64 << 10
JOB = "campaign"

TRAINER = textwrap.dedent(
    '''
    import faulthandler, json, os, signal, sys, time
    import numpy as np
    import hotstart

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # where it is, when it hangs

    cfg = json.loads(sys.argv[1])

    def say(**event):
        print(json.dumps(event), flush=True)

    def expected(step):
        return np.random.default_rng(step).standard_normal(cfg["n"])

    ck = hotstart.Checkpointer(job=cfg["job"], chunk_size=cfg["chunk"], **cfg["where"])
    while True:
        try:
            latest = ck.latest_step()
            break
        except hotstart.TierUnavailable:
            say(event="unavailable")
            time.sleep(0.1)
    start, exact = 0, True
    if latest is not None:
        try:
            s = ck.load(step=latest)
        except hotstart.CorruptCheckpoint:
            s = ck.load(step=ck.latest_step(below=latest))
        exact = bool(np.array_equal(s["w"], expected(s["step"]))) and s["meta"]["step"] == s["step"]
        start = s["step"] + 1
    say(event="resumed", step=None if latest is None else start - 1, exact=exact)
    handle, step = None, start
    while True:
        w = expected(step)
        if handle is not None:
            handle.wait_staged()
        state = {"w": w, "step": step, "meta": {"step": step}}
        handle = ck.save(step, state)
        if os.path.exists(cfg["double"]):
            os.unlink(cfg["double"])
            try:
                ck.save(step, state)
                twice = "accepted"
            except hotstart.StepInFlight:
                twice = "refused"
            handle.wait()
            ck.save(step, state).wait()
            say(event="double", step=step, twice=twice)
        say(event="saved", step=step)
        step += 1
        time.sleep(cfg["pause"])
    '''
)

WRITER = textwrap.dedent(
    '''
    import json, sys
    import numpy as np
    import hotstart
    cfg = json.loads(sys.argv[1])
    ck = hotstart.Checkpointer(job=cfg["job"], chunk_size=cfg["chunk"], **cfg["where"])
    try:
        ck.save(10**9, {"w": np.zeros(4)}).wait()
        print("saved")
    except hotstart.SecondWriter as e:
        print("refused", e)
    '''
)


class CampaignError(AssertionError):
    pass


_libc = ctypes.CDLL(None, use_errno=True)
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def exchange(a: Path, b: Path) -> None:
    """Swaps two paths atomically (renameat2 with RENAME_EXCHANGE)."""
    if _libc.renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"exchange {a} and {b}: {os.strerror(e)}")


@dataclass
class Report:
    faults: Counter = field(default_factory=Counter)
    restarts: int = 0
    resumed_from: Counter = field(default_factory=Counter)
    waited_for_store: int = 0
    flipped: int = 0
    went_back: int = 0
    adopted: int = 0
    outage_on_damaged: int = 0
    twice: Counter = field(default_factory=Counter)

    def line(self) -> str:
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(self.faults.items()))
        return (f"{sum(self.faults.values())} faults ({kinds}); {self.restarts} restarts, every one "
                f"bit-exact and from the newest reachable step ({self.went_back} went back a step "
                f"from a corrupt one, {self.adopted} from a save the sidecar committed for the killed trainer after the controller asked, {self.outage_on_damaged} outage restarts with the store up since the disk's copy was damaged); {self.flipped} bytes flipped; {self.waited_for_store} "
                "waited out a store outage instead of starting from scratch; second saves of a "
                f"step in flight: {dict(self.twice)}")


class Trainer:
    """One trainer process and the events it prints."""

    def __init__(self, script: Path, cfg: Dict[str, Any], log: Path) -> None:
        self.events: "queue.Queue[Dict[str, Any]]" = queue.Queue()
        self.log_path = log
        self.log = open(log, "ab")
        self.proc = subprocess.Popen([sys.executable, str(script), json.dumps(cfg)],
                                     stdout=subprocess.PIPE, stderr=self.log, text=True)
        self.saved = -1
        self.unavailable = 0
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.events.put(json.loads(line))
        self.events.put({"event": "exit"})

    def next(self, kind: str, timeout: float = 90) -> Dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            try:
                e = self.events.get(timeout=max(left, 0.01))
            except queue.Empty:
                self.proc.send_signal(signal.SIGUSR1)  # its Python stacks, into its log
                time.sleep(1)
                raise CampaignError(f"no {kind!r} from the trainer within {timeout} s") from None
            if e["event"] == "saved":
                self.saved = e["step"]
            if e["event"] == "unavailable":
                self.unavailable += 1
            if e["event"] == "exit":
                self.log.flush()
                tail = self.log_path.read_text(errors="replace")[-3000:]
                raise CampaignError(f"the trainer exited ({self.proc.wait()}) waiting for {kind!r}; "
                                    f"the end of its log:\n{tail}")
            if e["event"] == kind:
                return e

    def progress(self, saves: int = 2) -> None:
        """Waits for `saves` more saves."""
        for _ in range(saves):
            self.next("saved")

    def kill(self) -> int:
        """Kills the trainer; the newest step it had said it saved (every event it printed read)."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        self.log.close()
        try:
            while (e := self.events.get(timeout=30))["event"] != "exit":
                if e["event"] == "saved":
                    self.saved = e["step"]
        except queue.Empty:
            pass
        return self.saved


class Sidecar:
    """`hotstart serve` over `disk` and `store`, on loopback."""

    def __init__(self, exe: str, work: Path, disk: Path, store: Path, ports: List[int]) -> None:
        peer, http = ports
        self.args = [exe, "serve", "--insecure", "--node-id", "campaign", "--listen",
                     f"127.0.0.1:{peer}", "--http", f"127.0.0.1:{http}", "--socket",
                     str(work / "sidecar.sock"), "--disk-dir", str(disk), "--store", str(store),
                     "--memory-budget", "64MiB", "--keep", "3"]
        self.socket = work / "sidecar.sock"
        self.log = work / "sidecar.log"
        self.http = f"http://127.0.0.1:{http}"
        self.proc: Optional[subprocess.Popen] = None
        self.start()

    def start(self) -> None:
        import urllib.request

        env = {k: v for k, v in os.environ.items() if not k.startswith("HOTSTART_")}
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(self.args, stdin=subprocess.DEVNULL, stdout=log,
                                         stderr=log, env=env)
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(self.http + "/readyz", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise CampaignError(f"the sidecar did not start:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.05)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(timeout=60)


class Campaign:
    def __init__(self, work: Path, exe: str, seed: int, ports: List[int]) -> None:
        self.work, self.exe, self.rng = work, exe, random.Random(seed)
        self.store = work / "store"
        self.disk = work / "disk"
        self.ports = ports
        self.report = Report()
        self.script = work / "trainer.py"
        self.script.write_text(TRAINER)
        self.writer = work / "writer.py"
        self.writer.write_text(WRITER)
        self.double = work / "double"
        self.sidecar: Optional[Sidecar] = None
        self.trainer: Optional[Trainer] = None
        self.mode = "own"
        self.history: List[str] = []

    # --- set-ups ----------------------------------------------------------------------------

    def cfg(self) -> Dict[str, Any]:
        where: Dict[str, Any]
        if self.mode == "sidecar":
            assert self.sidecar is not None
            where = {"sidecar": str(self.sidecar.socket)}
        else:
            where = {"local_dir": str(self.disk), "store": str(self.store), "keep": 3}
        return {"job": JOB, "n": N, "chunk": CHUNK, "where": where, "double": str(self.double),
                "pause": 0.01}

    def begin(self, mode: str) -> None:
        """Starts a set-up from empty tiers."""
        self.end()
        self.mode = mode
        for d in (self.store, self.disk):
            if d.is_file():
                d.unlink()
            shutil.rmtree(d, ignore_errors=True)
        self.store.mkdir()
        self.disk.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=24m", "tmpfs", str(self.disk)],
                       check=True)
        if mode == "sidecar":
            self.sidecar = Sidecar(self.exe, self.work, self.disk, self.store, self.ports)
        self.trainer = Trainer(self.script, self.cfg(), self.work / "trainer.log")
        first = self.trainer.next("resumed")
        if first["step"] is not None:
            raise CampaignError(f"a fresh job resumed from {first}")
        self.trainer.progress(3)

    def end(self) -> None:
        if self.trainer is not None and self.trainer.proc.poll() is None:
            self.trainer.kill()
        self.trainer = None
        if self.sidecar is not None:
            self.sidecar.stop(signal.SIGKILL)
            self.sidecar = None
        # Lazily: tensors this process loaded may still map files of the old disk.
        subprocess.run(["umount", "-l", str(self.disk)], capture_output=True)

    # --- what the controller checks ---------------------------------------------------------

    def where(self) -> Dict[str, Any]:
        """The tiers the controller reads, as the trainer's set-up has them."""
        if self.mode == "own":
            return {"local_dir": str(self.disk), "store": str(self.store)}
        assert self.sidecar is not None
        return {"sidecar": str(self.sidecar.socket)}

    def newest(self, below: Optional[int] = None, **where: Any) -> Optional[int]:
        """The newest complete step (older than `below`), read through `where` (default: the
        set-up's tiers)."""
        with hotstart.Checkpointer(job=JOB, **(where or self.where())) as ck:
            return ck.latest_step(below=below)

    def newest_in_files(self) -> Optional[int]:
        """The newest step whose manifest (the commit) is on the disk or in the store, read from
        the files themselves rather than through hotstart."""
        steps = [int(m.parent.name.removeprefix("step-"))
                 for d in (self.disk, self.store) for m in (d / JOB).glob("step-*/rank-0.manifest.json")]
        return max(steps, default=None)

    def restart(self, expect: Optional[int], *, before: Any = None,
                adopted: Optional[int] = None) -> Dict[str, Any]:
        """Starts the trainer again (after `before`, while it waits) and checks its resume.

        `adopted`: the newest step a killed trainer may have left filled in a sidecar that lives
        on (the one after its last "saved"). The sidecar commits such a save once it sees the
        trainer gone, which can be after the controller asked for `expect`; the resume may then
        come from that newer step, and no newer."""
        assert self.trainer is None or self.trainer.proc.poll() is not None
        self.trainer = Trainer(self.script, self.cfg(), self.work / "trainer.log")
        if before is not None:
            before(self.trainer)
        r = self.trainer.next("resumed")
        self.report.restarts += 1
        if not r["exact"]:
            raise CampaignError(f"resumed state not bit-exact: {r}")
        newer = (adopted is not None and r["step"] is not None
                 and (expect is None or r["step"] > expect) and r["step"] <= adopted)
        if r["step"] != expect and not newer:
            raise CampaignError(f"resumed from step {r['step']}, the newest reachable is {expect}"
                                + ("" if adopted is None else f" (or a save adopted up to {adopted})"))
        self.report.adopted += newer
        if r["step"] is None:
            raise CampaignError("started from scratch while a checkpoint exists")
        self.report.resumed_from[r["step"]] += 1
        self.trainer.progress(2)
        return r

    # --- faults -----------------------------------------------------------------------------

    def damaged_on_disk(self, step: Optional[int]) -> bool:
        """Whether the disk's copy of `step` (own mode: no process writes the disk now) fails
        verification."""
        if step is None or not (self.disk / JOB / f"step-{step}" / "rank-0.manifest.json").exists():
            return False
        try:
            with hotstart.Checkpointer(job=JOB, local_dir=str(self.disk)) as ck:
                ck.load(step=step)
        except hotstart.CorruptCheckpoint:
            return True
        return False

    def break_store(self) -> Path:
        """The job's folder in the store becomes a regular file: every list, read and write of
        the job there fails at once (the store itself still opens). Swapped in one step, so
        that no writer recreates the folder in between."""
        away = self.work / "store-job.away"
        away.write_bytes(b"not a directory")
        exchange(away, self.store / JOB)
        return away

    def mend_store(self, away: Path) -> None:
        exchange(away, self.store / JOB)
        away.unlink()

    def kill(self) -> Optional[int]:
        """Kills the trainer; with a sidecar that lives on, the newest step the trainer may have
        left filled in it (see `restart`)."""
        assert self.trainer is not None
        saved = self.trainer.kill()
        return saved + 1 if self.mode == "sidecar" else None

    def f_kill(self) -> None:
        adopted = self.kill()
        newest, in_files = self.newest(), self.newest_in_files()
        # hotstart's answer against the files: the same step with the engine's own tiers; with a
        # sidecar, whose memory may hold a step it has not persisted yet, never an older one.
        if in_files is not None and (newest is None or newest < in_files) or (
                self.mode == "own" and newest != in_files):
            raise CampaignError(f"latest_step() says {newest}, the files' newest commit is {in_files}")
        self.restart(newest, adopted=adopted)

    def f_store_outage(self) -> None:
        assert self.trainer is not None
        away = self.break_store()
        self.trainer.progress(3)
        self.mend_store(away)
        self.trainer.progress(2)

    def f_outage_restart(self) -> None:
        adopted = self.kill()
        # The newest step of the nearer tiers (the disk, the sidecar's memory) is what a restart
        # during a store outage resumes from. It is the newest of all unless the disk failed to
        # persist a newer one (full: that save's handle had the error), which the store holds.
        nearer = {"local_dir": str(self.disk)} if self.mode == "own" else {}
        newest = self.newest(**nearer)
        if self.mode == "own" and self.damaged_on_disk(newest):
            # An earlier corrupt-one damaged that step's disk copy (nothing mends a disk copy)
            # and no newer step reached the disk: with the store out too, no tier holds its
            # good bytes, and the load rightly raises TierUnavailable. Not this fault's case:
            # the restart goes ahead with the store up.
            self.report.outage_on_damaged += 1
            self.restart(self.newest())
            return
        away = self.break_store()
        try:
            self.restart(newest, adopted=adopted)
        finally:
            self.mend_store(away)

    def f_outage_emptied_disk(self) -> None:
        self.kill()
        if self.mode == "sidecar":
            assert self.sidecar is not None
            self.sidecar.stop(signal.SIGKILL)
        # Every save reached the store only after the disk: what the store holds is complete.
        in_store = self.newest(store=str(self.store))
        away = self.break_store()
        for p in self.disk.iterdir():
            shutil.rmtree(p) if p.is_dir() else p.unlink()
        if self.mode == "sidecar":
            assert self.sidecar is not None
            self.sidecar.start()

        def wait_then_mend(t: Trainer) -> None:
            t.next("unavailable", timeout=120)
            self.report.waited_for_store += 1
            self.mend_store(away)

        try:
            self.restart(in_store, before=wait_then_mend)
        finally:
            if (self.store / JOB).is_file():
                self.mend_store(away)

    def newest_file(self) -> Optional[Path]:
        step = self.newest()
        f = self.disk / JOB / f"step-{step}" / "rank-0.safetensors"
        return f if f.exists() else None

    def flip(self, f: Path, chunk: int) -> None:
        self.report.flipped += 1
        data = bytearray(f.read_bytes())
        data[min(chunk * CHUNK + 4099, len(data) - 1)] ^= 0x10
        f.write_bytes(bytes(data))

    def kill_all(self) -> None:
        """Kills the trainer, and the sidecar with it (started again with empty memory, so
        that its memory does not hide what is on the disk and in the store)."""
        self.kill()
        if self.mode == "sidecar":
            assert self.sidecar is not None
            self.sidecar.stop(signal.SIGKILL)
            self.sidecar.start()

    def f_corrupt_one(self) -> None:
        self.kill_all()
        newest = self.newest()
        step = self.store / JOB / f"step-{newest}"
        # The disk's copy, mended by the store's where the store got the step; where the disk
        # missed the step (full), the store's copy, which nothing mends.
        f = self.newest_file() or step / "rank-0.safetensors"
        if not f.exists():
            raise CampaignError(f"step {newest} is the newest, but no tier holds its file")
        self.flip(f, self.rng.randrange(N * 8 // CHUNK))
        expect = newest
        if f.is_relative_to(self.store) or not (step / "rank-0.manifest.json").exists():
            expect = self.newest(below=newest)
            self.report.went_back += 1
        self.restart(expect)

    def f_corrupt_all(self) -> None:
        self.kill_all()
        newest = self.newest()
        chunk = self.rng.randrange(N * 8 // CHUNK)
        copies = [d / JOB / f"step-{newest}" / "rank-0.safetensors" for d in (self.disk, self.store)]
        copies = [c for c in copies if c.exists()]
        for c in copies:
            self.flip(c, chunk)
        below = self.newest(below=newest) if copies else newest
        self.report.went_back += below != newest
        self.restart(below)

    def f_double_save(self) -> None:
        assert self.trainer is not None
        self.double.write_bytes(b"")
        e = self.trainer.next("double")
        if e["twice"] not in ("refused", "accepted"):
            raise CampaignError(f"double save: {e}")
        self.report.twice[e["twice"]] += 1
        self.trainer.progress(2)

    def f_second_writer(self) -> None:
        r = subprocess.run([sys.executable, str(self.writer), json.dumps(self.cfg())],
                           capture_output=True, text=True, timeout=120)
        assert self.trainer is not None
        pid = self.trainer.proc.pid
        if not r.stdout.startswith("refused") or f"pid {pid} " not in r.stdout:
            raise CampaignError(f"a second writer was not refused with the first one's name: "
                                f"{r.stdout}{r.stderr[-2000:]}")
        self.trainer.progress(2)

    def f_full_disk(self) -> None:
        assert self.trainer is not None
        filler = self.disk / "filler"
        subprocess.run(["dd", "if=/dev/zero", f"of={filler}", "bs=1M", "count=64"],
                       capture_output=True)
        self.trainer.progress(3)
        filler.unlink()
        self.trainer.progress(3)

    def f_sidecar_restart(self, sig: int = signal.SIGTERM) -> None:
        assert self.trainer is not None and self.sidecar is not None
        self.sidecar.stop(sig)
        self.sidecar.start()
        self.trainer.progress(3)

    def f_sidecar_kill(self) -> None:
        self.f_sidecar_restart(signal.SIGKILL)

    FAULTS = {
        "own": ["kill", "store-outage", "outage-restart", "outage-emptied-disk", "corrupt-one",
                "corrupt-all", "double-save", "second-writer", "full-disk"],
        "sidecar": ["kill", "store-outage", "outage-restart", "outage-emptied-disk",
                    "corrupt-one", "double-save", "second-writer", "sidecar-restart",
                    "sidecar-kill"],
    }

    def run(self, faults: int) -> Report:
        try:
            per_mode = (faults + 1) // 2
            for mode in ("own", "sidecar"):
                self.begin(mode)
                for _ in range(min(per_mode, faults - sum(self.report.faults.values()))):
                    kind = self.rng.choice(self.FAULTS[mode])
                    self.history.append(f"{mode}:{kind}")
                    getattr(self, "f_" + kind.replace("-", "_"))()
                    self.report.faults[kind] += 1
        except CampaignError as e:
            raise CampaignError(f"{e} (faults so far, the last one failed: "
                                f"{' '.join(self.history[-8:])}; {len(self.history)} in all)") from None
        finally:
            self.end()
        return self.report


def run(faults: int, seed: int, exe: str, ports: List[int], keep: Optional[Path] = None) -> Report:
    work = Path(tempfile.mkdtemp(prefix="hotstart-campaign-"))
    try:
        return Campaign(work, exe, seed, ports).run(faults)
    except BaseException:
        if keep is not None:
            shutil.copytree(work, keep, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.sock"))
        raise
    finally:
        subprocess.run(["umount", str(work / "disk")], capture_output=True)
        shutil.rmtree(work, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--faults", type=int, default=300)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--bin", default=str(Path(__file__).resolve().parents[2] / "target/debug/hotstart"))
    ap.add_argument("--ports", type=int, nargs=2, default=[17400, 17401],
                    help="the sidecar's peer and HTTP ports (loopback)")
    ap.add_argument("--keep", type=Path, help="where to copy the work folder when a check fails")
    args = ap.parse_args()
    t = time.monotonic()
    report = run(args.faults, args.seed, args.bin, args.ports, args.keep)
    print(report.line())
    print(f"in {time.monotonic() - t:.0f} s")


if __name__ == "__main__":
    main()
