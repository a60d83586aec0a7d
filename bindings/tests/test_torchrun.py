"""A real PyTorch job under torchrun (examples/torchrun/train.py: FSDP2 on gloo, AdamW, a
deterministic data stream): a worker killed with SIGKILL mid-run is restarted by torchrun and
every worker resumes from the sidecar's memory, with the losses of an uninterrupted run to the
bit; a job saved by 2 ranks resumes on 3 ranks and on 1 through torch.distributed.checkpoint,
its whole state bit-exact."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Tuple

from conftest import ROOT, Sidecar, _free_ports, torch_or_fail

torch_or_fail()

TRAIN = str(ROOT / "examples" / "torchrun" / "train.py")


def torchrun(nproc: int, args: List[str], restarts: int = 0) -> str:
    (port,) = _free_ports(1)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
        f"--max-restarts={restarts}", "--master-addr=127.0.0.1", f"--master-port={port}",
        TRAIN, *args,
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOTSTART_")}
    env["OMP_NUM_THREADS"] = "1"
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, f"{cmd}\n{r.stdout}\n{r.stderr}"
    return r.stdout


def losses(out: str) -> Dict[int, str]:
    """Each step's loss (hex), the last one printed for it (a resumed run trains some again)."""
    got: Dict[int, str] = {}
    for line in out.splitlines():
        if line.startswith("loss "):
            _, step, value = line.split()
            got[int(step)] = value
    return got


def states(out: str) -> List[str]:
    return [line.split()[1] for line in out.splitlines() if line.startswith("state ")]


def resumed(out: str) -> List[Tuple[int, int]]:
    """(step, world size) of every resume."""
    found = []
    for line in out.splitlines():
        if line.startswith("resumed "):
            parts = line.split()
            found.append((int(parts[1]), int(parts[-1].rstrip(")"))))
    return found


def test_a_worker_killed_mid_run_resumes_from_the_sidecars_memory_bit_exact(sidecar: Sidecar) -> None:
    common = ["--steps", "9", "--save-every", "3", "--sidecar", str(sidecar.socket)]
    plain = torchrun(2, ["--job", "plain", *common])
    assert sorted(losses(plain)) == list(range(1, 10)) and "done" in plain

    # Rank 1 dies with SIGKILL after step 7; torchrun restarts both workers, which load step
    # 6 from the sidecar's memory and train 7, 8, 9 again.
    faulty = torchrun(2, ["--job", "faulty", *common, "--kill-rank", "1", "--kill-step", "7"], restarts=1)
    assert resumed(faulty) == [(6, 2)], faulty
    assert losses(faulty) == losses(plain)
    assert states(faulty)[-1] == states(plain)[-1]
    # Both ranks' shards came from memory, not from the disk tier.
    assert sidecar.metric("hotstart_restores_total", 'source="memory"') == 2


def test_a_step_one_rank_cannot_load_sends_the_whole_job_back_a_step(tmp_path: Path) -> None:
    sidecar = Sidecar(tmp_path)
    try:
        first = torchrun(2, ["--job", "back", "--steps", "6", "--save-every", "3", "--sidecar", str(sidecar.socket)])
    finally:
        sidecar.stop()
    # The node restarts (its memory is gone) and rank 1's copy of step 6 on disk, the only one
    # left, has a byte flipped: rank 1 cannot load step 6, rank 0 can. Retrying step 6 would fail
    # at every restart; the job goes back to step 3 instead, every rank together.
    f = tmp_path / "disk" / "back" / "step-6" / "rank-1.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0x40
    f.write_bytes(bytes(data))
    sidecar = Sidecar(tmp_path)
    try:
        out = torchrun(2, ["--job", "back", "--steps", "9", "--save-every", "3", "--sidecar", str(sidecar.socket)])
    finally:
        sidecar.stop()
    assert resumed(out) == [(3, 2)], out
    again = losses(out)
    assert sorted(again) == list(range(4, 10)), out
    # Steps 4 to 6 trained from step 3's state give the first run's losses to the bit.
    assert all(again[s] == losses(first)[s] for s in (4, 5, 6)), (out, first)


