"""The same training loop in torch, on CUDA when there is a GPU (else CPU), checkpointing the
model and the Adam optimizer with hotstart and resuming after a crash.

    python examples/train_torch.py --local-dir /tmp/ckpt --job mlp-torch --steps 200
    python examples/train_torch.py --store s3://bucket/runs --device cuda

Each step's batch comes from a generator seeded with (seed, step), so after a kill -9 and a
restart the losses continue exactly as in a run that never stopped. Prints ``step N loss L`` per
step and ``resumed from step S`` when it starts from a checkpoint.
"""

from __future__ import annotations

import argparse
from typing import Optional, Tuple

import torch

import hotstart

D_IN, D_HIDDEN, D_OUT, BATCH = 32, 64, 4, 64


def batch(seed: int, step: int, device: torch.device) -> Tuple[torch.Tensor, torch.Tensor]:
    teacher = torch.randn(D_IN, D_OUT, generator=torch.Generator().manual_seed(seed))
    x = torch.randn(BATCH, D_IN, generator=torch.Generator().manual_seed(seed * 1_000_003 + step))
    return x.to(device), torch.tanh(x @ teacher).to(device)


def main(argv: Optional[list] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", help="store URL of the object-store tier (s3://..., file://...)")
    ap.add_argument("--local-dir", help="directory of the local disk tier")
    ap.add_argument("--job", default="train-torch", help="job name (checkpoints live under it)")
    ap.add_argument("--steps", type=int, default=200, help="train until this step")
    ap.add_argument("--every", type=int, default=10, help="checkpoint every this many steps")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)

    device = torch.device(args.device)
    torch.manual_seed(args.seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(D_IN, D_HIDDEN), torch.nn.ReLU(), torch.nn.Linear(D_HIDDEN, D_OUT)
    ).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    start = 0

    with hotstart.Checkpointer(store=args.store, local_dir=args.local_dir, job=args.job) as ck:
        if ck.latest_step() is not None:
            # A new state dict (CPU tensors); load_state_dict copies it to the model's device.
            state = ck.load()
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optim"])
            start = state["step"]
            print(f"resumed from step {start}", flush=True)
        handle = None
        for step in range(start + 1, args.steps + 1):
            x, y = batch(args.seed, step, device)
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            if handle is not None:
                handle.wait_staged()  # before optimizer.step() changes what the save reads
                handle = None
            opt.step()
            print(f"step {step} loss {loss.item()!r}", flush=True)
            if step % args.every == 0:
                state = {"model": model.state_dict(), "optim": opt.state_dict(), "step": step}
                handle = ck.save(step, state)


if __name__ == "__main__":
    main()
