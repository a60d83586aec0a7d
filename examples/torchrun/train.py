"""A PyTorch job under torchrun that checkpoints through hotstart and resumes after a fault.

The model is sharded with FSDP2 (`fully_shard`: each rank holds a shard of every parameter and
of AdamW's state, as DTensors), trained on a deterministic data stream (each step's batch is a
function of the step), on CPU with gloo or on GPUs with NCCL. Every `--save-every` steps it
checkpoints one of two ways:

- `--sidecar SOCKET` (or HOTSTART_SOCKET): each rank saves its own shards through the node's
  sidecar (`hotstart serve`) with `hotstart.Checkpointer`. The save returns once the shards are
  in the sidecar's memory, which outlives this process: when a worker dies, `torchrun
  --max-restarts` starts every worker again and they load their shards from that memory. Same
  world size only (a rank's shards are its own).
- `--dcp-dir DIR` (or `--store URL`): torch.distributed.checkpoint through
  `hotstart.torch.StorageWriter`; `hotstart.torch.load` (`dcp.load` with its
  `StorageReader`) loads the newest complete checkpoint that can be read and reshards it, so
  the job may come back with another number of processes.
- `--dcp --sidecar SOCKET`: torch.distributed.checkpoint through the node's sidecar. Saves go
  into the sidecars' memory (backed up to peers, persisted to disk and store); a job that
  comes back with another number of processes reshards from that memory, each rank taking the
  saved ranks' shards it needs from the nearest sidecar that holds them.

`--sidecar A,B,C` names one sidecar per simulated node: rank r uses the (r mod 3)-th.

At start it resumes from the newest checkpoint there is. Rank 0 prints `loss <step> <hex>`
after every step (`float.hex`, so runs compare bit for bit) and `state <digest>` (sha256 over
every parameter's and optimizer tensor's full bytes, gathered) after resuming and at the end.

    torchrun --nproc-per-node 2 --max-restarts 1 examples/torchrun/train.py \\
        --job run-1 --steps 40 --save-every 5 --sidecar /run/hotstart/sidecar.sock
    torchrun --nproc-per-node 3 examples/torchrun/train.py --job run-2 --steps 40 --dcp-dir /tmp/ck

Restarted workers share torchrun's store with the attempt that failed, so the process group's
keys get a prefix per attempt (`init_group`); without it they can find the dead attempt's
addresses there and hang or fail to connect.

`--kill-rank R --kill-step K` makes rank R kill itself with SIGKILL after step K on the first
attempt (TORCHELASTIC_RESTART_COUNT 0), once every rank is through step K and has staged its
save of it, if K saves. A K that saves is the fault the tests inject: right after the save,
while the sidecar still hashes what it must commit for a process that died. A K that saves
nothing is a fault later in training, the last save's own work done (what the restart benchmark
measures).

`--torch-dcp DIR` is the baseline a user has without hotstart: torch.distributed.checkpoint's own
FileSystemWriter and FileSystemReader, one directory per step (DIR/step-N).

For measurements (`hotstart-benches restart`): `--width W --depth L` gives the model L more
hidden layers of W×W (so its state can be GiBs), `--no-digest` skips the gathered digests,
`--timeline` has every rank print `at <event> <unix time> rank <r> attempt <a>` as it starts,
has imported torch, has joined the group, has built the model, has its optimizer state ready,
has read its checkpoint into the state dict, has set it into the model and optimizer
(`set_state_dict`), and has finished its first step (and `at kill` just before the
injected fault); after a load through the sidecar into CUDA tensors, `copied-by <who>` says who
copied the bytes into them (`Checkpointer.device_route`). `--floor` does what any restarted worker must do at least and exits: start,
import torch, join the group, build the model, then copy as many bytes as this rank's state
holds from memory into memory (printing `floor-copy <seconds>`), then again with the optimizer's
share going into memory new to the process (`floor-fresh-copy <seconds>`).
"""

from __future__ import annotations

import time

STARTED = time.time()  # before importing torch: part of what a restart costs