def test_a_two_rank_job_resumes_on_three_ranks_and_on_one_through_dcp_bit_exact(tmp_path: Path) -> None:
    ck = str(tmp_path / "dcp")
    two = torchrun(2, ["--job", "elastic", "--steps", "4", "--save-every", "2", "--dcp-dir", ck])
    saved = states(two)[-1]
    for nproc in (3, 1):
        # Nothing left to train: the job loads the newest checkpoint, resharded, and stops.
        out = torchrun(nproc, ["--job", "elastic", "--steps", "4", "--dcp-dir", ck])
        assert resumed(out) == [(4, nproc)], out
        assert states(out) == [saved, saved], out
    # And trains on from there with 3 ranks.
    more = torchrun(3, ["--job", "elastic", "--steps", "5", "--dcp-dir", ck])
    assert resumed(more) == [(4, 3)] and sorted(losses(more)) == [5], more


def _cluster(tmp: Path, n: int, store: str) -> List[Sidecar]:
    """n sidecars on loopback, each the others' peer, as n nodes would run them."""
    ports = _free_ports(n)
    nodes = {f"node-{i}": p for i, p in enumerate(ports)}
    return [
        Sidecar(tmp, node=node, listen=port, peers={o: q for o, q in nodes.items() if o != node}, store=store)
        for node, port in nodes.items()
    ]


def sockets(sidecars: List[Sidecar]) -> str:
    return ",".join(str(s.socket) for s in sidecars)


def _restored(sidecars: List[Sidecar], source: str) -> float:
    return sum(s.metric("hotstart_restores_total", f'source="{source}"') for s in sidecars)


def test_a_job_that_loses_a_node_reshards_from_the_sidecars_memory_and_grows_back(tmp_path: Path) -> None:
    # Three nodes, one rank each, checkpointing with torch.distributed.checkpoint through their
    # sidecars (memory, one replica on a peer, disk, a local-directory store).
    store = str(tmp_path / "store")
    nodes = _cluster(tmp_path, 3, store)
    try:
        three = torchrun(3, ["--job", "el", "--steps", "4", "--save-every", "2", "--dcp", "--sidecar", sockets(nodes)])
        saved = states(three)[-1]

        # Node 2 is lost with its memory; the job comes back as 2 ranks on nodes 0 and 1, and
        # reshards step 4 from what the survivors hold in memory: old rank 2's shard from the
        # replica on a peer. Nothing is read from a disk or the store.
        nodes[2].kill()
        two = torchrun(2, ["--job", "el", "--steps", "6", "--save-every", "2", "--dcp", "--sidecar", sockets(nodes[:2])])
        assert resumed(two) == [(4, 2)], two
        assert states(two)[0] == saved, two
        assert sorted(losses(two)) == [5, 6], two
        survivors = nodes[:2]
        assert _restored(survivors, "memory") + _restored(survivors, "peer") >= 3
        assert _restored(survivors, "disk") == 0 and _restored(survivors, "store") == 0

        # A new node 2 joins (empty memory) and the job grows back to 3 ranks from step 6,
        # which 2 ranks saved: node 2 takes the shards it needs from its peers' memory.
        nodes[2] = nodes[2].again(tmp_path)
        grown = torchrun(3, ["--job", "el", "--steps", "6", "--dcp", "--sidecar", sockets(nodes)])
        assert resumed(grown) == [(6, 3)], grown
        assert states(grown) == [states(two)[-1]] * 2, grown
        assert _restored(nodes, "disk") == 0 and _restored(nodes, "store") == 0
    finally:
        for s in nodes:
            s.stop()


