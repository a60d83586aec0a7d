"""torch state dicts: every dtype bit-exact, modules and optimizers, in-place loads into
parameters, views, tied weights, and CUDA tensors (on a GPU machine; skipped elsewhere)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import hotstart
from hotstart import StateDictError

from conftest import torch_or_fail

torch = torch_or_fail()

DTYPES = [
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.uint16, torch.uint32, torch.uint64, torch.bool,
    torch.complex32, torch.complex64, torch.complex128,
] + [getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                 "float8_e5m2fnuz", "float8_e8m0fnu") if hasattr(torch, n)]


def random_tensor(dtype, shape, gen):
    n = 1
    for d in shape:
        n *= d
    size = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (n * size,), dtype=torch.uint8, generator=gen)
    if dtype == torch.bool:
        raw %= 2
    return raw.view(dtype).reshape(shape)


def same_bits(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def test_every_dtype_round_trips_bit_exact(local_dir: Path) -> None:
    gen = torch.Generator().manual_seed(1)
    state = {str(d): random_tensor(d, (4, 6), gen) for d in DTYPES}
    state["scalar"] = torch.tensor(3.25)
    state["empty"] = torch.zeros(0, 3)
    with hotstart.Checkpointer(local_dir=local_dir, job="torch") as ck:
        ck.save(1, state).wait()
        out = ck.load()
        dst = {k: torch.empty_like(v) for k, v in state.items()}
        ck.load(dst)
    for k, v in state.items():
        same_bits(out[k], v)
        same_bits(dst[k], v)
        assert out[k].device.type == "cpu"


def small_model():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    x = torch.randn(32, 8)
    for _ in range(3):
        opt.zero_grad()
        m(x).pow(2).mean().backward()
        opt.step()
    return m, opt


def test_module_and_optimizer_round_trip(local_dir: Path) -> None:
    m, opt = small_model()
    with hotstart.Checkpointer(local_dir=local_dir, job="mod") as ck:
        h = ck.save(3, {"model": m.state_dict(), "optim": opt.state_dict(), "step": 3})
        h.wait_staged()
        h.wait_persisted("disk")
        state = ck.load()

    m2 = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt2 = torch.optim.Adam(m2.parameters(), lr=0.5)
    m2.load_state_dict(state["model"])
    opt2.load_state_dict(state["optim"])
    assert state["step"] == 3
    for a, b in zip(m.parameters(), m2.parameters()):
        same_bits(a.detach(), b.detach())
    s1, s2 = opt.state_dict(), opt2.state_dict()
    assert s1["param_groups"] == s2["param_groups"]
    for k in s1["state"]:
        for name in ("exp_avg", "exp_avg_sq", "step"):
            same_bits(s1["state"][k][name], s2["state"][k][name])


def test_in_place_load_writes_parameters(local_dir: Path) -> None:
    m, _ = small_model()
    with hotstart.Checkpointer(local_dir=local_dir, job="params") as ck:
        ck.save(1, {"model": m.state_dict()}).wait()
        m2 = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
        ptrs = [p.data_ptr() for p in m2.parameters()]
        ck.load({"model": m2.state_dict()})
    assert [p.data_ptr() for p in m2.parameters()] == ptrs
    for a, b in zip(m.parameters(), m2.parameters()):
        same_bits(a.detach(), b.detach())
    assert all(p.requires_grad for p in m2.parameters())


def test_views_conjugates_and_tied_weights(local_dir: Path) -> None:
    base = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    c = torch.randn(5, dtype=torch.complex64)
    emb = torch.randn(10, 4)
    state = {"t": base.t(), "slice": base[1:5, 2:8:2], "conj": c.conj(), "emb": emb, "head": emb}
    with hotstart.Checkpointer(local_dir=local_dir, job="views") as ck:
        ck.save(1, state).wait()
        out = ck.load()
        dst_base = torch.zeros(6, 10)
        tied = torch.zeros(10, 4)
        dst = {"t": dst_base.t(), "slice": torch.zeros(4, 3), "conj": torch.zeros(5, dtype=torch.complex64),
               "emb": tied, "head": tied}
        ck.load(dst)
    assert torch.equal(out["t"], base.t()) and out["t"].is_contiguous()
    assert torch.equal(out["slice"], base[1:5, 2:8:2])
    assert torch.equal(out["conj"], c.conj().resolve_conj()) and not out["conj"].is_conj()
    assert torch.equal(dst_base, base) and torch.equal(tied, emb)
    assert torch.equal(dst["conj"], c.conj())


def test_new_tensors_are_views_of_one_page_aligned_buffer_small_ones_copies(local_dir: Path) -> None:
    # Tensors lie back to back in the file. The large ones (1 MiB and more) come back as views
    # of one buffer that takes the whole file; the small ones (and any at an offset its element
    # type does not divide) as copies of their own, at offset 0 of their storage, as
    # torch.set_rng_state needs.
    gen = torch.Generator().manual_seed(3)
    state = {
        "big": random_tensor(torch.float32, (512, 520), gen),
        "odd": random_tensor(torch.uint8, (7,), gen),
        "big2": random_tensor(torch.float32, (300, 1024), gen),
        "rng": torch.get_rng_state(),
        "z": random_tensor(torch.bfloat16, (3,), gen),
        "n": np.arange(6, dtype=np.int16),
    }
    with hotstart.Checkpointer(local_dir=local_dir, job="views") as ck:
        ck.save(1, state).wait()
        ranges = dict(zip((t[0] for t in ck.engine.manifest(1)["tensors"]), ck.engine.manifest(1)["ranges"]))
        out = ck.load()
    for k in ("big", "odd", "big2", "rng", "z"):
        same_bits(out[k], state[k])
        assert out[k].is_contiguous()
        assert out[k].data_ptr() % out[k].element_size() == 0, k
    assert np.array_equal(out["n"], state["n"]) and out["n"].flags.writeable
    # The buffer is page-aligned: a view's address and its file offset agree modulo 4096.
    assert (out["big"].data_ptr() - ranges["big"][0]) % 4096 == 0
    shared = out["big"].untyped_storage().data_ptr()
    for k in ("odd", "rng", "z"):
        assert out[k].storage_offset() == 0 and out[k].untyped_storage().data_ptr() != shared, k
    if ranges["big2"][0] % 4 == 0:
        assert out["big2"].untyped_storage().data_ptr() == shared
    torch.set_rng_state(out["rng"])
    assert torch.equal(torch.get_rng_state(), state["rng"])
    # Each is writable and independent of its neighbours in the buffer.
    out["odd"].fill_(0)
    same_bits(out["big2"], state["big2"])
    del out["big"]  # the others keep the buffer alive
    same_bits(out["big2"], state["big2"])


def test_the_handle_keeps_the_tensors_alive(local_dir: Path) -> None:
    gen = torch.Generator().manual_seed(7)
    t = random_tensor(torch.float32, (1 << 20,), gen)
    expect = t.clone()
    with hotstart.Checkpointer(local_dir=local_dir, job="alive") as ck:
        h = ck.save(1, {"t": t})
        del t  # only the handle holds it now
        h.wait_staged()
        h.wait()
        same_bits(ck.load()["t"], expect)


def test_dtype_and_shape_mismatch_name_the_key(local_dir: Path) -> None:
    with hotstart.Checkpointer(local_dir=local_dir, job="mm") as ck:
        ck.save(1, {"model": {"w": torch.ones(2, 3)}}).wait()
        with pytest.raises(StateDictError, match=r"model\.w: checkpoint has float32 \[2, 3\], destination is bfloat16 \[2, 3\]"):
            ck.load({"model": {"w": torch.zeros(2, 3, dtype=torch.bfloat16)}})
        with pytest.raises(StateDictError, match=r"model\.w: checkpoint has float32 \[2, 3\], destination is float32 \[3, 2\]"):
            ck.load({"model": {"w": torch.zeros(3, 2)}})


def test_numpy_and_torch_load_into_each_other(local_dir: Path) -> None:
    with hotstart.Checkpointer(local_dir=local_dir, job="cross") as ck:
        ck.save(1, {"a": torch.arange(5, dtype=torch.int64), "b": np.linspace(0, 1, 4)}).wait()
        dst = {"a": np.zeros(5, dtype=np.int64), "b": torch.zeros(4, dtype=torch.float64)}
        ck.load(dst)
    assert dst["a"].tolist() == [0, 1, 2, 3, 4]
    assert dst["b"].tolist() == np.linspace(0, 1, 4).tolist()


def test_sparse_and_meta_tensors_are_refused(local_dir: Path) -> None:
    with hotstart.Checkpointer(local_dir=local_dir, job="refuse") as ck:
        with pytest.raises(StateDictError, match="s: torch.sparse_coo tensors cannot be saved"):
            ck.save(1, {"s": torch.eye(3).to_sparse()})
        with pytest.raises(StateDictError, match="m: meta tensors have no data"):
            ck.save(1, {"m": torch.empty(3, device="meta")})


def needs_gpu() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: torch.cuda.is_available() is False (GPU tests run on a GPU machine)")


def test_cuda_tensors_round_trip_bit_exact(local_dir: Path) -> None:
    needs_gpu()
    gen = torch.Generator().manual_seed(3)
    cpu = {str(d): random_tensor(d, (64, 33), gen) for d in DTYPES}
    state = {k: v.cuda() for k, v in cpu.items()}
    state["host"] = torch.arange(10)
    with hotstart.Checkpointer(local_dir=local_dir, job="cuda") as ck:
        h = ck.save(1, state)
        h.wait_staged()
        for v in state.values():
            v.zero_()  # after wait_staged the saved bytes are safe
        h.wait()
        out = ck.load()
        dst = {k: torch.empty_like(v) for k, v in cpu.items()}
        dst = {k: v.cuda() for k, v in dst.items()}
        dst["host"] = torch.zeros(10, dtype=torch.int64)
        ck.load(dst)
    for k, v in cpu.items():
        same_bits(out[k], v)
        assert dst[k].is_cuda
        same_bits(dst[k].cpu(), v)
    assert dst["host"].tolist() == list(range(10))


def test_cuda_refused_cleanly_without_a_driver(local_dir: Path) -> None:
    """On a machine without a CUDA driver, a device tensor is refused with CudaError before
    anything is read (the address below is never touched), and host saves keep working."""
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: covered by test_cuda_tensors_round_trip_bit_exact")
    with hotstart.Checkpointer(local_dir=local_dir, job="nocuda") as ck:
        with pytest.raises(hotstart.CudaError, match="CUDA: "):
            ck.engine.save(1, [("x", "F32", [4], 0x1000, 16, 0)], {}, [])
        ck.save(1, {"x": torch.ones(2)}).wait()
        assert ck.load()["x"].tolist() == [1.0, 1.0]


def trained(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for _ in range(2):
        opt.zero_grad()
        model(torch.randn(4, 6)).sum().backward()
        opt.step()
    return model, opt


def fresh():
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2))
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def same_adam_state(a, b):
    assert a.state_dict()["state"].keys() == b.state_dict()["state"].keys()
    for k, s in a.state_dict()["state"].items():
        for name in ("exp_avg", "exp_avg_sq", "step"):
            same_bits(s[name], b.state_dict()["state"][k][name])


def test_a_fresh_optimizer_is_refused_in_place_with_the_way_out_and_both_ways_work(local_dir: Path) -> None:
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model, opt = trained(1)
    ck = hotstart.Checkpointer(local_dir=local_dir, job="fresh-opt", rank=0, world_size=1)
    ck.save(1, {"model": model.state_dict(), "opt": opt.state_dict()}).wait()

    m2, o2 = fresh()
    state = {"model": m2.state_dict(), "opt": o2.state_dict()}
    with pytest.raises(StateDictError) as e:
        ck.load(state)
    text = str(e.value)
    assert "only in the checkpoint: ['opt.state.0'" in text
    assert "strict=False" in text and "get_state_dict" in text and "set_state_dict" in text
    # The first way out: strict=False adds the optimizer's state, then apply it.
    ck.load(state, strict=False)
    m2.load_state_dict(state["model"])
    o2.load_state_dict(state["opt"])
    for p, q in zip(model.parameters(), m2.parameters()):
        same_bits(p.detach(), q.detach())
    same_adam_state(opt, o2)

    # The second: torch's get_state_dict creates a fresh optimizer's state, so an in-place,
    # strict load fits it.
    msd, osd = get_state_dict(model, opt)
    ck.save(2, {"model": msd, "opt": osd}).wait()
    m3, o3 = fresh()
    msd3, osd3 = get_state_dict(m3, o3)
    ck.load({"model": msd3, "opt": osd3}, step=2)
    set_state_dict(m3, o3, model_state_dict=msd3, optim_state_dict=osd3)
    for p, q in zip(model.parameters(), m3.parameters()):
        same_bits(p.detach(), q.detach())
    same_adam_state(opt, o3)


def _state_shapes(opt):
    return {k: {n: (t.shape, t.dtype, t.device) for n, t in s.items()} for k, s in opt.state_dict()["state"].items()}


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.AdamW(ps, lr=0.01),
    lambda ps: torch.optim.Adam(ps, lr=0.01, amsgrad=True),
    lambda ps: torch.optim.SGD(ps, lr=0.01, momentum=0.9),
], ids=["adamw", "adam-amsgrad", "sgd-momentum"])
def test_empty_optimizer_state_matches_what_a_step_makes_and_loads_bit_exact(local_dir: Path, make) -> None:
    from hotstart.torch import empty_optimizer_state
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def build(seed):
        torch.manual_seed(seed)
        m = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2))
        return m, make(m.parameters())

    def step(m, o, seed):
        o.zero_grad()
        m(torch.randn(4, 6, generator=torch.Generator().manual_seed(seed))).sum().backward()
        o.step()

    model, opt = build(1)
    for i in range(2):
        step(model, opt, i)
    ck = hotstart.Checkpointer(local_dir=local_dir, job="empty-opt", rank=0, world_size=1)
    msd, osd = get_state_dict(model, opt)
    ck.save(2, {"model": msd, "opt": osd}).wait()

    # The tensors torch's first step would make, without the step.
    m2, o2 = build(2)
    assert empty_optimizer_state(o2)
    stepped_m, stepped = build(2)
    step(stepped_m, stepped, 0)
    assert _state_shapes(o2) == _state_shapes(stepped)
    assert all(p.grad is None for p in m2.parameters())

    msd2, osd2 = get_state_dict(m2, o2)
    ck.load({"model": msd2, "opt": osd2})
    set_state_dict(m2, o2, model_state_dict=msd2, optim_state_dict=osd2)
    for p, q in zip(model.parameters(), m2.parameters()):
        same_bits(p.detach(), q.detach())
    for k, s in opt.state_dict()["state"].items():
        for name, t in s.items():
            same_bits(t, o2.state_dict()["state"][k][name])
    # Training goes on exactly as the uninterrupted run does.
    step(model, opt, 7)
    step(m2, o2, 7)
    for p, q in zip(model.parameters(), m2.parameters()):
        same_bits(p.detach(), q.detach())


def test_empty_optimizer_state_leaves_other_optimizers_and_existing_state_alone() -> None:
    from hotstart.torch import empty_optimizer_state

    model = torch.nn.Linear(3, 2)
    assert not empty_optimizer_state(torch.optim.Adagrad(model.parameters()))
    assert not empty_optimizer_state(torch.optim.SGD(model.parameters(), lr=0.1))
    _, opt = trained(3)
    before = {k: {n: t.clone() for n, t in s.items()} for k, s in opt.state_dict()["state"].items()}
    assert not empty_optimizer_state(opt)
    for k, s in opt.state_dict()["state"].items():
        for n, t in s.items():
            same_bits(before[k][n], t)


def test_a_step_saved_by_another_world_size_is_found_and_refused_with_the_way_out(local_dir: Path) -> None:
    saved = {r: {"w": torch.full((3,), float(r))} for r in range(2)}
    for r in range(2):
        hotstart.Checkpointer(local_dir=local_dir, job="elastic", rank=r, world_size=2).save(5, saved[r]).wait()
    three = hotstart.Checkpointer(local_dir=local_dir, job="elastic", rank=2, world_size=3)
    assert three.latest_step() == 5
    assert three.saved_world_size(5) == 2
    for call in (lambda: three.load(), lambda: three.load(step=5)):
        with pytest.raises(hotstart.ConfigError) as e:
            call()
        assert "saved by 2 ranks" in str(e.value) and "hotstart.torch.StorageReader" in str(e.value)
    # The same world size still loads it.
    back = hotstart.Checkpointer(local_dir=local_dir, job="elastic", rank=1, world_size=2).load()
    assert torch.equal(back["w"], saved[1]["w"])
