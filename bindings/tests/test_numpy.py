"""numpy state dicts: every dtype bit-exact, nested structure, small values, in-place loads,
mismatches, and what the files hold for other tools."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest

import hotstart
from hotstart import StateDictError, _state

# Every numpy dtype that holds data (object arrays are refused).
DTYPES = [
    np.bool_, np.int8, np.uint8, np.int16, np.uint16, np.int32, np.uint32, np.int64, np.uint64,
    np.float16, np.float32, np.float64, np.longdouble, np.complex64, np.complex128,
    np.clongdouble, "datetime64[ns]", "timedelta64[s]", "S7", "U5", ">i4", ">f8",
    np.dtype([("x", "<f4"), ("y", "<i2", (3,))]), "V6",
]


def random_array(dtype, shape, rng):
    dt = np.dtype(dtype)
    raw = rng.integers(0, 256, size=int(np.prod(shape)) * dt.itemsize, dtype=np.uint8)
    if dt.kind == "b":
        raw = raw % 2
    return raw.view(dt).reshape(shape)


def same_bits(a, b):
    assert a.dtype == b.dtype, (a.dtype, b.dtype)
    assert a.shape == b.shape
    assert np.ascontiguousarray(a).tobytes() == np.ascontiguousarray(b).tobytes()


def test_every_dtype_round_trips_bit_exact(local_dir: Path) -> None:
    rng = np.random.default_rng(1)
    state = {str(np.dtype(d)): random_array(d, (3, 5), rng) for d in DTYPES}
    state["scalar0d"] = np.array(7, dtype=np.int16)
    state["empty"] = np.zeros((0, 4), dtype=np.float32)
    with hotstart.Checkpointer(local_dir=local_dir, job="np") as ck:
        ck.save(1, state).wait()
        out = ck.load()
    assert list(out) == list(state)
    for k in state:
        same_bits(state[k], out[k])


def test_nested_structure_and_small_values(local_dir: Path) -> None:
    rng = np.random.default_rng(2)
    state = {
        "model": {"layers": [{"w": rng.standard_normal((4, 4)), "b": np.zeros(4)} for _ in range(3)]},
        "optim": {"state": {0: {"m": rng.standard_normal(4)}, 1: {"m": rng.standard_normal(2)}},
                  "groups": [{"lr": 0.1, "betas": (0.9, 0.999), "params": [0, 1]}]},
        "step": 12,
        "huge": 2**100,
        "floats": [0.1, -0.0, float("inf"), 1e-310],
        "text": "héllo",
        "flags": [True, False, None],
        "blob": b"\x00\xffraw",
        "rng": np.random.default_rng(3).bit_generator.state,
        "np_scalars": [np.float32(1.5), np.int64(-3), np.bool_(True)],
        "mixed_tuple": (1, np.arange(3), "x"),
    }
    with hotstart.Checkpointer(local_dir=local_dir, job="nest") as ck:
        ck.save(3, state).wait()
        out = ck.load()

    assert out["step"] == 12 and out["huge"] == 2**100 and out["text"] == "héllo"
    assert [repr(x) for x in out["floats"]] == [repr(x) for x in state["floats"]]
    assert out["flags"] == [True, False, None] and out["blob"] == b"\x00\xffraw"
    assert out["rng"] == state["rng"]
    assert out["optim"]["groups"] == state["optim"]["groups"]
    assert isinstance(out["optim"]["groups"][0]["betas"], tuple)
    assert sorted(out["optim"]["state"]) == [0, 1]  # int keys stay ints
    for i in (0, 1):
        same_bits(out["optim"]["state"][i]["m"], state["optim"]["state"][i]["m"])
    for a, b in zip(out["model"]["layers"], state["model"]["layers"]):
        same_bits(a["w"], b["w"])
        same_bits(a["b"], b["b"])
    for a, b in zip(out["np_scalars"], state["np_scalars"]):
        assert type(a) is type(b) and a == b
    assert out["mixed_tuple"][0] == 1 and out["mixed_tuple"][2] == "x"
    same_bits(out["mixed_tuple"][1], np.arange(3))


def test_in_place_load_writes_the_callers_arrays(local_dir: Path) -> None:
    rng = np.random.default_rng(4)
    saved = {"w": rng.standard_normal((64, 32)).astype(np.float32), "n": 5, "c": np.arange(6, dtype=np.complex64)}
    with hotstart.Checkpointer(local_dir=local_dir, job="inplace") as ck:
        ck.save(1, saved).wait()
        w = np.zeros((64, 32), dtype=np.float32)
        c = np.zeros(6, dtype=np.complex64)
        dst = {"w": w, "n": 0, "c": c}
        back = ck.load(dst)
    assert back is dst and dst["w"] is w and dst["c"] is c
    same_bits(w, saved["w"])
    same_bits(c, saved["c"])
    assert dst["n"] == 5


def test_structured_arrays_load_in_place(local_dir: Path) -> None:
    dt = np.dtype([("a", "<i4"), ("b", "<f8"), ("c", [("x", "u1"), ("y", "<f4", (2,))])])
    saved = np.zeros(3, dtype=dt)
    saved["a"], saved["b"], saved["c"]["y"] = [1, 2, 3], [0.5, -1.5, 2.5], [[1, 2], [3, 4], [5, 6]]
    with hotstart.Checkpointer(local_dir=local_dir, job="structured") as ck:
        ck.save(1, {"s": saved}).wait()
        into = np.zeros(3, dtype=dt)
        ck.load({"s": into})
    assert into.tobytes() == saved.tobytes()


def test_non_contiguous_arrays_are_copied_on_save_and_filled_on_load(local_dir: Path) -> None:
    base = np.arange(200, dtype=np.int32).reshape(10, 20)
    view = base[::2, 3:17:3]  # strided view
    fortran = np.asfortranarray(np.arange(12.0).reshape(3, 4))
    with hotstart.Checkpointer(local_dir=local_dir, job="strided") as ck:
        ck.save(1, {"view": view, "f": fortran}).wait()
        out = ck.load()
        same_bits(out["view"], np.ascontiguousarray(view))
        assert np.array_equal(out["f"], fortran)
        # In place into a strided destination: read into a temporary, then copied.
        dst_base = np.zeros((10, 20), dtype=np.int32)
        dst = {"view": dst_base[::2, 3:17:3], "f": np.zeros((4, 3)).T}
        ck.load(dst)
    assert np.array_equal(dst_base[::2, 3:17:3], view)
    assert dst_base[1].sum() == 0  # rows between the strides untouched
    assert np.array_equal(dst["f"], fortran)


def test_arrays_sharing_memory_load_correctly(local_dir: Path) -> None:
    tied = np.arange(8, dtype=np.float64)
    with hotstart.Checkpointer(local_dir=local_dir, job="tied") as ck:
        ck.save(1, {"a": tied, "b": tied, "half": tied[:4]}).wait()
        dst_mem = np.zeros(8)
        dst = {"a": dst_mem, "b": dst_mem, "half": dst_mem[:4]}
        ck.load(dst)
    assert np.array_equal(dst_mem, tied)


def test_a_destination_overlapping_earlier_ones_is_found_among_many(local_dir: Path) -> None:
    """A destination whose memory overlaps an earlier one's is read into a temporary and copied
    after: found by a binary search among the earlier ranges, merged as they come (one search
    per tensor, not a pass over all), which answers as a pass over every earlier range does."""
    rng = random.Random(7)
    spans, seen = _state.Spans(), []
    for _ in range(3000):
        start = rng.randrange(0, 20000)
        end = start + rng.randrange(0, 40)
        # An empty range holds no byte, so it overlaps nothing.
        want = start < end and any(start < e and s < end for s, e in seen)
        assert spans.overlaps(start, end) == want, (start, end)
        spans.add(start, end)
        if start < end:
            seen.append((start, end))
    # End to end: "c" overlaps both "a" and "b", views of one array like the saved ones.
    tied = np.arange(12, dtype=np.float64)
    with hotstart.Checkpointer(local_dir=local_dir, job="staggered") as ck:
        ck.save(1, {"a": tied[0:4], "b": tied[6:10], "c": tied[3:7]}).wait()
        mem = np.zeros(12)
        ck.load({"a": mem[0:4], "b": mem[6:10], "c": mem[3:7]})
    assert np.array_equal(mem[:10], tied[:10]) and not mem[10:].any()


@pytest.mark.parametrize(
    "dst, message",
    [
        ({"w": np.zeros((4, 3), np.float32), "step": 0}, "w: checkpoint has <f4 [3, 4], destination is <f4 [4, 3]"),
        ({"w": np.zeros((3, 4), np.float64), "step": 0}, "w: checkpoint has <f4 [3, 4], destination is <f8 [3, 4]"),
        ({"w": np.zeros((3, 4), np.float32)}, "only in the checkpoint: ['step']"),
        ({"w": np.zeros((3, 4), np.float32), "step": 0, "extra": np.zeros(1)}, "not in the checkpoint: ['extra']"),
    ],
)
def test_mismatches_name_the_key_and_change_nothing(local_dir: Path, dst, message: str) -> None:
    with hotstart.Checkpointer(local_dir=local_dir, job="mismatch") as ck:
        ck.save(1, {"w": np.ones((3, 4), np.float32), "step": 9}).wait()
        before = {k: (v.copy() if isinstance(v, np.ndarray) else v) for k, v in dst.items()}
        with pytest.raises(StateDictError) as e:
            ck.load(dst)
    assert message in str(e.value)
    for k, v in before.items():
        if isinstance(v, np.ndarray):
            same_bits(dst[k], v)
        else:
            assert dst[k] == v


def test_non_strict_loads_the_common_keys(local_dir: Path) -> None:
    with hotstart.Checkpointer(local_dir=local_dir, job="loose") as ck:
        ck.save(1, {"w": np.ones(3), "step": 9}).wait()
        dst = {"w": np.zeros(3), "mine": 1}
        ck.load(dst, strict=False)
    assert np.array_equal(dst["w"], np.ones(3)) and dst["step"] == 9 and dst["mine"] == 1


def test_read_only_destination_is_refused(local_dir: Path) -> None:
    with hotstart.Checkpointer(local_dir=local_dir, job="ro") as ck:
        ck.save(1, {"w": np.ones(3)}).wait()
        ro = np.zeros(3)
        ro.flags.writeable = False
        with pytest.raises(StateDictError, match="w: the destination numpy array is read-only"):
            ck.load({"w": ro})


@pytest.mark.parametrize(
    "state, message",
    [
        ({"o": np.array([object()])}, "o: numpy arrays of Python objects cannot be saved"),
        ({"s": {1, 2}}, "s: a value of type set cannot be saved"),
        ({(1, 2): 3}, "key (1, 2) of type tuple: only str and int keys can be saved"),
        ({"a.b": np.ones(1), "a": {"b": np.ones(1)}}, "is also the name of a.b"),
        ({"__metadata__": np.ones(1)}, "__metadata__"),
    ],
)
def test_unsaveable_state_is_refused(local_dir: Path, state, message: str) -> None:
    with hotstart.Checkpointer(local_dir=local_dir, job="bad") as ck:
        with pytest.raises(StateDictError) as e:
            ck.save(1, state)
        assert message in str(e.value)
        assert ck.latest_step() is None


def test_files_are_safetensors_with_the_tree_in_the_manifest(local_dir: Path) -> None:
    from safetensors.numpy import load_file

    w = np.arange(12, dtype=np.float32).reshape(3, 4)
    with hotstart.Checkpointer(local_dir=local_dir, job="fmt") as ck:
        ck.save(7, {"model": {"w": w}, "lr": 0.5}).wait()
    step_dir = local_dir / "fmt" / "step-7"
    tensors = load_file(str(step_dir / "rank-0.safetensors"))
    assert list(tensors) == ["model.w"]
    same_bits(tensors["model.w"], w)
    manifest = json.loads((step_dir / "rank-0.manifest.json").read_text())
    assert "hotstart.state" in manifest["extras"]


def test_latest_step_steps_and_retention(local_dir: Path) -> None:
    with hotstart.Checkpointer(local_dir=local_dir, job="keep", keep=2) as ck:
        assert ck.latest_step() is None and ck.steps() == []
        for step in (10, 20, 30):
            ck.save(step, {"x": np.full(4, step)})
            ck.wait()  # persisted, and retention done
        assert ck.latest_step() == 30
        assert ck.steps() == [20, 30]
        assert np.array_equal(ck.load(step=20)["x"], np.full(4, 20))
        assert np.array_equal(ck.load()["x"], np.full(4, 30))


def test_multi_chunk_state(local_dir: Path) -> None:
    rng = np.random.default_rng(5)
    state = {f"t{i}": rng.standard_normal(140_000) for i in range(8)}  # 9 MB over 256 KiB chunks
    with hotstart.Checkpointer(local_dir=local_dir, job="chunks", chunk_size=256 << 10, threads=2) as ck:
        ck.save(1, state).wait()
        assert ck.loaded_from == []
        dst = {k: np.empty_like(v) for k, v in state.items()}
        ck.load(dst)
        assert len(ck.loaded_from) > 1 and set(ck.loaded_from) == {"disk"}, ck.loaded_from
    for k in state:
        same_bits(dst[k], state[k])


def test_new_arrays_map_the_local_file_copy_on_write_and_a_bad_chunk_comes_from_the_store(tmp_path: Path) -> None:
    rng = np.random.default_rng(6)
    state = {f"t{i}": rng.standard_normal(140_000) for i in range(8)}  # 9 MB over 256 KiB chunks
    opts = dict(local_dir=tmp_path / "disk", job="mapped", chunk_size=256 << 10)
    with hotstart.Checkpointer(str(tmp_path / "store"), **opts) as ck:
        ck.save(1, state).wait()
    data = tmp_path / "disk" / "mapped" / "step-1" / "rank-0.safetensors"
    raw = bytearray(data.read_bytes())
    at = len(raw) // 2  # some chunk in the middle
    raw[at] ^= 0xFF
    data.write_bytes(bytes(raw))
    with hotstart.Checkpointer(str(tmp_path / "store"), **opts) as ck:
        out = ck.load()
        assert ck.loaded_from.count("store") == 1, ck.loaded_from
        assert set(ck.loaded_from) == {"disk", "store"}, ck.loaded_from
        for k in state:
            same_bits(out[k], state[k])  # the flipped chunk came from the store
            assert out[k].flags.writeable
        maps = Path("/proc/self/maps").read_text()
        assert str(data) in maps, "new arrays are a mapping of the disk tier's file"
        # Copy-on-write: writing a loaded array changes neither the file nor the next load.
        out["t0"][:] = 0
        assert data.read_bytes() == bytes(raw)
        same_bits(ck.load()["t0"], state["t0"])
        del out