def test_shards_in_no_surviving_memory_come_from_the_store_and_a_step_missing_a_rank_is_skipped(tmp_path: Path) -> None:
    store = tmp_path / "store"
    nodes = _cluster(tmp_path, 3, str(store))
    try:
        three = torchrun(3, ["--job", "gone", "--steps", "4", "--save-every", "2", "--dcp", "--sidecar", sockets(nodes)])
        saved = states(three)[-1]
        # Two of three nodes lost: at least one old rank's shard is in no memory left (each
        # shard has one replica); the job, now 1 rank, reads it from the store, verified.
        nodes[1].kill()
        nodes[2].kill()
        one = torchrun(1, ["--job", "gone", "--steps", "4", "--dcp", "--sidecar", sockets(nodes[:1])])
        assert resumed(one) == [(4, 1)] and states(one) == [saved, saved], one
        assert _restored(nodes[:1], "store") >= 1, one

        # Node 0 restarts too (its memory gone; its disk holds only rank 0's files), and old
        # rank 2's copy of step 4 in the store is gone: step 4 is complete nowhere, and the job
        # goes back to step 2, whose every rank is in the store.
        nodes[0].stop()
        for f in (store / "gone" / "step-4").glob("rank-2.*"):
            f.unlink()
        nodes[0] = nodes[0].again(tmp_path)
        back = torchrun(1, ["--job", "gone", "--steps", "2", "--dcp", "--sidecar", sockets(nodes[:1])])
        assert resumed(back) == [(2, 1)], back
    finally:
        for s in nodes:
            s.stop()


def test_peers_killed_while_a_job_reshards_from_them_leave_it_bit_exact(tmp_path: Path) -> None:
    store = tmp_path / "store"
    nodes = _cluster(tmp_path, 3, str(store))
    try:
        args = ["--job", "dying", "--width", "512", "--depth", "2", "--sidecar"]
        three = torchrun(3, [*args, sockets(nodes), "--steps", "4", "--save-every", "2", "--dcp"])
        saved = states(three)[-1]
        # The job comes back as 1 rank on the node that holds the fewest shards in memory (its
        # own, and the replicas placement gave it), so some old rank's shard is only in the
        # others' memory. Those two are frozen the moment the rank starts to load (SIGSTOP:
        # whatever they were sending stops mid-stream), then killed. Each shard they held comes
        # from the next holder instead (the store, here); the state is the one saved.
        nodes.sort(key=lambda n: n.metric("hotstart_memory_shards", 'origin="replica"'))
        assert nodes[0].metric("hotstart_memory_shards", 'origin="replica"') < 4
        (port,) = _free_ports(1)
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1",
            "--master-addr=127.0.0.1", f"--master-port={port}", TRAIN,
            *args, sockets(nodes[:1]), "--steps", "4", "--dcp", "--timeline",
        ]
        env = {k: v for k, v in os.environ.items() if not k.startswith("HOTSTART_")}
        env["OMP_NUM_THREADS"] = "1"
        job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        out = []
        killed = False
        assert job.stdout is not None
        for line in job.stdout:
            out.append(line)
            if line.startswith("at ready ") and not killed:
                for n in nodes[1:]:
                    n.proc.send_signal(signal.SIGSTOP)
                time.sleep(1)
                for n in nodes[1:]:
                    n.kill()
                killed = True
        _, err = job.communicate(timeout=300)
        text = "".join(out)
        assert job.returncode == 0, f"{text}\n{err}"
        # The fault happened: both peers were frozen and killed while the rank loaded.
        assert killed and all(n.proc.returncode == -signal.SIGKILL for n in nodes[1:]), text
        assert resumed(text) == [(4, 1)], text
        assert states(text) == [saved, saved], text
        # One restore of each saved rank, every one through the surviving node, some not from its memory.
        sources = {s: _restored(nodes[:1], s) for s in ("memory", "peer", "disk", "store")}
        print(f"restores of the saved ranks through the surviving node: {sources}")
        assert sum(sources.values()) == 3 and sources["memory"] < 3, (sources, text)
    finally:
        for s in nodes:
            s.stop()
