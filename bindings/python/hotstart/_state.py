"""State dicts to engine tensors and back.

A state dict is a tree: dicts (string or int keys), lists and tuples, whose leaves are torch
tensors, numpy arrays and scalars, bytes, or small Python values (None, bool, int, float, str).

**Saving** walks the tree in order. Each tensor leaf becomes one engine tensor named by its
path joined with ``.`` (``model.layer.0.weight``, ``optim.state.0.exp_avg``), described by
address and length so the engine's staging copy is the only copy: a contiguous CPU tensor or
array is borrowed as it is, a CUDA tensor goes to the engine's device path, and anything else
(non-contiguous, conjugate views, other devices) is first made contiguous on the CPU, a copy
that happens inside ``save()``. The tree itself, with every small value and, for each tensor, its
name, kind, exact dtype and shape, is one JSON document saved as the extra ``hotstart.state``.

Element types the safetensors format names (F64 ... BOOL) are stored as such, so standard tools
read the file. Every other dtype (complex, float8 variants safetensors lacks, numpy datetimes,
strings, big-endian, structured) is stored as its raw bytes (``U8``, one dimension) and the
exact dtype recorded in the tree, so it comes back bit-exact.

**Loading** reads the tree first (from the manifest, without touching the data), then either
lays out new tensors and arrays over one buffer that takes the whole file (a private mapping of
it where it is on this machine; tensors under ``OWN_BELOW`` bytes are copied out into memory of
their own), or checks the caller's (same dtype and shape, key by key), and has the engine read
and verify the data straight into that memory.
"""

from __future__ import annotations

import base64
import bisect
import json
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Set, Tuple

from . import _mapped
from .errors import StateDictError

STATE_KEY = "hotstart.state"
"""The extra holding the tree."""

TREE_VERSION = 1

# numpy descr -> engine dtype, for the element types safetensors names (little-endian).
_NUMPY_NATIVE = {
    "|b1": "BOOL",
    "|i1": "I8",
    "|u1": "U8",
    "<i2": "I16",
    "<u2": "U16",
    "<i4": "I32",
    "<u4": "U32",
    "<i8": "I64",
    "<u8": "U64",
    "<f2": "F16",
    "<f4": "F32",
    "<f8": "F64",
}
_NUMPY_FROM_ENGINE = {v: k for k, v in _NUMPY_NATIVE.items()}

_TORCH_NATIVE = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint64": "U64",
    "uint32": "U32",
    "uint16": "U16",
    "uint8": "U8",
    "bool": "BOOL",
}
_TORCH_FROM_ENGINE = {v: k for k, v in _TORCH_NATIVE.items()}


def _torch() -> Any:
    """torch when the process has imported it (a tensor can only exist if it has)."""
    return sys.modules.get("torch")


def _numpy() -> Any:
    return sys.modules.get("numpy")


def is_torch_tensor(x: object) -> bool:
    torch = _torch()
    return torch is not None and isinstance(x, torch.Tensor)


def _is_numpy(x: object) -> bool:
    np = _numpy()
    return np is not None and isinstance(x, (np.ndarray, np.generic))


def is_tensor(x: object) -> bool:
    """True for what is saved as a tensor: torch tensors, numpy arrays and numpy scalars."""
    return is_torch_tensor(x) or _is_numpy(x)


def key_str(path: Tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in path) if path else "<root>"


# --- tensors as memory --------------------------------------------------------------------


@dataclass
class Mem:
    """A tensor's bytes: engine dtype and shape, address, length, device (-1: host), and the
    object that owns the memory."""

    dtype: str
    shape: List[int]
    ptr: int
    nbytes: int
    device: int
    owner: Any


def _torch_leaf_dtype(t: Any, key: str) -> Tuple[str, Optional[str]]:
    """(engine dtype, raw dtype name or None when native) of a torch tensor."""
    name = str(t.dtype).replace("torch.", "")
    if t.is_quantized:
        raise StateDictError(f"{key}: quantized tensors ({name}) cannot be saved")
    native = _TORCH_NATIVE.get(name)
    return (native, None) if native else ("U8", name)


