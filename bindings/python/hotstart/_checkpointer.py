"""The Checkpointer: asynchronous checkpoints of state dicts from a training loop."""

from __future__ import annotations

import operator
import os
import sys
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

from . import _core
from . import _mapped, _state
from .errors import ConfigError, HotstartError, NoCheckpoint, SaveSkipped

PathLike = Union[str, "os.PathLike[str]"]


def _env_int(name: str) -> Optional[int]:
    v = os.environ.get(name)
    if v is None or v == "":
        return None
    try:
        return int(v)
    except ValueError:
        raise ConfigError(f"{name}={v!r} is not an integer") from None


def integer(name: str, value: Any, low: int = 0, bits: int = 64) -> int:
    """``value`` as an int from ``low`` to 2**bits-1 (numpy integers too, bools not), or a
    ConfigError that names ``name``: a bad number is refused here, before the engine sees it."""
    if not isinstance(value, bool):
        try:
            v = operator.index(value)
        except TypeError:
            pass
        else:
            if low <= v < 1 << bits:
                return v
    raise ConfigError(f"{name} {value!r}: expected an integer from {low} to 2**{bits}-1")


def resolve_rank(rank: Optional[int], world_size: Optional[int]) -> Tuple[int, int]:
    """Rank and world size: given, else an initialised torch.distributed, else RANK and
    WORLD_SIZE, else 0 of 1."""
    if rank is not None and world_size is not None:
        return rank, world_size
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        r, w = dist.get_rank(), dist.get_world_size()
    else:
        r = _env_int("RANK")
        w = _env_int("WORLD_SIZE")
        r = 0 if r is None else r
        w = 1 if w is None else w
    return (r if rank is None else rank), (w if world_size is None else world_size)


def engine_options(
    store: Optional[str],
    job: Optional[str],
    rank: Optional[int],
    world_size: Optional[int],
    local_dir: Optional[PathLike],
    sidecar: Optional[PathLike] = None,
    **tuning: Any,
) -> Dict[str, Any]:
    """Keyword arguments of `_core.Engine`, with every default resolved from the environment
    (the sidecar's too, when ``sidecar`` is None and ``HOTSTART_SOCKET`` is set)."""
    store = store if store is not None else (os.environ.get("HOTSTART_STORE") or None)
    if local_dir is None:
        local_dir = os.environ.get("HOTSTART_LOCAL_DIR") or None
    job = job if job is not None else (os.environ.get("HOTSTART_JOB") or None)
    if job is None:
        raise ConfigError("no job name: pass job=... or set HOTSTART_JOB")
    if sidecar is None:
        sidecar = os.environ.get("HOTSTART_SOCKET") or None
    if store is None and local_dir is None and sidecar is None:
        raise ConfigError(
            "nowhere to save: pass sidecar=... (the socket of `hotstart serve`), store=... (a "
            "store URL) and/or local_dir=..., or set HOTSTART_SOCKET / HOTSTART_STORE / "
            "HOTSTART_LOCAL_DIR"
        )
    r, w = resolve_rank(rank, world_size)
    r, w = integer("rank", r, 0, 32), integer("world_size", w, 1, 32)
    for name, low, bits in (
        ("keep", 0, 64), ("max_inflight", 1, 64), ("chunk_size", 1, 31), ("threads", 0, 64)
    ):
        if tuning.get(name) is not None:
            tuning[name] = integer(name, tuning[name], low, bits)
    if "when_full" in tuning and tuning["when_full"] not in ("block", "skip"):
        raise ConfigError(f'when_full={tuning["when_full"]!r}: expected "block" or "skip"')
    opts: Dict[str, Any] = dict(job=job, rank=r, world_size=w, store=store, **tuning)
    opts["local_dir"] = None if local_dir is None else os.fspath(local_dir)
    opts["sidecar"] = None if sidecar is None else os.fspath(sidecar)
    return opts


def _sync_cuda(devices: "set[int]") -> None:
    """Finishes the work queued on `devices`, so the engine copies what the caller sees."""
    if devices:
        import torch

        for d in sorted(devices):
            torch.cuda.synchronize(d)


SaveHandle = _core.SaveHandle


