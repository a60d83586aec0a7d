"""torch.distributed.checkpoint storage backends over the hotstart engine.

    import torch.distributed.checkpoint as dcp
    from hotstart.torch import StorageReader, StorageWriter

    dcp.save(state, storage_writer=StorageWriter(store="s3://bucket/runs", job="run-42"),
             checkpoint_id=step)
    future = dcp.async_save(state, storage_writer=StorageWriter(...), checkpoint_id=step)
    dcp.load(state, storage_reader=StorageReader(store="s3://bucket/runs", job="run-42"),
             checkpoint_id=step)

**Layout.** A DCP checkpoint is one engine step of the job: each rank saves the items DCP
assigns it as one safetensors file and manifest (``<job>/step-<N>/rank-<R>.*``), every chunk
checksummed; the checkpoint id is the step (an int, or a string of digits). DCP's global
``Metadata`` (pickled, as DCP's own file system writer stores it) travels as an extra of the
coordinator's manifest.

**Commit.** Every rank other than the coordinator waits in ``write_data`` until its files are
persisted in every configured tier. The coordinator saves its own items only in ``finish``,
after DCP has gathered every rank's results, together with the metadata: its manifest is the
last object written, so a checkpoint whose metadata can be read is complete.

**Loading with another world size.** The reader takes the saved world size from the
coordinator's manifest and reads, for each saved rank its plan needs, that rank's file
(verified chunk by chunk) through an engine opened as that rank. A stored item that a read
request covers whole lands straight in the destination tensor (CPU or CUDA, when contiguous),
and so does a region of it that is one run of its bytes (a shard of its first dimension, as
FSDP's resharding asks for) into a contiguous CPU tensor; otherwise the stored tensor is read
into a temporary and the requested region copied out. Into host memory, only the chunks of a
file that hold what the plan reads (and its header) are read. So a checkpoint saved by 2 ranks
loads on 1 rank, or on 4. Into host memory, the saved ranks a plan needs are read at once,
each on a thread of its own: a rank that takes one saved rank's part from a peer reads
another's from its own node meanwhile.

**Which step.** ``dcp.load`` with a ``checkpoint_id`` loads that step; without one (and no
``step=``), the newest complete checkpoint of the job, whatever world size saved it
(:func:`latest_step`), so a job that comes back with another number of ranks finds the
checkpoint that DCP reshards for it. :func:`load` does the same and goes back a checkpoint,
every rank together, while the chosen one cannot be read (damaged or gone in every tier for
some rank): a restart would otherwise choose it again, and fail again, every time.

Use a job name of its own for DCP checkpoints (not one a ``Checkpointer`` also writes to).
"""

from __future__ import annotations

import io
import os
import pickle
import warnings
from concurrent import futures
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader as _StorageReader
from torch.distributed.checkpoint.storage import StorageWriter as _StorageWriter
from torch.distributed.checkpoint.state_dict_loader import load as _dcp_load
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future

from . import _core, _state
from ._checkpointer import PathLike, engine_options, integer
from .errors import ConfigError, CorruptCheckpoint, HotstartError, NoCheckpoint

__all__ = ["StorageWriter", "StorageReader", "StoredItem", "empty_optimizer_state", "latest_step", "load"]

METADATA_KEY = "hotstart.dcp.metadata"
"""The coordinator's extra holding DCP's pickled Metadata."""

CheckpointId = Union[int, str, "os.PathLike[str]"]

READ_THREADS = 8
"""At most this many saved ranks' shards are read at once by one rank's load (into host
memory)."""


@dataclass(frozen=True)
class StoredItem:
    """Where DCP finds one saved item: the rank whose file holds it, the tensor's name in that
    file, and the torch dtype and shape it was saved with (bytes items: dtype "bytes")."""

    rank: int
    name: str
    dtype: str
    shape: Tuple[int, ...]


def _step_of(checkpoint_id: Optional[CheckpointId], default: Optional[int]) -> int:
    if checkpoint_id is None:
        if default is None:
            raise ConfigError("no step: pass checkpoint_id=<step> to dcp, or step=... here")
        return default
    text = os.fspath(checkpoint_id) if not isinstance(checkpoint_id, int) else str(checkpoint_id)
    # A path's last component names the step (trainers pass `<folder>/step-N`); where it goes
    # is the writer's store and job.
    text = os.path.basename(str(text).rstrip("/"))
    text = text[len("step-"):] if text.startswith("step-") else text
    if not text.isdigit():
        raise ConfigError(f"checkpoint_id {checkpoint_id!r} is not a step number (like 100 or 'step-100')")
    return integer("checkpoint_id", int(text))


