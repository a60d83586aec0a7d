"""A small training loop in numpy that checkpoints with hotstart and resumes after a crash.

A two-layer MLP learns a fixed random teacher on synthetic data with SGD and momentum. Every
``--every`` steps it saves its whole state (weights, momentum, step) asynchronously; it waits
only for the staging copy, right before the update that changes the weights. Started again
after a crash (kill -9 included), it loads the newest complete checkpoint and continues: the
batch of each step is derived from (seed, step), so the losses continue exactly as in a run
that never stopped.

    python examples/train_numpy.py --local-dir /tmp/ckpt --job mlp --steps 200
    python examples/train_numpy.py --store s3://bucket/runs --job mlp     # or an object store

It prints one line per step, ``step N loss L`` (L in full precision), and ``resumed from step
S`` when it starts from a checkpoint.
"""

from __future__ import annotations

import argparse
from typing import Dict, Optional, Tuple

import numpy as np

import hotstart

D_IN, D_HIDDEN, D_OUT, BATCH = 32, 64, 4, 64


def init(seed: int) -> Dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "w1": rng.standard_normal((D_IN, D_HIDDEN)) / np.sqrt(D_IN),
        "b1": np.zeros(D_HIDDEN),
        "w2": rng.standard_normal((D_HIDDEN, D_OUT)) / np.sqrt(D_HIDDEN),
        "b2": np.zeros(D_OUT),
    }


def batch(seed: int, step: int) -> Tuple[np.ndarray, np.ndarray]:
    teacher = np.random.default_rng([seed, 0]).standard_normal((D_IN, D_OUT))
    x = np.random.default_rng([seed, step]).standard_normal((BATCH, D_IN))
    return x, np.tanh(x @ teacher)


def loss_and_grads(p: Dict[str, np.ndarray], x: np.ndarray, y: np.ndarray) -> Tuple[float, Dict[str, np.ndarray]]:
    h = np.maximum(x @ p["w1"] + p["b1"], 0.0)
    out = h @ p["w2"] + p["b2"]
    diff = out - y
    loss = float(np.mean(diff**2))
    d_out = 2.0 * diff / diff.size
    d_h = (d_out @ p["w2"].T) * (h > 0)
    return loss, {
        "w2": h.T @ d_out,
        "b2": d_out.sum(0),
        "w1": x.T @ d_h,
        "b1": d_h.sum(0),
    }


def main(argv: Optional[list] = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--store", help="store URL of the object-store tier (s3://..., file://...)")
    ap.add_argument("--local-dir", help="directory of the local disk tier")
    ap.add_argument("--job", default="train-numpy", help="job name (checkpoints live under it)")
    ap.add_argument("--steps", type=int, default=200, help="train until this step")
    ap.add_argument("--every", type=int, default=10, help="checkpoint every this many steps")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=0.05)
    args = ap.parse_args(argv)

    params = init(args.seed)
    momentum = {k: np.zeros_like(v) for k, v in params.items()}
    state = {"model": params, "optim": {"momentum": momentum, "lr": args.lr}, "step": 0}

    with hotstart.Checkpointer(store=args.store, local_dir=args.local_dir, job=args.job) as ck:
        if ck.latest_step() is not None:
            ck.load(state)  # in place: the arrays above now hold the checkpoint
            print(f"resumed from step {state['step']}", flush=True)
        handle = None
        for step in range(state["step"] + 1, args.steps + 1):
            x, y = batch(args.seed, step)
            loss, grads = loss_and_grads(params, x, y)
            if handle is not None:
                handle.wait_staged()  # the last save has copied the weights we now change
                handle = None
            for k in params:
                momentum[k] *= 0.9
                momentum[k] += grads[k]
                params[k] -= args.lr * momentum[k]
            state["step"] = step
            print(f"step {step} loss {loss!r}", flush=True)
            if step % args.every == 0:
                handle = ck.save(step, state)
        # Leaving the block waits for the last saves to be durable.


if __name__ == "__main__":
    main()