def torch_mem(t: Any, key: str) -> Mem:
    """The memory to save of a torch tensor; copies only when it must (see the module docs)."""
    torch = _torch()
    if t.layout != torch.strided:
        raise StateDictError(f"{key}: {t.layout} tensors cannot be saved; convert to dense")
    if t.device.type == "meta":
        raise StateDictError(f"{key}: meta tensors have no data")
    engine_dtype, raw = _torch_leaf_dtype(t, key)
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if t.device.type not in ("cpu", "cuda"):
        t = t.cpu()
    if not t.is_contiguous():
        t = t.contiguous()
    device = t.device.index if t.device.type == "cuda" else -1
    nbytes = t.numel() * t.element_size()
    shape = [nbytes] if raw else list(t.shape)
    return Mem(engine_dtype, shape, t.data_ptr(), nbytes, device, t)


def _numpy_leaf_dtype(a: Any, key: str) -> Tuple[Optional[str], str]:
    """(engine dtype or None when safetensors does not name the type, exact dtype as JSON) of
    a numpy array."""
    np = _numpy()
    if a.dtype.hasobject:
        raise StateDictError(f"{key}: numpy arrays of Python objects cannot be saved")
    descr = np.lib.format.dtype_to_descr(a.dtype)
    native = _NUMPY_NATIVE.get(descr) if isinstance(descr, str) else None
    return native, json.dumps(descr)


def numpy_mem(a: Any, key: str) -> Mem:
    np = _numpy()
    if isinstance(a, np.generic):
        a = np.asarray(a)
    native, _ = _numpy_leaf_dtype(a, key)
    if not a.flags.c_contiguous:
        a = np.ascontiguousarray(a)
    ptr = a.__array_interface__["data"][0]
    shape = list(a.shape) if native else [a.nbytes]
    return Mem(native or "U8", shape, ptr, a.nbytes, -1, a)


# --- saving -------------------------------------------------------------------------------


@dataclass
class Flat:
    """A state dict flattened for the engine: tensors in order, and the tree as JSON bytes."""

    tensors: List[Tuple[str, str, List[int], int, int, int]] = field(default_factory=list)
    keep: List[Any] = field(default_factory=list)
    tree: bytes = b""
    cuda_devices: Set[int] = field(default_factory=set)


def flatten(state: Any) -> Flat:
    flat = Flat()
    names: Dict[str, Tuple[Any, ...]] = {}

    def tensor(x: Any, path: Tuple[Any, ...]) -> Dict[str, Any]:
        key = key_str(path)
        name = ".".join(str(p) for p in path) or "tensor"
        if name in names:
            raise StateDictError(
                f"{key}: its tensor name {name!r} is also the name of {key_str(names[name])}; "
                "rename one of the keys"
            )
        names[name] = path
        if is_torch_tensor(x):
            mem = torch_mem(x, key)
            leaf = {
                "tensor": name,
                "kind": "torch",
                "dtype": str(x.dtype).replace("torch.", ""),
                "shape": list(x.shape),
                "device": str(x.device),
            }
            if mem.device >= 0:
                flat.cuda_devices.add(mem.device)
        else:
            np = _numpy()
            scalar = isinstance(x, np.generic)
            mem = numpy_mem(x, key)
            arr = mem.owner
            leaf = {
                "tensor": name,
                "kind": "numpy-scalar" if scalar else "numpy",
                "dtype": _numpy_leaf_dtype(arr, key)[1],
                "shape": list(arr.shape),
            }
        flat.tensors.append((name, mem.dtype, mem.shape, mem.ptr, mem.nbytes, mem.device))
        flat.keep.append(mem.owner)
        return leaf

    def walk(x: Any, path: Tuple[Any, ...]) -> Dict[str, Any]:
        if is_tensor(x):
            return tensor(x, path)
        if isinstance(x, dict):
            items = []
            for k, v in x.items():
                if isinstance(k, bool) or not isinstance(k, (str, int)):
                    raise StateDictError(
                        f"{key_str(path)}: key {k!r} of type {type(k).__name__}: "
                        "only str and int keys can be saved"
                    )
                items.append([k, walk(v, path + (k,))])
            return {"dict": items}
        if isinstance(x, list):
            return {"list": [walk(v, path + (i,)) for i, v in enumerate(x)]}
        if isinstance(x, tuple):
            return {"tuple": [walk(v, path + (i,)) for i, v in enumerate(x)]}
        if x is None or isinstance(x, (bool, int, float, str)):
            return {"value": x}
        if isinstance(x, (bytes, bytearray)):
            return {"bytes": base64.b64encode(bytes(x)).decode("ascii")}
        raise StateDictError(
            f"{key_str(path)}: a value of type {type(x).__name__} cannot be saved; "
            "state dicts hold tensors, arrays, dicts, lists, tuples, None, bool, int, float, "
            "str and bytes"
        )

    root = walk(state, ())
    doc = {"version": TREE_VERSION, "root": root}
    flat.tree = json.dumps(doc, allow_nan=True, separators=(",", ":")).encode()
    return flat


