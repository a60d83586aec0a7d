"""One rank of ``hotstart demo --trainer torch``: a PyTorch model trained on this node and
checkpointed through its sidecar with :class:`hotstart.Checkpointer`, started by the demo under
torchrun. It tells the demo what it does as JSON lines on stdout, the same events as the demo's
Rust trainers (``demo/src/event.rs``), and nothing else goes there. Not an API.

The model is an embedding table under a small MLP classifier, trained with Adam on synthetic
data, on one thread with deterministic kernels: the same state trained on the same steps gives
the same bits, which is what the demo checks after every restore.
"""

import argparse
import ctypes
import hashlib
import json
import signal
import struct
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Set, Tuple

DIM = 64
HIDDEN = 256
CLASSES = 16
BATCH = 128
# How long a rank waits for the others while the job agrees on the step to resume from.
AGREEMENT_WAIT = 120.0
TIERS = ("memory", "peer", "disk", "store")


def emit(event: str, **fields: Any) -> None:
    print(json.dumps({"event": event, **fields}), flush=True)


def die_with_parent() -> None:
    """SIGKILL when torchrun's agent dies, as the demo's other children do when the demo dies."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def rows_for(state_bytes: int) -> int:
    """Embedding rows for about ``state_bytes`` of parameters and Adam moments (12 bytes each)."""
    dense = DIM * HIDDEN + HIDDEN + HIDDEN * CLASSES + CLASSES
    return max(CLASSES, (state_bytes // 12 - dense) // DIM)


class Trainer:
    def __init__(self, a: argparse.Namespace) -> None:
        import torch

        import hotstart
        import hotstart.torch as ht

        self.torch, self.ht, self.a = torch, ht, a
        torch.set_num_threads(1)
        torch.use_deterministic_algorithms(True)
        self.ck = hotstart.Checkpointer(
            job=a.job, rank=a.rank, world_size=a.world_size, sidecar=a.socket
        )
        self.rows = rows_for(a.size)
        self.fresh()

    def fresh(self) -> None:
        """A newly initialised model and optimizer (also after loads that failed halfway)."""
        torch = self.torch
        torch.manual_seed(self.a.seed ^ self.a.rank)
        self.model = torch.nn.Sequential(
            torch.nn.Embedding(self.rows, DIM),
            torch.nn.Linear(DIM, HIDDEN),
            torch.nn.ReLU(),
            torch.nn.Linear(HIDDEN, CLASSES),
        )
        self.opt = torch.optim.Adam(self.model.parameters(), lr=3e-3)
        self.step = 0

    def state(self) -> Dict[str, Any]:
        return {"model": self.model.state_dict(), "optim": self.opt.state_dict(), "step": self.step}

    def state_bytes(self) -> int:
        return 3 * sum(int(p.numel()) * int(p.element_size()) for p in self.model.parameters())

    def digest(self) -> str:
        """A hash of the whole training state: the step, the parameters, the Adam state."""
        h = hashlib.blake2b(struct.pack("<Q", self.step), digest_size=32)
        for t in self.model.state_dict().values():
            h.update(t.detach().contiguous().numpy())
        moments = self.opt.state_dict()["state"]
        for i in sorted(moments):
            for k in sorted(moments[i]):
                h.update(moments[i][k].detach().contiguous().numpy())
        return h.hexdigest()

    def train_step(self) -> float:
        torch = self.torch
        self.step += 1
        key = (self.a.seed * 1_000_003 + self.a.rank) * 1_000_003 + self.step
        g = torch.Generator().manual_seed(key)
        rows = torch.randint(self.rows, (BATCH,), generator=g)
        labels = (rows * 2654435761 % 4294967296 >> 7) % CLASSES
        loss = torch.nn.functional.cross_entropy(self.model(rows), labels)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        return float(loss.item())

    def restore(self, step: int) -> Tuple[bool, str]:
        """Loads ``step`` in place; (restored, what to tell the other ranks)."""
        from hotstart.errors import NoCheckpoint

        started = time.perf_counter()
        self.ht.empty_optimizer_state(self.opt)
        state = self.state()
        try:
            self.ck.load(state, step=step)
        except NoCheckpoint:
            return False, "not found"
        except Exception as e:  # every other failure is one this rank cannot restore
            return False, str(e)
        # Loaded in place: the state dicts' tensors are the model's and the optimizer's own.
        self.step = int(state["step"])
        if self.step != step:
            return False, f"step {step} holds the state of step {self.step}"
        emit("started", rank=self.a.rank, state_bytes=self.state_bytes())
        emit(
            "restored",
            rank=self.a.rank,
            step=step,
            sources=list(self.ck.loaded_from),
            seconds=time.perf_counter() - started,
            hash=self.digest(),
        )
        return True, "ok"


def publish(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(text)
    tmp.rename(path)


def await_file(path: Path, what: str) -> str:
    deadline = time.monotonic() + AGREEMENT_WAIT
    while True:
        try:
            return path.read_text()
        except FileNotFoundError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} ({path})")
        time.sleep(0.02)


def restore_agreed(t: Trainer, d: Path) -> bool:
    """The demo's resume agreement (``demo/src/trainer.rs``, ``restore_agreed``): rank 0
    proposes the newest step complete for every rank, each rank tries it and says whether it
    could, and the job goes back a step, every rank together, until all could (or none is left:
    every rank starts fresh)."""
    a = t.a
    if a.rank == 0:
        d.mkdir(parents=True, exist_ok=True)
    proposed: Optional[int] = None
    round_ = 0
    while True:
        at = d / f"step-{round_}"
        if a.rank == 0:
            step = t.ck.latest_step() if proposed is None else t.ck.latest_step(below=proposed)
            publish(at, "fresh" if step is None else str(step))
        text = await_file(at, "rank 0 to choose the step to resume from")
        if text == "fresh":
            return False
        proposed = int(text)
        ok, said = t.restore(proposed)
        if not ok:
            print(f"rank {a.rank}: cannot restore step {proposed}: {said}", file=sys.stderr)
        publish(d / f"result-{round_}-{a.rank}", said)
        results = [
            await_file(d / f"result-{round_}-{r}", "every rank to try the chosen step")
            for r in range(a.world_size)
        ]
        if all(r == "ok" for r in results):
            return True
        round_ += 1


class Pending:
    """A save whose tiers are still being reported."""

    def __init__(self, handle: Any, started: float) -> None:
        self.handle = handle
        self.started = started
        self.reported: Set[str] = set()

    def report(self, rank: int) -> bool:
        status = self.handle.status()
        open_ = False
        for tier in TIERS:
            if tier in self.reported:
                continue
            phase = str(status[tier])
            if phase == "pending":
                open_ = True
                continue
            self.reported.add(tier)
            if phase in ("off", "skipped"):
                continue
            error = None if phase == "done" else phase.removeprefix("failed: ")
            emit(
                "persisted",
                rank=rank,
                step=int(status["step"]),
                tier=tier,
                seconds=time.perf_counter() - self.started,
                error=error,
            )
        return not open_


def main(argv: Optional[List[str]] = None) -> None:
    p = argparse.ArgumentParser(prog="python -m hotstart._demo_trainer", description=__doc__)
    p.add_argument("--socket", required=True)
    p.add_argument("--job", default="demo")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--size", type=int, default=1 << 30)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--every", type=int, default=100)
    p.add_argument("--until", type=int)
    p.add_argument("--resume-agreement", type=Path)
    a = p.parse_args(argv)
    die_with_parent()
    t = Trainer(a)
    restored = False
    if a.resume_agreement is not None:
        restored = restore_agreed(t, a.resume_agreement)
    else:
        latest = t.ck.latest_step()
        restored = latest is not None and t.restore(latest)[0]
    if not restored:
        t.fresh()
        emit("started", rank=a.rank, state_bytes=t.state_bytes())
        emit("fresh", rank=a.rank)
    pending: List[Pending] = []
    while a.until is None or t.step < a.until:
        loss = t.train_step()
        bits = struct.unpack("<I", struct.pack("<f", loss))[0]
        emit("step", rank=a.rank, step=t.step, loss_bits=bits)
        if t.step % max(a.every, 1) == 0:
            started = time.perf_counter()
            handle = t.ck.save(t.step, t.state())
            waited = time.perf_counter() - started
            handle.wait_staged()
            emit(
                "saved",
                rank=a.rank,
                step=t.step,
                stall_seconds=time.perf_counter() - started,
                wait_seconds=waited,
                hash=t.digest(),
            )
            pending.append(Pending(handle, started))
        pending = [x for x in pending if not x.report(a.rank)]
    for x in pending:
        try:
            x.handle.wait()
        except Exception:  # reported per tier below
            pass
        x.report(a.rank)


if __name__ == "__main__":
    main()
