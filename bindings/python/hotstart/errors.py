"""Exceptions raised by hotstart.

Every error the checkpoint engine reports arrives as a subclass of :class:`HotstartError`
carrying the engine's whole message (which names the step, rank, tier, key or path concerned).
"""

from __future__ import annotations

__all__ = [
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


class HotstartError(Exception):
    """Base class of every hotstart error."""


class ConfigError(HotstartError, ValueError):
    """A configuration that cannot be used: no tier, a bad job name, rank or store URL."""


class StateDictError(HotstartError, ValueError):
    """A state dict that cannot be saved, or that does not match the checkpoint it is loaded
    from (missing or unexpected keys, another shape or dtype); the message names the key."""


class CorruptCheckpoint(HotstartError):
    """No tier holds a copy of the checkpoint whose bytes match their checksums, or its manifest
    or header cannot be decoded."""


class NoCheckpoint(HotstartError, LookupError):
    """No complete checkpoint (or not the step asked for)."""


class StoreError(HotstartError, OSError):
    """The object store or the local disk failed (after the engine's retries)."""


class TierUnavailable(StoreError):
    """A tier that may hold the checkpoint cannot be read (the store is down, a directory cannot
    be listed), so which steps exist is unknown: ``latest_step()``, ``steps()`` and ``load()``
    raise this instead of answering "none". Nothing was loaded; retry once the tier is back (or
    leave it out of the configuration). The message names the tier and the cause."""


class SidecarError(HotstartError, ConnectionError):
    """The node's sidecar (``hotstart serve``) could not be reached, refused a request, or went
    away with a step it had not committed yet. A save waits up to 60 s for a sidecar that is
    restarting before it raises this; start the sidecar (or fix ``HOTSTART_SOCKET``)."""


class StepInFlight(HotstartError):
    """``save()`` of a step whose earlier save by this process is not over: a step is written
    by one save at a time. Wait for the first handle (``wait()``), or save another step."""


class SecondWriter(HotstartError):
    """Another live process on this node saves the same job and rank; the message names it
    (process id, host). Stop it, or give this process another job name or rank."""


class SaveSkipped(HotstartError):
    """The save was dropped because ``max_inflight`` saves were in flight and
    ``when_full="skip"``."""


class CudaError(HotstartError):
    """A CUDA tensor that cannot be served: no CUDA driver, no such device, a build without CUDA
    support, or a failed driver call."""


class InstallFailed(HotstartError):
    """``hotstart.env.ensure``: the install command failed; nothing was published and what it
    left at the target was removed. ``returncode`` is its exit status (128 + the signal number
    when a signal killed it)."""

    def __init__(self, message: str, returncode: int) -> None:
        super().__init__(message)
        self.returncode = returncode


class TargetInUse(HotstartError, FileExistsError):
    """``hotstart.env.ensure``: the target exists and was not made by ``ensure`` on this node;
    it is left alone."""


class CorruptSnapshot(HotstartError):
    """``hotstart.env.ensure``: a stored snapshot (record, tree or chunk) failed verification;
    nothing was left at the target."""