# --- loading ------------------------------------------------------------------------------


class Spans:
    """Byte ranges ``[start, end)``, kept sorted and merged where they overlap, so whether a new
    range overlaps any of them takes a binary search, not a pass over all (a load into a state
    of thousands of tensors asks once per tensor)."""

    def __init__(self) -> None:
        self.starts: List[int] = []
        self.ends: List[int] = []

    def overlaps(self, start: int, end: int) -> bool:
        # The ranges are disjoint and sorted, so their ends are sorted too: of those starting
        # before `end`, the last one reaches furthest.
        i = bisect.bisect_left(self.starts, end)
        return start < end and i > 0 and self.ends[i - 1] > start

    def add(self, start: int, end: int) -> None:
        if start >= end:
            return
        # The ranges [lo, hi) overlap the new one: they end after `start` and start before `end`.
        lo, hi = bisect.bisect_right(self.ends, start), bisect.bisect_left(self.starts, end)
        if lo < hi:
            start, end = min(start, self.starts[lo]), max(end, self.ends[hi - 1])
        self.starts[lo:hi], self.ends[lo:hi] = [start], [end]


@dataclass
class Plan:
    """What a load reads and where: destinations for the engine, copies and assignments to make
    once it has read."""

    dests: List[Tuple[str, int, int, int, Optional[int]]] = field(default_factory=list)
    keep: List[Any] = field(default_factory=list)
    after: List[Callable[[], None]] = field(default_factory=list)
    cuda_devices: Set[int] = field(default_factory=set)
    # (address, length, held) of one buffer that takes the whole file instead of `dests`;
    # held: a mapping of the file itself, verified where it lies.
    file: Optional[Tuple[int, int, bool]] = None
    # Host memory already used by a destination.
    _used: Spans = field(default_factory=Spans)

    def _overlaps(self, ptr: int, n: int) -> bool:
        return self._used.overlaps(ptr, ptr + n)

    def into(self, name: str, mem: Mem) -> None:
        """Read tensor `name` straight into `mem`."""
        if mem.device >= 0:
            self.cuda_devices.add(mem.device)
        else:
            self._used.add(mem.ptr, mem.ptr + mem.nbytes)
        self.dests.append((name, mem.ptr, mem.nbytes, mem.device, None))
        self.keep.append(mem.owner)

    def region(self, name: str, offset: int, mem: Mem) -> None:
        """Read the ``mem.nbytes`` bytes of tensor `name` from byte ``offset`` on straight into
        `mem` (host memory)."""
        self._used.add(mem.ptr, mem.ptr + mem.nbytes)
        self.dests.append((name, mem.ptr, mem.nbytes, -1, offset))
        self.keep.append(mem.owner)


