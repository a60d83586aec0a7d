"""hotstart: asynchronous checkpoints for training loops.

>>> import hotstart
>>> ck = hotstart.Checkpointer(store="s3://bucket/runs", job="run-42")
>>> h = ck.save(step, {"model": model.state_dict(), "optim": opt.state_dict(), "step": step})
>>> h.wait_staged()          # before optimizer.step(); persistence goes on in the background
>>> state = ck.load()        # newest complete step, verified; or ck.load(state) in place

``hotstart.env.ensure`` restores a dependency snapshot instead of reinstalling an environment.
``hotstart.torch`` has torch.distributed.checkpoint storage backends (``StorageWriter``,
``StorageReader``); importing ``hotstart`` itself does not import torch or numpy.
"""

from __future__ import annotations

from . import env, errors
from ._checkpointer import Checkpointer, SaveHandle
from ._core import CUDA_BUILT, __version__
from .errors import (
    ConfigError,
    CorruptCheckpoint,
    CorruptSnapshot,
    CudaError,
    HotstartError,
    InstallFailed,
    NoCheckpoint,
    SaveSkipped,
    SecondWriter,
    SidecarError,
    StateDictError,
    StepInFlight,
    StoreError,
    TargetInUse,
    TierUnavailable,
)

__all__ = [
    "Checkpointer",
    "SaveHandle",
    "CUDA_BUILT",
    "__version__",
    "env",
    "errors",
    # the exceptions, as hotstart.errors lists them
    "HotstartError",
    "ConfigError",
    "StateDictError",
    "CorruptCheckpoint",
    "NoCheckpoint",
    "StoreError",
    "TierUnavailable",
    "SidecarError",
    "StepInFlight",
    "SecondWriter",
    "SaveSkipped",
    "CudaError",
    "InstallFailed",
    "TargetInUse",
    "CorruptSnapshot",
]