class Checkpointer:
    """Saves and loads the state dicts of one rank of a training job.

    ``sidecar`` is the Unix socket of the node's sidecar (``hotstart serve``; default
    ``HOTSTART_SOCKET``): saves are staged straight into its shared memory, which survives a
    crash of this process, and the sidecar replicates them to peers and persists them; a
    restore comes from the nearest tier that holds the step (this node's memory, a peer, disk,
    store). ``store`` is a store URL (``s3://bucket/prefix``, ``file:///path``, a plain
    directory) for the object-store tier; ``local_dir`` a local directory for the disk tier
    (io_uring, ``O_DIRECT``); with a sidecar they are read only when it cannot be reached.
    At least one of the three is needed. ``job`` names the run; checkpoints live under
    ``<job>/step-<N>/``. ``rank`` and ``world_size`` default to an initialised
    torch.distributed, then ``RANK``/``WORLD_SIZE``, then 0 of 1. Environment defaults:
    ``HOTSTART_SOCKET``, ``HOTSTART_STORE``, ``HOTSTART_LOCAL_DIR``, ``HOTSTART_JOB``.

    ``keep`` complete steps are kept per tier (0 keeps all; default 3); with a sidecar, the
    sidecar's ``--keep`` decides instead (a ``keep`` given then warns). ``max_inflight`` saves may be
    staging or persisting at once, each holding a staging buffer as large as the state; when
    they are all busy, ``save`` blocks (``when_full="block"``) or drops the save
    (``"skip"``). ``chunk_size`` is the unit of checksums (bytes, default 64 MiB); ``threads``
    the copy and hash threads (0: one per core, at most 8). ``sidecar_wait`` is how long (s) a
    sidecar that is gone (restarting, or started with the job and not listening yet) is waited
    for: here, at a save, and at a read with no ``local_dir``/``store`` to go to instead.
    """

    def __init__(
        self,
        store: Optional[str] = None,
        job: Optional[str] = None,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
        *,
        keep: Optional[int] = None,
        local_dir: Optional[PathLike] = None,
        sidecar: Optional[PathLike] = None,
        max_inflight: int = 2,
        when_full: str = "block",
        chunk_size: Optional[int] = None,
        threads: int = 0,
        sidecar_wait: float = 60.0,
    ) -> None:
        if keep is None:
            keep = 3
        elif sidecar is not None or os.environ.get("HOTSTART_SOCKET"):
            warnings.warn(
                f"keep={keep} applies to this process's own local_dir/store tiers only; with a "
                "sidecar, retention is the sidecar's (`hotstart serve --keep`)",
                stacklevel=2,
            )
        opts = engine_options(
            store,
            job,
            rank,
            world_size,
            local_dir,
            sidecar,
            keep=keep,
            max_inflight=max_inflight,
            when_full=when_full,
            chunk_size=chunk_size,
            threads=threads,
            sidecar_wait=sidecar_wait,
        )
        self._engine: Optional[_core.Engine] = _core.Engine(**opts)
        self._pending: List[_core.SaveHandle] = []
        self._loaded_from: List[str] = []
        self._device_route: Optional[str] = None

    @property
    def engine(self) -> _core.Engine:
        if self._engine is None:
            raise HotstartError("the Checkpointer is closed")
        return self._engine

    @property
    def job(self) -> str:
        return self.engine.job

    @property
    def rank(self) -> int:
        return self.engine.rank

    @property
    def world_size(self) -> int:
        return self.engine.world_size

    def save(self, step: int, state_dict: Any) -> SaveHandle:
        """Starts saving ``state_dict`` as ``step`` and returns at once (unless ``max_inflight``
        saves are busy and ``when_full="block"``).

        The tensors are read where they are, without a copy of their own: do not change them
        until :meth:`SaveHandle.wait_staged` returns (call it before ``optimizer.step()``).
        Non-contiguous tensors and tensors on devices other than CPU and CUDA are copied to
        contiguous CPU memory inside this call. Persistence continues in the background; its
        failures are reported by the handle (``wait()``, ``exception()``) and by :meth:`close`,
        never raised here.

        Raises :class:`StepInFlight` when a save of the same step by this process is not over
        yet, :class:`SecondWriter` when another process on this node saves the same job and
        rank, :class:`StateDictError` for a state dict that cannot be saved. A step saved again
        once its first save is over replaces it. With a sidecar that is restarting, the save
        waits for it (up to ``sidecar_wait``) and hands it the step.
        """
        step = integer("step", step)
        # Files that retention deleted since are no longer kept by loaded tensors.
        _mapped.release_deleted()
        flat = _state.flatten(state_dict)
        _sync_cuda(flat.cuda_devices)
        extras = {_state.STATE_KEY: flat.tree}
        handle = self.engine.save(step, flat.tensors, extras, flat.keep)
        # Forget saves that finished well, and those skipped (when_full="skip": their handle
        # says so); failed ones stay for wait() to report.
        self._pending = [h for h in self._pending if not h.done() or _failed(h)]
        self._pending.append(handle)
        return handle

    def wait(self) -> None:
        """Waits for every save started so far to be staged, persisted in every tier and
        followed by retention; raises the first failure. A save skipped as ``when_full="skip"``
        asks is no failure: its handle reports it, and nothing here does."""
        pending, self._pending = self._pending, []
        first: Optional[BaseException] = None
        for h in pending:
            if _failed(h) and first is None:
                first = h.exception()
        self.engine.wait()
        if first is not None:
            raise first

    def latest_step(self, below: Optional[int] = None) -> Optional[int]:
        """The newest complete checkpoint of the job (every rank of the world size that saved
        it committed it in some tier), or None: also one saved with another world size, which
        :meth:`load` refuses with a ConfigError (load it with torch.distributed.checkpoint and
        :class:`hotstart.torch.StorageReader`, which reshards). :meth:`saved_world_size` says
        which.

        With ``below``, the newest step complete for this world size that is older than
        ``below``: where a job goes back to, every rank together, when one of its ranks cannot
        load the step it chose (``CorruptCheckpoint``: its copies are damaged in every tier).

        Raises :class:`TierUnavailable` when a tier cannot be read and no nearer tier holds a
        step (every save reaches the nearer tiers first, so a farther one cannot hold a newer
        step than they do): a store outage never reads as "no checkpoint"."""
        if below is not None:
            return self.engine.latest_step_below(integer("below", below))
        found = self.engine.latest_checkpoint()
        return None if found is None else found[0]

    def saved_world_size(self, step: int) -> int:
        """The world size that saved ``step`` (from its rank 0 manifest)."""
        return int(self.engine.manifest(integer("step", step), 0)["world_size"])

    def steps(self) -> List[int]:
        """Every step complete for this world size in some tier, ascending (through the sidecar
        when there is one). Raises :class:`TierUnavailable` when a tier cannot be read."""
        return self.engine.steps()

    def load(self, state_dict: Any = None, step: Optional[int] = None, *, strict: bool = True) -> Any:
        """Loads ``step`` (default: the newest complete one), verifying every byte.

        With ``state_dict``, its tensors and arrays are filled in place (dtype and shape must
        match; the error names the key), other values are replaced by the saved ones, and the
        same object is returned. ``strict`` requires the same keys on both sides. Without it, a
        new state dict of CPU tensors and numpy arrays is returned.

        New tensors and arrays are contiguous. Those of 1 MiB and more are views of one buffer
        that holds the whole file: a private, copy-on-write mapping of the file where it is on
        this machine (writing a tensor never changes the file; once retention deletes the file,
        the next :meth:`save` moves the mapping into memory of this process's own, so the file's
        space is freed). Smaller ones (RNG states, scalars, biases) own their memory, at offset 0
        of their storage, as ``torch.set_rng_state`` needs.

        Raises :class:`NoCheckpoint` when there is none, :class:`TierUnavailable` when a tier
        that may hold it cannot be read (never "none" then), :class:`CorruptCheckpoint` when no
        tier holds good bytes (a ``state`` filled in place then holds what was read, the bad
        bytes included: re-initialize it or load another step into it), :class:`StateDictError`
        on a mismatch (before anything is read).
        """
        engine = self.engine
        if step is not None:
            step = integer("step", step)
        plan = _state.Plan()
        made: List[Callable[[], Any]] = []

        def place(manifest: "_core._Manifest", fd: Optional[int]) -> Any:
            # Called once the step is found, before any of its bytes are read; `fd`: the step's
            # file on this machine, open for this call only.
            where = f"step {manifest['step']} rank {engine.rank}"
            root = _state.parse_tree(manifest["extras"], where)
            if root is None:
                root = _state.flat_tree(manifest["tensors"])
            if state_dict is None:
                made.append(_state.plan_file(root, plan, manifest, fd))
            else:
                made.append(_state.plan_into(root, state_dict, strict, plan))
            _sync_cuda(plan.cuda_devices)
            return plan.file or plan.dests

        try:
            _, self._loaded_from, self._device_route = engine.restore(step, place)
        except NoCheckpoint as e:
            if step is None:
                raise
            # Which steps there are, so that the error says what to load instead.
            try:
                have = self.steps()
            except HotstartError:
                raise e from None
            listed = ", ".join(map(str, have[-8:])) if have else "none"
            raise NoCheckpoint(
                f"{e}. Complete steps of this world size: {'…, ' if len(have) > 8 else ''}{listed}; "
                "load one of them, or leave step out to load the newest"
            ) from None
        for f in plan.after:
            f()
        return made[0]()

    @property
    def loaded_from(self) -> List[str]:
        """Where each chunk of the last :meth:`load` came from, in file order: ``"memory"``
        (this node's sidecar), ``"peer"``, ``"disk"`` or ``"store"`` (empty before a load)."""
        return list(self._loaded_from)

    @property
    def device_route(self) -> Optional[str]:
        """Who copied the last :meth:`load`'s bytes into CUDA tensors (None without any):
        ``"sidecar"`` (the node's sidecar, from its memory pinned for the GPU: the restarted
        process pins nothing), ``"process"`` (this process, through pinned buffers of its own),
        or ``"process (not the sidecar: …)"`` saying why the sidecar did not."""
        return self._device_route

    def close(self) -> None:
        """Waits for pending saves (raising the first failure), then releases the engine."""
        if self._engine is None:
            return
        try:
            self.wait()
        finally:
            self._engine = None

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self.close()
        else:
            # Do not hide the error that ended the block behind a save's failure.
            try:
                self.close()
            except HotstartError:
                pass

    def __repr__(self) -> str:
        if self._engine is None:
            return "Checkpointer(closed)"
        e = self._engine
        return f"Checkpointer(job={e.job!r}, rank={e.rank}, world_size={e.world_size}, tiers={e.tiers})"


def _failed(handle: Any) -> bool:
    """Whether a finished save failed: it raised something other than the skip that
    ``when_full="skip"`` asked for."""
    e = handle.exception()
    return e is not None and not isinstance(e, SaveSkipped)