def parse_tree(extras: Dict[str, bytes], where: str) -> Optional[Dict[str, Any]]:
    raw = extras.get(STATE_KEY)
    if raw is None:
        return None
    try:
        doc = json.loads(raw)
    except ValueError as e:
        raise StateDictError(f"{where}: extra {STATE_KEY!r} is not JSON: {e}") from None
    if not isinstance(doc, dict) or doc.get("version") != TREE_VERSION or "root" not in doc:
        raise StateDictError(f"{where}: extra {STATE_KEY!r} has an unknown layout")
    return doc["root"]  # type: ignore[no-any-return]


def flat_tree(tensors: List[Tuple[str, str, List[int]]]) -> Dict[str, Any]:
    """The tree of a checkpoint saved without one (by another engine user): a flat dict of
    numpy arrays, or torch tensors for the dtypes numpy lacks (BF16, F8)."""
    items = []
    for name, dtype, shape in tensors:
        leaf: Dict[str, Any] = {"tensor": name, "shape": shape}
        if dtype in _NUMPY_FROM_ENGINE:
            leaf.update(kind="numpy", dtype=json.dumps(_NUMPY_FROM_ENGINE[dtype]))
        else:
            leaf.update(kind="torch", dtype=_TORCH_FROM_ENGINE[dtype], device="cpu")
        items.append([name, leaf])
    return {"dict": items}


def _alloc(leaf: Dict[str, Any]) -> Any:
    """A new, uninitialised CPU tensor or array for a tensor leaf."""
    if leaf["kind"] == "torch":
        import torch

        return torch.empty(leaf["shape"], dtype=_torch_dtype(leaf))
    import numpy as np

    return np.empty(leaf["shape"], dtype=_numpy_dtype(leaf))


def _torch_dtype(leaf: Dict[str, Any]) -> Any:
    import torch

    dtype = getattr(torch, leaf["dtype"], None)
    if not isinstance(dtype, torch.dtype):
        raise StateDictError(f"unknown torch dtype {leaf['dtype']!r} (saved by a newer torch?)")
    return dtype


def _numpy_dtype(leaf: Dict[str, Any]) -> Any:
    import numpy as np

    return np.lib.format.descr_to_dtype(_descr(json.loads(leaf["dtype"])))


def _descr(d: Any) -> Any:
    """JSON turned the tuples of a structured dtype's descr into lists; numpy wants tuples."""
    if isinstance(d, list):
        return [tuple(_descr(x) for x in f) if isinstance(f, list) else f for f in d]
    return d


def _leaf_signature(leaf: Dict[str, Any]) -> Tuple[str, List[int]]:
    """(element type, shape) that a destination must match: the same for numpy and torch where
    both name the same type."""
    kind = leaf["kind"]
    if kind == "torch":
        return "torch:" + leaf["dtype"], list(leaf["shape"])
    # Through numpy's own dtype and back, so that a structured dtype (whose fields JSON turned
    # into lists) reads as the destination's (tuples).
    np = _numpy()
    descr = np.lib.format.dtype_to_descr(np.lib.format.descr_to_dtype(json.loads(leaf["dtype"])))
    return "numpy:" + str(descr), list(leaf["shape"])


def _dest_signature(x: Any) -> Tuple[str, List[int]]:
    if is_torch_tensor(x):
        return "torch:" + str(x.dtype).replace("torch.", ""), list(x.shape)
    np = _numpy()
    a = np.asarray(x)
    return "numpy:" + str(np.lib.format.dtype_to_descr(a.dtype)), list(a.shape)


_EQUIVALENT = {
    # torch dtype name -> numpy descr of the same element type
    "float64": "<f8", "float32": "<f4", "float16": "<f2", "int64": "<i8", "int32": "<i4",
    "int16": "<i2", "int8": "|i1", "uint64": "<u8", "uint32": "<u4", "uint16": "<u2",
    "uint8": "|u1", "bool": "|b1", "complex64": "<c8", "complex128": "<c16",
}


def _same_type(a: str, b: str) -> bool:
    def norm(s: str) -> str:
        kind, _, name = s.partition(":")
        return "numpy:" + _EQUIVALENT[name] if kind == "torch" and name in _EQUIVALENT else s

    return norm(a) == norm(b)