import argparse
import hashlib
import os
import signal
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import hotstart
import hotstart.torch as htorch

IMPORTED = time.time()

DIM, HIDDEN, OUT, BATCH = 12, 24, 6, 16


def init_group(backend: str) -> None:
    """The default process group, with its keys under a prefix of their own for each torchrun
    attempt: the workers torchrun restarts share its store with the attempt that failed, and
    would otherwise find that attempt's stale addresses there and hang or fail to connect."""
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world,
        is_master=rank == 0 and not agent, timeout=timedelta(minutes=5),
    )
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    dist.init_process_group(backend, store=dist.PrefixStore(f"attempt-{attempt}", store),
                            rank=rank, world_size=world)


def build(width: int = HIDDEN, depth: int = 0) -> Tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(1234)
    layers: list = [torch.nn.Linear(DIM, width), torch.nn.Tanh()]
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.Tanh()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(width, OUT))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def batch(step: int, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    """Step `step`'s batch, the same on every rank, every run and every device (drawn on the
    CPU, then moved where the model is)."""
    g = torch.Generator().manual_seed(step)
    x = torch.randn(BATCH, DIM, generator=g)
    return x.to(device), torch.sin(x[:, :OUT] * 3).to(device)


def load_agreed(ck: "hotstart.Checkpointer", step: Optional[int], state: Any, flag: torch.Tensor) -> Optional[int]:
    """Loads `step` into `state` on every rank, or the step the job goes back to: when some rank
    cannot load it (its copies damaged in every tier), retrying it would fail at every restart,
    so rank 0 names the newest complete step older than it and every rank loads that one. The
    step every rank loaded, or None when no step is left."""
    while step is not None:
        try:
            ck.load(state, step=step)
            flag.fill_(1)
        except (hotstart.CorruptCheckpoint, hotstart.NoCheckpoint) as e:
            print(f"rank {dist.get_rank()}: cannot load step {step}: {e}", file=sys.stderr, flush=True)
            flag.fill_(0)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        if int(flag.item()) == 1:
            return step
        chosen = [ck.latest_step(below=step) if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(chosen, src=0)
        step = chosen[0]
    return None


def locals_of(tree: Any) -> Any:
    """The state dict with every DTensor replaced by this rank's shard (a view of it)."""
    if isinstance(tree, DTensor):
        return tree.to_local()
    if isinstance(tree, dict):
        return {k: locals_of(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [locals_of(v) for v in tree]
    return tree


def digest(model_sd: Dict[str, Any], optim_sd: Dict[str, Any]) -> str:
    """sha256 of every tensor's full bytes (gathered), in name order: the same for any world
    size. Every rank must call it (gathering is collective)."""
    h = hashlib.sha256()

    def feed(prefix: str, tree: Any) -> None:
        if isinstance(tree, dict):
            for k in sorted(tree, key=str):
                feed(f"{prefix}.{k}", tree[k])
        elif isinstance(tree, torch.Tensor):
            full = tree.full_tensor() if isinstance(tree, DTensor) else tree
            h.update(prefix.encode())
            h.update(full.detach().cpu().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())

    feed("model", model_sd)
    feed("opt", optim_sd["state"])
    return h.hexdigest()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--job", required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--save-every", type=int, default=5, help="0: never save")
    p.add_argument("--sidecar", default=os.environ.get("HOTSTART_SOCKET"),
                   help="the node's sidecar socket; comma-separated: one per simulated node, rank r uses the (r mod n)-th")
    p.add_argument("--dcp", action="store_true", help="torch.distributed.checkpoint through the sidecar")
    p.add_argument("--dcp-dir", help="local directory for torch.distributed.checkpoint")
    p.add_argument("--store", help="store URL for torch.distributed.checkpoint")
    p.add_argument("--torch-dcp", help="directory for torch.distributed.checkpoint's own file system writer and reader")
    p.add_argument("--kill-rank", type=int, default=-1)
    p.add_argument("--kill-step", type=int, default=-1)
    p.add_argument("--width", type=int, default=HIDDEN, help="hidden width")
    p.add_argument("--depth", type=int, default=0, help="extra hidden layers of width x width")
    p.add_argument("--no-digest", action="store_true", help="skip the gathered state digests")
    p.add_argument("--timeline", action="store_true", help="print when each restart phase ends")
    p.add_argument("--floor", action="store_true", help="start, build, copy the state's bytes, exit")
    args = p.parse_args()
    use_dcp = bool(args.dcp_dir or args.store or args.torch_dcp or args.dcp)
    if args.dcp and not args.sidecar:
        p.error("--dcp saves through a sidecar: name one (--sidecar or HOTSTART_SOCKET)")
    if not use_dcp and not args.sidecar and not args.floor:
        p.error("name a sidecar (--sidecar or HOTSTART_SOCKET), or --dcp-dir / --store / --torch-dcp")
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    rank_env = os.environ.get("RANK", "0")

    def mark(event: str, at: Optional[float] = None) -> None:
        if args.timeline:
            say(f"at {event} {time.time() if at is None else at:.6f} rank {rank_env} attempt {attempt}")

    mark("start", STARTED)
    mark("imported", IMPORTED)
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    device = torch.device("cpu")
    if backend == "nccl":
        # Before the group forms, so NCCL binds this rank to its own GPU.
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    init_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    mark("group")
    model, opt = build(args.width, args.depth)
    mark("built")
    if args.floor:
        floor(model, device)
    sidecars = args.sidecar.split(",") if args.sidecar else [None]
    sidecar = sidecars[rank % len(sidecars)]
    ck = None if use_dcp else hotstart.Checkpointer(sidecar=sidecar, job=args.job, rank=rank, world_size=world)

    # Resume from the newest checkpoint, if any, loading in place into the model's and the
    # optimizer's tensors.
    started = time.monotonic()
    first = 1
    if args.torch_dcp:
        steps = [int(d.name[5:]) for d in Path(args.torch_dcp).glob("step-*") if (d / ".metadata").exists()]
        newest = max(steps, default=None)
    elif use_dcp:
        newest = htorch.latest_step(args.store, args.job, local_dir=args.dcp_dir, sidecar=sidecar)
    else:
        assert ck is not None
        newest = ck.latest_step()
    # Every rank resumes from the step rank 0 found: each asks its own node's sidecar (or
    # lists the directory), and two nodes may see a step's completion a moment apart.
    chosen = [newest]
    dist.broadcast_object_list(chosen, src=0)
    newest = chosen[0]
    tried = newest is not None
    if tried:
        if not args.torch_dcp:
            # The optimizer's state tensors for the load to fill, made without the step on zero
            # gradients that get_state_dict would run to create them (torch DCP's own baseline
            # keeps torch's way).
            htorch.empty_optimizer_state(opt)
        model_sd, optim_sd = get_state_dict(model, opt)
        mark("ready")
        if args.torch_dcp:
            state = {"model": model_sd, "optim": optim_sd}
            dcp.load(state, storage_reader=dcp.FileSystemReader(f"{args.torch_dcp}/step-{newest}"))
        elif use_dcp:
            # Every rank loads the newest checkpoint that can be read, going back together.
            state = {"model": model_sd, "optim": optim_sd}
            try:
                newest = htorch.load(state, args.store, args.job, local_dir=args.dcp_dir, sidecar=sidecar)
            except hotstart.NoCheckpoint as e:
                print(f"rank {rank}: no checkpoint can be read: {e}", file=sys.stderr, flush=True)
                newest = None
        else:
            assert ck is not None
            flag = torch.zeros(1, dtype=torch.int32, device=device)
            newest = load_agreed(ck, newest, {"model": locals_of(model_sd), "optim": locals_of(optim_sd)}, flag)
    if tried and newest is None:
        # Every step some rank tried was unusable, and the tensors may hold part of one: start
        # over from a freshly built model.
        model, opt = build(args.width, args.depth)
        first = 1
    elif newest is not None:
        mark("read")
        if args.timeline and ck is not None and ck.device_route is not None:
            say(f"copied-by {ck.device_route}")
        set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
        mark("loaded")
        first = newest + 1
        if rank == 0:
            print(f"resumed {newest} in {time.monotonic() - started:.3f} s (world {world})", flush=True)
        if not args.no_digest:
            d = digest(*get_state_dict(model, opt))
            if rank == 0:
                print(f"state {d}", flush=True)

    for step in range(first, args.steps + 1):
        x, y = batch(step, device)
        shard = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x[shard]), y[shard], reduction="sum") / BATCH
        loss.backward()
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        if rank == 0:
            print(f"loss {step} {float(total).hex()}", flush=True)
        if step == first:
            mark("step")
        if args.save_every > 0 and (step % args.save_every == 0 or step == args.steps):
            model_sd, optim_sd = get_state_dict(model, opt)
            if args.torch_dcp:
                dcp.save({"model": model_sd, "optim": optim_sd},
                         storage_writer=dcp.FileSystemWriter(f"{args.torch_dcp}/step-{step}"))
            elif use_dcp:
                dcp.save({"model": model_sd, "optim": optim_sd},
                         storage_writer=htorch.StorageWriter(args.store, args.job, local_dir=args.dcp_dir,
                                                             sidecar=sidecar),
                         checkpoint_id=step)
            else:
                assert ck is not None
                # Waits only until the shards are in the sidecar's memory.
                ck.save(step, {"model": locals_of(model_sd), "optim": locals_of(optim_sd)}).wait_staged()
        if step == args.kill_step and attempt == "0" and args.kill_rank >= 0:
            # Every rank's save of this step is staged before the kill: otherwise torchrun can
            # stop another rank mid-copy, its torn save is (rightly) dropped, and the job goes
            # back to the step before, or starts over.
            dist.barrier()
            if rank == args.kill_rank:
                mark("kill")
                os.kill(os.getpid(), signal.SIGKILL)

    if ck is not None:
        ck.wait()
    if not args.no_digest:
        d = digest(*get_state_dict(model, opt))
        if rank == 0:
            print(f"state {d}", flush=True)
    if rank == 0:
        print("done", flush=True)
    leave()


def say(line: str) -> None:
    """One line in one write, so the lines of ranks that share torchrun's stdout never mix."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def floor(model: torch.nn.Module, device: torch.device) -> None:
    """Copies as many bytes as this rank's checkpoint holds (its shards of the parameters and of
    AdamW's two moments) from memory into memory already faulted in, on every rank at once,
    prints the copy's seconds, and leaves. On a GPU the copy is host to device, from pinned
    memory: the least a restore from host memory must do."""
    n = 3 * sum(p.to_local().numel() * p.element_size() if isinstance(p, DTensor) else p.numel() * p.element_size()
                for p in model.parameters())
    src = torch.ones(n, dtype=torch.uint8, pin_memory=device.type == "cuda")
    dst = torch.zeros(n, dtype=torch.uint8, device=device)

    def copy(what: str, pieces: List[Tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Times the copies of `pieces` (destination, source) on every rank at once."""
        dist.barrier()
        t = time.time()
        for to, frm in pieces:
            to.copy_(frm)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        say(f"{what} {time.time() - t:.6f} bytes {n} rank {dist.get_rank()}")

    copy("floor-copy", [(dst, src)])
    # The same copy as a restarted worker's load must make it: the parameters' third into the
    # built model's memory, AdamW's two moments into memory new to the process (a restarted
    # optimizer's state), which the copy faults in.
    k = n // 3
    fresh = torch.empty(n - k, dtype=torch.uint8, device=device)
    copy("floor-fresh-copy", [(dst[:k], src[:k]), (fresh, src[k:])])
    dist.barrier()
    leave()


def leave() -> None:
    dist.barrier()
    dist.destroy_process_group()
    # Leave without interpreter finalization: with gloo, a finished collective's work object
    # can be destroyed on gloo's thread while the interpreter tears down, which aborts the
    # process now and then ("terminate called without an active exception"), and torchrun
    # would take that for a failed worker.
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