def _probe(store: Optional[str], job: Optional[str], local_dir: Optional[PathLike],
           sidecar: Optional[PathLike] = None, threads: int = 0) -> _core.Engine:
    """An engine over the job's tiers (through the node's sidecar when there is one) that finds
    and reads its checkpoints' manifests: any rank will do (a manifest names its own world
    size)."""
    return _core.Engine(**engine_options(store, job, 0, 1, local_dir, sidecar, threads=threads))


def latest_step(store: Optional[str] = None, job: Optional[str] = None, *,
                local_dir: Optional[PathLike] = None, sidecar: Optional[PathLike] = None) -> Optional[int]:
    """The newest complete checkpoint of ``job`` (every rank of the world size that saved it
    committed it), whatever world size saved it, or None: the step ``dcp.load`` with a
    :class:`StorageReader` and no ``checkpoint_id`` loads. ``store``, ``job``, ``local_dir`` and
    ``sidecar`` are those of the writer (with the same environment defaults); with a sidecar,
    the steps in its memory and its peers' count too."""
    found = _probe(store, job, local_dir, sidecar).latest_checkpoint()
    return None if found is None else found[0]


def empty_optimizer_state(optimizer: torch.optim.Optimizer) -> bool:
    """Gives a freshly built optimizer the per-parameter state tensors that a checkpoint load
    then fills in place, without running a step; True when it did.

    A new optimizer has no per-parameter state until its first step, so its ``state_dict()``
    has nothing for a checkpoint's optimizer state to load into. torch's
    ``get_state_dict(model, optimizer)`` creates that state by running one step on zero
    gradients, which reads and writes every byte of the parameters and the state (seconds for
    GiBs on a CPU). For :class:`torch.optim.Adam`, :class:`torch.optim.AdamW` and
    :class:`torch.optim.SGD` (with momentum) this makes the same tensors (``step``,
    ``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq`` with amsgrad; ``momentum_buffer``), with
    the shapes, dtypes, devices and DTensor placements torch's step would give them, but
    **uninitialized**: load a checkpoint into them before the next step (``ck.load(state)``
    after ``get_state_dict``, or ``dcp.load``). For other optimizers, or one that already has
    state or gradients, it does nothing and returns False (``get_state_dict`` then creates the
    state its own way).

        model, opt = build()
        hotstart.torch.empty_optimizer_state(opt)
        model_sd, optim_sd = get_state_dict(model, opt)
        ck.load({"model": model_sd, "optim": optim_sd})
        set_state_dict(model, opt, model_state_dict=model_sd, optim_state_dict=optim_sd)
    """
    kind = type(optimizer)
    if kind not in (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD) or optimizer.state:
        return False
    groups = optimizer.param_groups
    if any(p.grad is not None for g in groups for p in g["params"]):
        return False
    for g in groups:
        for p in g["params"]:
            if not p.requires_grad:
                continue
            if kind is torch.optim.SGD:
                if g.get("momentum", 0) != 0:
                    optimizer.state[p] = {"momentum_buffer": torch.empty_like(p, memory_format=torch.preserve_format)}
                continue
            # As torch.optim.Adam's lazy initialization makes them.
            fused, capturable = bool(g.get("fused")), bool(g.get("capturable"))
            if fused or capturable:
                step = torch.zeros((), dtype=torch.float32, device=p.device)
            else:
                scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
                step = torch.tensor(0.0, dtype=scalar, device="cpu")
            state: Dict[str, Any] = {
                "step": step,
                "exp_avg": torch.empty_like(p, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.empty_like(p, memory_format=torch.preserve_format),
            }
            if g.get("amsgrad"):
                state["max_exp_avg_sq"] = torch.empty_like(p, memory_format=torch.preserve_format)
            optimizer.state[p] = state
    return len(optimizer.state) > 0


def _agreed(find: Callable[[], Optional[Tuple[int, int]]]) -> Optional[int]:
    """The step of the checkpoint ``find`` names on rank 0 of the default process group (when
    there is one), shared with every rank, so that all of them load the same step."""
    found: Any
    try:
        newest = find()
        found = None if newest is None else newest[0]
    except Exception as e:  # every rank must take part in the broadcast below
        found = e
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        box = [found if dist.get_rank() == 0 else None]
        dist.broadcast_object_list(box, src=0)
        found = box[0]
    if isinstance(found, Exception):
        raise found
    return None if found is None else int(found)


def _agreed_newest(probe: _core.Engine) -> int:
    """The newest complete step, agreed by every rank (see :func:`_agreed`)."""
    found = _agreed(probe.latest_checkpoint)
    if found is None:
        raise NoCheckpoint(
            f"no complete checkpoint of job {probe.job!r} to load: save one first, or pass "
            "checkpoint_id=<step> to dcp.load"
        )
    return found


def _causes(e: BaseException) -> List[BaseException]:
    """What failed ``dcp.load`` on each rank (DCP gathers them into one exception)."""
    if isinstance(e, CheckpointException):
        return [f[0] if isinstance(f, tuple) else f for f in e.failures.values()]
    return [e]


def _unreadable(e: BaseException) -> bool:
    """Whether a failed ``dcp.load`` failed only because checkpoint data could not be read (a
    rank's chunks damaged or gone in every tier), on whichever ranks it failed."""
    causes = _causes(e)
    return bool(causes) and all(isinstance(c, (CorruptCheckpoint, NoCheckpoint)) for c in causes)


def load(
    state_dict: Dict[str, Any],
    store: Optional[str] = None,
    job: Optional[str] = None,
    *,
    local_dir: Optional[PathLike] = None,
    sidecar: Optional[PathLike] = None,
    threads: int = 0,
    planner: Optional[LoadPlanner] = None,
) -> int:
    """``dcp.load(state_dict)`` from the newest complete checkpoint of ``job`` (whatever world
    size saved it), going back while it cannot be read; returns the step loaded.

    When the load fails because some rank's part of the chosen checkpoint is damaged or gone in
    every tier, rank 0 names the newest complete checkpoint older than it, and every rank loads
    that one, until one loads. With none left (or none saved) it raises :class:`NoCheckpoint`;
    ``state_dict`` may then hold part of a checkpoint, so build the state afresh. Any other
    failure is raised as
    ``dcp.load`` raises it. Collective, as ``dcp.load`` is: every rank of the default process
    group calls it. ``store``, ``job``, ``local_dir``, ``sidecar`` and ``threads`` are
    :class:`StorageReader`'s.
    """
    probe = _probe(store, job, local_dir, sidecar, threads)
    newest = _agreed(probe.latest_checkpoint)
    if newest is None:
        raise NoCheckpoint(f"no complete checkpoint of job {probe.job!r} to load: save one first")
    step = newest
    while True:
        try:
            _dcp_load(state_dict, storage_reader=StorageReader(
                store, job, step=step, local_dir=local_dir, sidecar=sidecar, threads=threads),
                planner=planner)
            return step
        except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
            if not _unreadable(e):
                raise
            cause = e
        older = _agreed(lambda: probe.latest_checkpoint_below(step))
        if older is None:
            why = "; ".join(sorted({str(c) for c in _causes(cause)}))
            raise NoCheckpoint(
                f"checkpoint {step} of job {probe.job!r} cannot be read ({why}) and no "
                "complete checkpoint is older: start from a freshly built state"
            ) from cause
        step = older


def _numel(shape: Any) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _contiguous_at(shape: Tuple[int, ...], offsets: Any, lengths: Any) -> Optional[int]:
    """The element offset of a region (``offsets``, ``lengths``) of a row-major tensor of
    ``shape`` when the region is one contiguous run of its elements, else None: every dimension
    after the first one the region narrows is whole, and every one before it has length 1."""
    dims = len(shape)
    k = next((d for d in range(dims) if offsets[d] != 0 or lengths[d] != shape[d]), dims)
    if any(lengths[d] != 1 for d in range(k)):
        return None
    if any(offsets[d] != 0 or lengths[d] != shape[d] for d in range(k + 1, dims)):
        return None
    at, stride = 0, 1
    for d in reversed(range(dims)):
        at += int(offsets[d]) * stride
        stride *= int(shape[d])
    return at


def _item_name(item: Any) -> str:
    """The tensor name of a write item in its rank's file: the fully qualified name, followed
    for a shard by ``@`` and its offsets (``layer.w@4,0``)."""
    index = item.index
    if item.type != WriteItemType.SHARD or index.offset is None:
        return str(index.fqn)
    return f"{index.fqn}@{','.join(str(o) for o in index.offset)}"


def _sync(devices: "set[int]") -> None:
    for d in sorted(devices):
        torch.cuda.synchronize(d)


class StorageWriter(_StorageWriter):
    """Writes torch.distributed.checkpoint checkpoints as hotstart engine steps.

    ``store``, ``job``, ``local_dir``, ``sidecar`` and the tuning keywords are those of
    :class:`hotstart.Checkpointer` (with the same environment defaults); rank and world size come
    from the process group DCP saves with. ``step`` is used when ``dcp.save`` gets no
    ``checkpoint_id``.
    """

    def __init__(
        self,
        store: Optional[str] = None,
        job: Optional[str] = None,
        *,
        step: Optional[int] = None,
        local_dir: Optional[PathLike] = None,
        sidecar: Optional[PathLike] = None,
        keep: int = 3,
        max_inflight: int = 2,
        chunk_size: Optional[int] = None,
        threads: int = 0,
    ) -> None:
        super().__init__()
        self._opts = dict(store=store, job=job, local_dir=local_dir, sidecar=sidecar, keep=keep,
                          max_inflight=max_inflight, chunk_size=chunk_size, threads=threads)
        # Resolve now, so a bad configuration fails at construction.
        engine_options(rank=0, world_size=1, **self._opts)  # type: ignore[arg-type]
        self._default_step = None if step is None else integer("step", step)
        self.step: Optional[int] = self._default_step
        self._engine: Optional[_core.Engine] = None
        self._coordinator = False
        self._rank = 0
        self._deferred: Optional[Tuple[List[Any], List[Any]]] = None

    def reset(self, checkpoint_id: Optional[CheckpointId] = None) -> None:
        self.step = _step_of(checkpoint_id, self._default_step)
        self._deferred = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Union[str, "os.PathLike[str]"]) -> bool:
        # Never picked automatically: pass storage_writer=StorageWriter(...) to dcp.
        return False

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._coordinator = is_coordinator
        if dist.is_available() and dist.is_initialized():
            rank, world = dist.get_rank(), dist.get_world_size()
        else:
            rank, world = 0, 1
        rank = kwargs.get("rank", rank)
        if self._engine is None or (self._engine.rank, self._engine.world_size) != (rank, world):
            self._engine = _core.Engine(**engine_options(rank=rank, world_size=world, **self._opts))  # type: ignore[arg-type]
        self._rank = rank

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: List[SavePlan]) -> List[SavePlan]:
        return plans

    def storage_meta(self) -> Optional[StorageMeta]:
        return StorageMeta(checkpoint_id=None if self.step is None else str(self.step))

    def _resolve(self, plan: SavePlan, planner: SavePlanner) -> Tuple[List[Any], List[Any], List[WriteResult], "set[int]"]:
        specs: List[Any] = []
        keep: List[Any] = []
        results: List[WriteResult] = []
        devices: "set[int]" = set()
        for item in plan.items:
            name = _item_name(item)
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                raw = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
                t = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
                info = StoredItem(self._rank, name, "bytes", (len(raw),))
            else:
                assert isinstance(data, torch.Tensor)
                t = data.detach()
                info = StoredItem(self._rank, name, str(t.dtype).replace("torch.", ""), tuple(t.shape))
            mem = _state.torch_mem(t, name)
            if mem.device >= 0:
                devices.add(mem.device)
            specs.append((name, mem.dtype, mem.shape, mem.ptr, mem.nbytes, mem.device))
            keep.append(mem.owner)
            results.append(WriteResult(index=item.index, size_in_bytes=mem.nbytes, storage_data=info))
        return specs, keep, results, devices

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> "Future[List[WriteResult]]":
        if self.step is None:
            self.reset(None)
        specs, keep, results, devices = self._resolve(plan, planner)
        if self._coordinator:
            # Saved in finish(), with the metadata, once every other rank is durable.
            self._deferred = (specs, keep)
        else:
            _sync(devices)
            self._save(specs, keep, {})
        fut: Future[List[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _save(self, specs: List[Any], keep: List[Any], extras: Dict[str, bytes]) -> None:
        assert self._engine is not None and self.step is not None
        handle = self._engine.save(self.step, specs, extras, keep)
        # Staged and persisted in every tier, or raises; except that a replica no peer could
        # take is a warning: the step is in this node's tiers, and training goes on, as it does
        # through a Checkpointer (docs/SEMANTICS.md, network partitions).
        handle.wait_staged()
        for tier in self._engine.tiers:
            try:
                handle.wait_persisted(tier)
            except HotstartError as e:
                if tier != "peer":
                    raise
                warnings.warn(f"step {self.step}: no peer holds a replica of rank {self._rank}'s "
                              f"shard, which is in this node's other tiers: {e}", RuntimeWarning,
                              stacklevel=2)

    def finish(self, metadata: Metadata, results: List[List[WriteResult]]) -> None:
        storage: Dict[MetadataIndex, Any] = {}
        for rank_results in results:
            for r in rank_results:
                storage[r.index] = r.storage_data
        metadata.storage_data = storage
        specs, keep = self._deferred or ([], [])
        self._deferred = None
        _sync({s[5] for s in specs if s[5] >= 0})
        self._save(specs, keep, {METADATA_KEY: pickle.dumps(metadata)})


class StorageReader(_StorageReader):
    """Reads checkpoints written by :class:`StorageWriter`, with any world size.

    ``store``, ``job`` and ``local_dir`` name the same tiers the writer used. ``step`` is used
    when ``dcp.load`` gets no ``checkpoint_id``; with neither, the newest complete checkpoint is
    loaded, whatever world size saved it (:func:`latest_step`; rank 0 finds it and every rank of
    the default process group loads that step).

    ``sidecar`` (default ``HOTSTART_SOCKET``) is the node's ``hotstart serve``: the saved ranks'
    shards this rank needs then come from the nearest holder the sidecar knows, its own memory,
    a peer's memory, a disk, the store last, every chunk verified. From a peer's memory only the
    chunks that hold the ranges this rank reads cross the network; a shard read whole, or from a
    disk or the store, stays in the sidecar's memory for the node's other ranks. So a job that
    comes back with another number of ranks reshards from the cluster's memory.
    :attr:`loaded_from` says where each chunk read of each saved rank came from.
    """

    def __init__(
        self,
        store: Optional[str] = None,
        job: Optional[str] = None,
        *,
        step: Optional[int] = None,
        local_dir: Optional[PathLike] = None,
        sidecar: Optional[PathLike] = None,
        threads: int = 0,
    ) -> None:
        super().__init__()
        self._probe = _probe(store, job, local_dir, sidecar, threads)
        self.loaded_from: Dict[int, List[str]] = {}
        """Saved rank → the tier each chunk of its shard came from, in file order (``"memory"``,
        ``"peer"``, ``"disk"``, ``"store"``), for the ranks the last ``read_data`` read."""
        self._default_step = None if step is None else integer("step", step)
        self.step: Optional[int] = self._default_step
        self._world_size = 0
        self._readers: Dict[int, _core.Engine] = {}
        self._storage: Dict[MetadataIndex, StoredItem] = {}

    def reset(self, checkpoint_id: Optional[CheckpointId] = None) -> None:
        if checkpoint_id is None and self._default_step is None:
            self.step = _agreed_newest(self._probe)
        else:
            self.step = _step_of(checkpoint_id, self._default_step)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Union[str, "os.PathLike[str]"]) -> bool:
        return False

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self.step is None:
            self.reset(None)
        assert self.step is not None
        m = self._probe.manifest(self.step, 0)
        raw = m["extras"].get(METADATA_KEY)
        if raw is None:
            raise CorruptCheckpoint(
                f"step {self.step} of job {self._probe.job!r} was not written by "
                "hotstart.torch.StorageWriter (no DCP metadata in rank 0's manifest)"
            )
        metadata = pickle.loads(raw)
        if not isinstance(metadata, Metadata):
            raise CorruptCheckpoint(f"step {self.step}: the DCP metadata does not unpickle to Metadata")
        self._world_size = int(m["world_size"])
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if metadata.storage_data is None:
            raise CorruptCheckpoint(f"step {self.step}: DCP metadata without storage data")
        self._storage = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: List[LoadPlan]) -> List[LoadPlan]:
        return plans

    def _reader(self, rank: int) -> _core.Engine:
        if rank not in self._readers:
            self._readers[rank] = self._probe.reader(rank, self._world_size)
        return self._readers[rank]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> "Future[None]":
        assert self.step is not None
        by_rank: Dict[int, List[ReadItem]] = {}
        for req in plan.items:
            info = self._storage.get(req.storage_index)
            if not isinstance(info, StoredItem):
                raise CorruptCheckpoint(f"step {self.step}: no stored item for {req.storage_index}")
            by_rank.setdefault(info.rank, []).append(req)
        staged = [self._stage(rank, reqs, planner) for rank, reqs in sorted(by_rank.items())]
        readers = [self._reader(s.rank) for s in staged]
        # Into host memory, each saved rank on a thread of its own (the engine lets go of the
        # GIL while it reads): a rank that takes one saved rank's part from a peer reads
        # another's from its own node meanwhile. Into device memory, one at a time.
        host = not any(s.plan.cuda_devices for s in staged)
        at_once = max(1, min(len(staged), READ_THREADS)) if host else 1
        with futures.ThreadPoolExecutor(max_workers=at_once, thread_name_prefix="hotstart-dcp-read") as pool:
            reads = [pool.submit(_load_rank, r, self.step, s.plan) for r, s in zip(readers, staged)]
        # Every read has ended (the pool's exit waits for them all): none writes into a
        # destination once this raises.
        for s, read in zip(staged, reads):
            self.loaded_from[s.rank] = read.result()
        for s in staged:
            self._finish(s, planner)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _stage(self, rank: int, reqs: List[ReadItem], planner: LoadPlanner) -> "_RankRead":
        """Where ``reqs`` (items of saved rank ``rank``) land: in place, or in temporaries the
        requested regions are copied out of once read."""
        users: Dict[str, int] = {}
        for req in reqs:
            name = self._storage[req.storage_index].name
            users[name] = users.get(name, 0) + 1
        plan = _state.Plan()
        temps: Dict[str, torch.Tensor] = {}
        finish: List[Tuple[ReadItem, Optional[torch.Tensor]]] = []
        for req in reqs:
            info = self._storage[req.storage_index]
            if req.type == LoadItemType.BYTE_IO:
                if info.name not in temps:
                    temps[info.name] = torch.empty(info.shape, dtype=torch.uint8)
                finish.append((req, None))
                continue
            target = planner.resolve_tensor(req).detach()
            whole = all(o == 0 for o in req.storage_offsets) and tuple(req.lengths) == info.shape
            direct = _state._direct_mem(target)
            if (users[info.name] == 1 and direct is not None
                    and str(target.dtype).replace("torch.", "") == info.dtype
                    and target.numel() == _numel(req.lengths)
                    and not (direct.device < 0 and plan._overlaps(direct.ptr, direct.nbytes))):
                if whole:
                    plan.into(info.name, direct)
                    finish.append((req, target))
                    continue
                at = _contiguous_at(info.shape, req.storage_offsets, req.lengths)
                if at is not None and direct.device < 0:
                    # The requested region is one run of the stored tensor's bytes (a shard of
                    # its first dimension, say): it lands in place, with no copy in between.
                    plan.region(info.name, at * target.element_size(), direct)
                    finish.append((req, target))
                    continue
            if info.name not in temps:
                dtype = getattr(torch, info.dtype)
                temps[info.name] = torch.empty(info.shape, dtype=dtype)
            finish.append((req, target))
        for name, t in temps.items():
            plan.into(name, _state._dest_mem(t))
        return _RankRead(rank, plan, temps, finish)

    def _finish(self, staged: "_RankRead", planner: LoadPlanner) -> None:
        """Hands ``staged``'s items, read, to ``planner``: bytes, the regions read into
        temporaries, and every tensor committed."""
        from torch.distributed._shard._utils import narrow_tensor_by_index

        for req, dst in staged.finish:
            info = self._storage[req.storage_index]
            if dst is None:
                planner.load_bytes(req, io.BytesIO(staged.temps[info.name].numpy().tobytes()))
                continue
            target = dst
            if info.name in staged.temps:
                src: torch.Tensor = narrow_tensor_by_index(staged.temps[info.name], req.storage_offsets, req.lengths)
                if src.size() != target.size():
                    raise CorruptCheckpoint(
                        f"step {self.step}: {req.storage_index.fqn}: stored region {tuple(src.size())} "
                        f"does not fit the destination {tuple(target.size())}"
                    )
                target.copy_(src)
            planner.commit_tensor(req, target)


@dataclass
class _RankRead:
    """One saved rank's part of a load plan: its destinations, the temporaries among them, and
    each item with the tensor it is committed as (``None``: bytes)."""

    rank: int
    plan: "_state.Plan"
    temps: Dict[str, torch.Tensor]
    finish: List[Tuple[ReadItem, Optional[torch.Tensor]]]


def _load_rank(reader: _core.Engine, step: int, plan: "_state.Plan") -> List[str]:
    _sync(plan.cuda_devices)
    return reader.load(step, plan.dests)