def build(node: Dict[str, Any], fill: Callable[[Dict[str, Any]], Any]) -> Any:
    """The Python value of a tree node; `fill(leaf)` makes each tensor."""
    if "tensor" in node:
        return fill(node)
    if "dict" in node:
        return {k: build(v, fill) for k, v in node["dict"]}
    if "list" in node:
        return [build(v, fill) for v in node["list"]]
    if "tuple" in node:
        return tuple(build(v, fill) for v in node["tuple"])
    if "bytes" in node:
        return base64.b64decode(node["bytes"])
    if "value" in node:
        return node["value"]
    raise StateDictError(f"unknown node in the saved state: {sorted(node)}")


def _finish(leaf: Dict[str, Any], x: Any) -> Any:
    """What the caller gets for a loaded leaf: numpy scalars come back as scalars."""
    if leaf["kind"] == "numpy-scalar":
        return x[()]
    return x


def leaves(node: Dict[str, Any]) -> Iterator[Dict[str, Any]]:
    """The tensor leaves of a tree node, in order."""
    if "tensor" in node:
        yield node
    for key in ("list", "tuple"):
        for child in node.get(key, ()):
            yield from leaves(child)
    for _, child in node.get("dict", ()):
        yield from leaves(child)


def plan_new(root: Dict[str, Any], plan: Plan) -> Callable[[], Any]:
    """Plans a load into new CPU tensors and arrays; returns the function that builds the
    result once the engine has read."""
    made: Dict[str, Any] = {}
    for leaf in leaves(root):
        x = _alloc(leaf)
        made[leaf["tensor"]] = x
        plan.into(leaf["tensor"], _dest_mem(x))

    def result() -> Any:
        return build(root, lambda leaf: _finish(leaf, made[leaf["tensor"]]))

    return result


# Direct reads need the buffer's address and the file offset to agree modulo this.
_PAGE = 4096


# Tensors smaller than this are copied out of the file's buffer into memory of their own: they
# cost nothing to copy, and calls such as torch.set_rng_state ignore a storage offset.
OWN_BELOW = 1 << 20


def plan_file(
    root: Dict[str, Any], plan: Plan, manifest: Mapping[str, Any], local_fd: Optional[int]
) -> Callable[[], Any]:
    """Plans a load of the whole file into one buffer, and the new tensors and arrays as views
    of it: those of at least ``OWN_BELOW`` bytes whose offset in the file suits their element
    type's alignment; the others are copied out into memory of their own. The buffer is a
    private, copy-on-write mapping of `local_fd` (the nearest source's file on this machine: a
    local tier's, or one a sidecar handed over) when there is one, as safetensors maps its
    files: the engine verifies it where it lies, the page cache reads it and nothing is copied
    (and once retention deletes the file, ``_mapped.release_deleted`` moves the mapping into
    memory of the process's own); else new page-aligned memory that the engine reads into with
    direct I/O. Returns the function that builds the result once the engine has read."""
    ranges = {name: r for (name, _, _), r in zip(manifest["tensors"], manifest["ranges"])}
    n = int(manifest["file_len"])
    kinds: Dict[str, Any] = {}
    use_torch = False
    for leaf in leaves(root):
        if leaf["tensor"] not in ranges:
            raise StateDictError(f"tensor {leaf['tensor']!r} of the saved tree is not in the file")
        is_torch = leaf["kind"] == "torch"
        kinds[leaf["tensor"]] = _torch_dtype(leaf) if is_torch else _numpy_dtype(leaf)
        use_torch = use_torch or is_torch
    # One buffer of the kind the tensors want: torch's when any is a torch tensor (numpy arrays
    # are then views of its memory too), else numpy's, so a numpy-only state never imports
    # torch.
    mapped = _mapped.map_private(local_fd, n) if local_fd is not None else None
    base: Any
    if use_torch:
        import torch

        if mapped is not None:
            base = torch.frombuffer(mapped, dtype=torch.uint8)
        else:
            base = torch.empty(n + _PAGE, dtype=torch.uint8)
    else:
        import numpy as np

        if mapped is not None:
            base = np.frombuffer(mapped, dtype=np.uint8)
        else:
            base = np.empty(n + _PAGE, dtype=np.uint8)
    # A mapping starts on a page; new memory is aligned to one here.
    at = -_dest_mem(base).ptr % _PAGE
    buf = base[at : at + n]
    plan.file = (_dest_mem(base).ptr + at, n, mapped is not None)
    plan.keep.append(base)

    def view(leaf: Dict[str, Any]) -> Any:
        # `at` makes the buffer page-aligned, so a file offset's alignment is the address's.
        start, end = ranges[leaf["tensor"]]
        dtype = kinds[leaf["tensor"]]
        piece: Any = buf[start:end]
        small = end - start < OWN_BELOW
        if leaf["kind"] == "torch":
            if small or start % dtype.itemsize:
                piece = piece.clone()
            return piece.view(dtype).view(leaf["shape"])
        if is_torch_tensor(piece):
            piece = piece.numpy()
        if small or start % dtype.alignment:
            piece = piece.copy()
        return piece.view(dtype).reshape(leaf["shape"])

    def result() -> Any:
        return build(root, lambda leaf: _finish(leaf, view(leaf)))

    return result


def _dest_mem(x: Any) -> Mem:
    """Destination memory of a freshly allocated tensor/array (contiguous, ours)."""
    if is_torch_tensor(x):
        n = x.numel() * x.element_size()
        return Mem("", [], x.data_ptr(), n, -1, x)
    return Mem("", [], x.__array_interface__["data"][0], x.nbytes, -1, x)


def plan_into(root: Dict[str, Any], state: Any, strict: bool, plan: Plan) -> Any:
    """Plans a load into the caller's `state`: tensors are filled in place, other values are
    assigned into their containers after the read. Returns the new root when the root itself
    is replaced (a leaf or tuple), else `state`."""
    errors: List[str] = []

    def into_tensor(dst: Any, leaf: Dict[str, Any], path: Tuple[Any, ...]) -> None:
        key = key_str(path)
        want_type, want_shape = _leaf_signature(leaf)
        have_type, have_shape = _dest_signature(dst)
        if not _same_type(want_type, have_type) or want_shape != have_shape:
            errors.append(
                f"{key}: checkpoint has {want_type.split(':', 1)[1]} {want_shape}, "
                f"destination is {have_type.split(':', 1)[1]} {have_shape}"
            )
            return
        if _is_numpy(dst) and not dst.flags.writeable:
            errors.append(f"{key}: the destination numpy array is read-only")
            return
        name = leaf["tensor"]
        direct = _direct_mem(dst)
        if direct is not None and not (direct.device < 0 and plan._overlaps(direct.ptr, direct.nbytes)):
            plan.into(name, direct)
            return
        # Not writable in place (non-contiguous, another device, memory shared with another
        # destination): read into a temporary, then copy.
        tmp = _alloc(leaf)
        plan.into(name, _dest_mem(tmp))
        plan.after.append(lambda: _copy_into(dst, tmp))

    def replace(node: Dict[str, Any], assign: Callable[[Any], None]) -> None:
        made = plan_new(node, plan)
        plan.after.append(lambda: assign(made()))

    def walk(
        dst: Any, node: Dict[str, Any], path: Tuple[Any, ...], assign: Callable[[Any], None]
    ) -> None:
        saved_tensors = any(_real_tensor_leaf(leaf) for leaf in leaves(node))
        if not saved_tensors and not _holds_tensors(dst):
            # Plain values on both sides: the saved ones replace the caller's.
            replace(node, assign)
            return
        if "tensor" in node and _real_tensor(dst):
            into_tensor(dst, node, path)
            return
        if "dict" in node and isinstance(dst, dict):
            saved = {k: v for k, v in node["dict"]}
            missing = [key_str(path + (k,)) for k in dst if k not in saved]
            extra = [k for k in saved if k not in dst]
            if strict and missing:
                errors.append(f"not in the checkpoint: {missing}")
            if strict and extra:
                errors.append(f"only in the checkpoint: {[key_str(path + (k,)) for k in extra]}")
            for k, v in saved.items():
                if k in dst:
                    walk(dst[k], v, path + (k,), _setter(dst, k))
                else:
                    replace(v, _setter(dst, k))
            return
        if "list" in node and isinstance(dst, list):
            items = node["list"]
            if strict and len(items) != len(dst):
                errors.append(
                    f"{key_str(path)}: checkpoint has a list of {len(items)}, destination {len(dst)}"
                )
            for i, v in enumerate(items[: len(dst)]):
                walk(dst[i], v, path + (i,), _setter(dst, i))
            return
        if "tuple" in node and isinstance(dst, tuple) and len(node["tuple"]) == len(dst):
            # Tuples are immutable: fill tensors inside in place, rebuild the tuple after.
            items = list(dst)
            for i, v in enumerate(node["tuple"]):
                walk(dst[i], v, path + (i,), _setter(items, i))
            plan.after.append(lambda: assign(tuple(items)))
            return
        if strict:
            errors.append(f"{key_str(path)}: checkpoint and destination differ in structure")
            return
        replace(node, assign)

    result: List[Any] = [state]
    walk(state, root, (), lambda v: result.__setitem__(0, v))
    if errors:
        hint = ""
        if any(e.startswith("only in the checkpoint") for e in errors):
            hint = (
                ". A freshly built optimizer has no per-parameter state until its first step, so"
                " its state_dict() lacks what the checkpoint holds: load with strict=False, which"
                " adds those entries to your state dict, then apply it"
                " (optimizer.load_state_dict(state[...])); or save and load the state dict that"
                " torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizer)"
                " returns (it creates that state) and apply it with set_state_dict"
            )
        raise StateDictError("state dict does not match the checkpoint: " + "; ".join(errors) + hint)

    def done() -> Any:
        return result[0]

    return done


def _is_numpy_scalar(x: Any) -> bool:
    np = _numpy()
    return np is not None and isinstance(x, np.generic)


def _real_tensor(x: Any) -> bool:
    """A tensor or array that can be filled in place (numpy scalars are immutable values)."""
    return is_tensor(x) and not _is_numpy_scalar(x)


def _real_tensor_leaf(leaf: Dict[str, Any]) -> bool:
    return bool(leaf["kind"] != "numpy-scalar")


def _holds_tensors(x: Any) -> bool:
    if _real_tensor(x):
        return True
    if isinstance(x, dict):
        return any(_holds_tensors(v) for v in x.values())
    if isinstance(x, (list, tuple)):
        return any(_holds_tensors(v) for v in x)
    return False


def _setter(container: Any, key: Any) -> Callable[[Any], None]:
    def set_(v: Any) -> None:
        container[key] = v

    return set_


def _direct_mem(x: Any) -> Optional[Mem]:
    """The memory of a destination the engine can write directly, or None."""
    if is_torch_tensor(x):
        if x.layout != _torch().strided or x.is_conj() or x.is_neg() or not x.is_contiguous():
            return None
        if x.device.type == "cpu":
            return Mem("", [], x.data_ptr(), x.numel() * x.element_size(), -1, x)
        if x.device.type == "cuda":
            return Mem("", [], x.data_ptr(), x.numel() * x.element_size(), x.device.index, x)
        return None
    if x.flags.c_contiguous and x.flags.writeable:
        return Mem("", [], x.__array_interface__["data"][0], x.nbytes, -1, x)
    return None


def _copy_into(dst: Any, src: Any) -> None:
    if is_torch_tensor(dst):
        import torch

        with torch.no_grad():
            dst.copy_(src)
    else:
        np = _numpy()
        if not dst.flags.writeable:
            raise StateDictError("a read-only numpy array cannot be loaded into")
        np.copyto(dst, src, casting="no")
