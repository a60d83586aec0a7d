"""Writes the fuzz targets' seeds into their corpora (fuzz/corpus/<target>/): well-formed
inputs of every kind each parser reads, made by this project's own writers where they exist (a
checkpoint saved through the Python API, an image built by `hotstart image build`, an
environment published by `hotstart env ensure`) and by hand, from docs/PROTOCOL.md and the
formats' definitions, where they do not. The fuzzer mutates them; seeds only have to reach deep
into each parser.

    .venv/bin/python fuzz/seeds.py        (scripts/fuzz.sh seeds; needs target/release/hotstart)
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import struct
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path
from typing import Dict, List

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "fuzz" / "corpus"
HOTSTART = os.environ.get("HOTSTART_BIN", str(ROOT / "target" / "release" / "hotstart"))


def write(target: str, name: str, data: bytes) -> None:
    d = CORPUS / target
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_bytes(data)


def zstd(data: bytes) -> bytes:
    return subprocess.run(["zstd", "-q", "-c", "-3"], input=data, capture_output=True, check=True).stdout


def frame(kind: int, payload: bytes) -> bytes:
    """A wire frame: magic, version 1, kind (1 message, 2 data), reserved 0, length, payload."""
    return b"HSWP" + bytes([1, kind, 0, 0]) + struct.pack("<I", len(payload)) + payload


def msg(m: Dict[str, object]) -> bytes:
    return frame(1, json.dumps(m).encode())


def files_under(d: Path) -> List[Path]:
    return sorted(p for p in d.rglob("*") if p.is_file())


def checkpoint(tmp: Path) -> Dict[str, bytes]:
    """A real step: saved by examples/train_numpy.py through the Python API."""
    local = tmp / "ckpt"
    subprocess.run(
        [sys.executable, str(ROOT / "examples" / "train_numpy.py"), "--local-dir", str(local),
         "--job", "seed", "--steps", "4", "--every", "2"],
        check=True, capture_output=True,
    )
    manifests = [p for p in files_under(local) if p.name.endswith(".json")]
    assert manifests, f"no manifest under {local}"
    return {"manifest": manifests[-1].read_bytes()}


def safetensors(tensors: Dict[str, tuple], metadata: Dict[str, str]) -> bytes:
    header: Dict[str, object] = {"__metadata__": metadata} if metadata else {}
    data = b""
    sizes = {"F32": 4, "F16": 2, "BF16": 2, "I64": 8, "U8": 1, "F64": 8, "BOOL": 1}
    for name, (dtype, shape) in tensors.items():
        n = sizes[dtype]
        for s in shape:
            n *= s
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [len(data), len(data) + n]}
        data += bytes(range(256)) * (n // 256) + bytes(n % 256)
    h = json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + data


def seed_ckpt(tmp: Path) -> Dict[str, bytes]:
    step = checkpoint(tmp)
    write("manifest", "saved", step["manifest"])
    m = json.loads(step["manifest"])
    write("manifest", "no-extras", json.dumps({k: v for k, v in m.items() if k != "extras"}).encode())
    # The selector byte (0) says the file ends where the bytes do.
    write("safetensors_header", "two", b"\0" + safetensors({"w": ("F32", (4, 4)), "b": ("F16", (8,))}, {"step": "3"}))
    write("safetensors_header", "empty", b"\0" + safetensors({}, {}))
    write("safetensors_header", "scalar", b"\0" + safetensors({"s": ("I64", ()), "z": ("U8", (0,))}, {}))
    short = safetensors({"w": ("BF16", (2, 3))}, {})
    write("safetensors_header", "truncated", bytes([12]) + short[:-12])
    return m


def seed_wire(manifest: Dict[str, object]) -> None:
    local = [
        {"op": "attach", "version": 1, "job": "seed", "rank": 0, "world_size": 2},
        {"op": "attached", "node": "node-a", "tiers": ["memory", "peer", "disk", "store"]},
        {"op": "stage", "step": 10, "len": 4096, "wait": True, "ahead": False},
        {"op": "segment", "len": 4096},
        {"op": "filled", "manifest": json.dumps(manifest)},
        {"op": "commit"},
        {"op": "committed"},
        {"op": "persisted", "tier": "disk", "error": None},
        {"op": "restore", "step": None, "file": True},
        {"op": "restored", "step": 10, "source": "memory", "manifest": json.dumps(manifest),
         "chunk_sources": ["memory", "store"], "seconds": 0.25, "file": False},
        {"op": "latest"},
        {"op": "latest_below", "step": 10},
        {"op": "latest_is", "step": 8},
        {"op": "not_found", "step": None},
        {"op": "corrupt", "step": 10, "chunk": 3, "reason": "hash"},
        {"op": "failed", "reason": "no"},
        {"op": "draining"},
        {"op": "unavailable", "tier": "store", "reason": "connection refused"},
    ]
    # Selector 0: every frame is a message; 0b10: the second is data.
    write("local_frames", "session", b"\0" + b"".join(msg(m) for m in local))
    write("local_frames", "data", bytes([0b10]) + msg(local[0]) + frame(2, bytes(range(200))) + msg(local[5]))
    for i, m in enumerate(local):
        write("local_frames", f"one-{i}", b"\0" + msg(m))

    nonce = "ab" * 32
    hello = {"op": "hello", "version": 1, "node": "node-b", "domain": "cluster.local", "nonce": nonce}
    challenge = {"op": "challenge", "node": "node-b", "domain": "", "nonce": nonce, "proof": "cd" * 32}
    write("peer_handshake", "server", b"\0" + msg(hello) + msg({"op": "proof", "proof": "ef" * 32}))
    write("peer_handshake", "client", b"\1" + msg(challenge) + msg({"op": "welcome"}))
    write("peer_handshake", "refused", b"\1" + msg({"op": "refused", "reason": "connected to itself"}))
    write("peer_handshake", "wrong-first", b"\0" + msg({"op": "inventory", "job": None}))

    job, step, rank, ws, file_len = (manifest.get(k) for k in ("job", "step", "rank", "world_size", "file_len"))
    shard = {"job": job, "rank": rank, "step": step, "world_size": ws, "len": file_len,
             "origin": "node-a", "held": "memory"}
    peer = [
        {"op": "inventory", "job": job},
        {"op": "held", "shards": [shard, dict(shard, held="disk", rank=1)]},
        {"op": "push", "shard": shard, "manifest": json.dumps(manifest)},
        {"op": "ready"},
        {"op": "stored"},
        {"op": "fetch", "job": job, "rank": rank, "step": step},
        {"op": "shard", "shard": shard, "manifest": json.dumps(manifest)},
        {"op": "not_found"},
        {"op": "failed", "reason": "busy"},
    ]
    write("peer_messages", "session", b"".join(msg(m) for m in peer))
    for i, m in enumerate(peer):
        write("peer_messages", f"one-{i}", msg(m))


def build_image(tmp: Path) -> Path:
    src = tmp / "image-src"
    (src / "bin").mkdir(parents=True)
    (src / "bin" / "tool").write_bytes(b"#!/bin/sh\necho hi\n" * 40)
    (src / "data.bin").write_bytes(bytes(range(256)) * 20)
    (src / "empty").write_bytes(b"")
    os.symlink("bin/tool", src / "link")
    store = tmp / "image-store"
    subprocess.run([HOTSTART, "image", "build", "--store", str(store), "--name", "seed/one:1",
                    "--chunk-kib", "4", str(src)], check=True, capture_output=True)
    return store


def seed_store(tmp: Path) -> None:
    store = build_image(tmp)
    trees, frames = 0, 0
    for p in files_under(store):
        b = p.read_bytes()
        if b.startswith(b"HSTREE") and trees < 3:
            write("tree", f"built-{trees}", b)
            trees += 1
        elif b.startswith(b"\x28\xb5\x2f\xfd") and len(b) <= 4096 and frames < 4:
            write("chunk_frame", f"stored-{frames}", b)
            frames += 1
    assert trees and frames, f"no tree or chunk frame under {store}"
    records = [p for p in files_under(store) if p.name == "image.json"]
    assert records, f"no image record under {store}"
    write("image_record", "built", records[0].read_bytes())
    write("image_record", "report", b"{}")
    write("chunk_frame", "empty", zstd(b""))


def tar_layer(entries: List[tarfile.TarInfo], contents: Dict[str, bytes], pax: bool = False) -> bytes:
    out = io.BytesIO()
    fmt = tarfile.PAX_FORMAT if pax else tarfile.GNU_FORMAT
    with tarfile.open(fileobj=out, mode="w", format=fmt) as t:
        for e in entries:
            data = contents.get(e.name)
            if data is not None:
                e.size = len(data)
            t.addfile(e, io.BytesIO(data) if data is not None else None)
    return out.getvalue()


def entry(name: str, kind: bytes = tarfile.REGTYPE, link: str = "", mode: int = 0o644) -> tarfile.TarInfo:
    e = tarfile.TarInfo(name)
    e.type, e.linkname, e.mode, e.mtime = kind, link, mode, 1_700_000_000
    return e


def seed_layers() -> None:
    files = {"usr/bin/app": b"\x7fELF" + bytes(300), "etc/conf": b"key = value\n", "./var/log/x": b"x"}
    plain = tar_layer(
        [entry("usr/", tarfile.DIRTYPE, mode=0o755), entry("usr/bin/", tarfile.DIRTYPE, mode=0o755),
         entry("usr/bin/app", mode=0o755), entry("etc/", tarfile.DIRTYPE), entry("etc/conf"),
         entry("usr/bin/sh", tarfile.SYMTYPE, "app"), entry("usr/bin/app2", tarfile.LNKTYPE, "usr/bin/app"),
         entry("./var/", tarfile.DIRTYPE), entry("./var/log/", tarfile.DIRTYPE), entry("./var/log/x")],
        files,
    )
    whiteouts = tar_layer(
        [entry("etc/", tarfile.DIRTYPE), entry("etc/.wh.conf"), entry("usr/", tarfile.DIRTYPE),
         entry("usr/.wh..wh..opq"), entry("usr/new")],
        {"etc/.wh.conf": b"", "usr/.wh..wh..opq": b"", "usr/new": b"new"},
    )
    pax_entries = [entry("opt/", tarfile.DIRTYPE), entry("opt/" + "long-name-" * 12)]
    pax_entries[1].pax_headers = {"mtime": "1700000000.123456789", "SCHILY.xattr.user.k": "v"}
    pax = tar_layer(pax_entries, {"opt/" + "long-name-" * 12: b"pax"}, pax=True)
    # The flags byte: bit 0 keeps whiteouts (a layer unpacked for overlayfs).
    for name, layer in [("plain", plain), ("whiteouts", whiteouts), ("pax", pax)]:
        write("layer_tar", f"{name}-applied", b"\0" + layer)
        write("layer_tar", f"{name}-kept", b"\1" + layer)
    write("layer_tar", "gzip", b"\0" + gzip.compress(plain, mtime=0))
    write("layer_tar", "zstd", b"\1" + zstd(whiteouts))
    write("layer_tar", "hostile", b"\0" + tar_layer([entry("../escape"), entry("/abs")], {"../escape": b"", "/abs": b""}))


def sha(b: bytes) -> str:
    return "sha256:" + hashlib.sha256(b).hexdigest()


def seed_oci() -> None:
    layer = {"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": "sha256:" + "a" * 64, "size": 10}
    config = {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": "sha256:" + "b" * 64, "size": 2}
    manifest = json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
                           "config": config, "layers": [layer, dict(layer, digest="sha256:" + "c" * 64)]}).encode()
    def index(entries: List[Dict[str, object]]) -> bytes:
        return json.dumps({"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json",
                           "manifests": entries}).encode()
    one = {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": sha(manifest), "size": len(manifest),
           "annotations": {"org.opencontainers.image.ref.name": "1"}}
    amd = dict(one, platform={"os": "linux", "architecture": "amd64"})
    arm = dict(one, platform={"os": "linux", "architecture": "arm64", "variant": "v8"})
    # The index, then each blob after a 0xFF byte.
    write("oci_index", "single", index([one]) + b"\xff" + manifest)
    write("oci_index", "platforms", index([amd, arm]) + b"\xff" + manifest)
    inner = index([amd])
    nested = {"mediaType": "application/vnd.oci.image.index.v1+json", "digest": sha(inner), "size": len(inner)}
    write("oci_index", "nested", index([nested]) + b"\xff" + inner + b"\xff" + manifest)
    write("oci_index", "docker", index([dict(one, mediaType="application/vnd.docker.distribution.manifest.v2+json")])
          + b"\xff" + manifest)
    write("oci_index", "no-manifest", index([]))


def seed_profile() -> None:
    ids = [hashlib.blake2b(bytes([i])).hexdigest()[:64] for i in range(3)]
    profile = {"runs": 3, "entries": [{"i": ids[0], "n": 4096, "r": 3, "l": 3, "t": [120, 80, 100]},
                                      {"i": ids[1], "n": 1, "r": 1, "l": 2, "t": [5000]}]}
    trace = {"run": "node-a-1", "updated_ms": 1700000000000, "finished": True,
             "accesses": [[ids[0], 4096, 100], [ids[2], 65536, 2500]]}
    version = struct.pack("<H", 1)
    # The selector byte: 0 a profile, 1 a trace.
    write("profile", "profile", b"\0" + b"HSPROF" + version + zstd(json.dumps(profile).encode()))
    write("profile", "empty", b"\0" + b"HSPROF" + version + zstd(b'{"runs":0,"entries":[]}'))
    write("profile", "trace", b"\1" + b"HSTRCE" + version + zstd(json.dumps(trace).encode()))


def pb_field(tag: int, value: bytes) -> bytes:
    """A protobuf length-delimited field (tags here are all below 16)."""
    out = bytes([tag << 3 | 2])
    n = len(value)
    while n >= 0x80:
        out += bytes([n & 0x7F | 0x80])
        n >>= 7
    return out + bytes([n]) + value


def pb_labels(tag: int, labels: Dict[str, str]) -> bytes:
    return b"".join(pb_field(tag, pb_field(1, k.encode()) + pb_field(2, v.encode())) for k, v in labels.items())


def op(code: int, body: bytes) -> bytes:
    return bytes([code]) + struct.pack("<H", len(body)) + body


def seed_snapshotter() -> None:
    sn = pb_field(1, b"hotstart")
    def prepare(key: str, parent: str = "", labels: Dict[str, str] = {}) -> bytes:
        return op(0, sn + pb_field(2, key.encode()) + pb_field(3, parent.encode()) + pb_labels(4, labels))
    def commit(name: str, key: str) -> bytes:
        return op(3, sn + pb_field(2, name.encode()) + pb_field(3, key.encode()))
    def keyed(code: int, key: str) -> bytes:
        return op(code, sn + pb_field(2, key.encode()))
    unpack = {"containerd.io/snapshot.ref": "sha256:" + "d" * 64}
    info = pb_field(1, b"layer-1") + pb_labels(6, {"a": "1", "b": "2"})
    update = op(6, sn + pb_field(2, info) + pb_field(3, pb_field(1, b"labels.a")))
    chain = (prepare("extract-1", "", unpack) + commit("layer-1", "extract-1") + prepare("extract-2", "layer-1")
             + commit("layer-2", "extract-2") + prepare("container", "layer-2") + keyed(2, "container")
             + op(1, sn + pb_field(2, b"view") + pb_field(3, b"layer-1")) + keyed(5, "layer-2") + update
             + op(7, sn + pb_field(2, b"labels.\"a\"==1") + pb_field(2, b"kind==committed"))
             + keyed(8, "layer-1") + keyed(4, "container") + keyed(4, "view") + op(9, b""))
    write("snapshotter", "chain", chain)
    write("snapshotter", "refusals", prepare("") + commit("x", "missing") + prepare("a", "missing")
          + keyed(4, "layer-1") + op(6, sn + pb_field(2, pb_field(1, b"k")) + pb_field(3, pb_field(1, b"kind"))))
    write("snapshotter", "remove-parent", prepare("a") + commit("b", "a") + prepare("c", "b") + keyed(4, "b"))


def seed_env(tmp: Path) -> None:
    store = tmp / "env-store"
    lock = tmp / "requirements.txt"
    lock.write_text("seed==1\n")
    target = tmp / "venv"
    install = f"mkdir -p {target}/bin && printf '#!{target}/bin/python\\n' > {target}/bin/tool && " \
              f"head -c 70000 /dev/urandom > {target}/data && ln -s {target}/bin/tool {target}/link"
    subprocess.run([HOTSTART, "env", "ensure", "--store", str(store), "--lock", str(lock), "--target",
                    str(target), "--", "sh", "-c", install], check=True, capture_output=True)
    records = [p for p in files_under(store) if p.name == "snapshot.json"]
    assert records, f"no snapshot record under {store}"
    raw = records[0].read_bytes()
    rec = json.loads(raw)
    # The fuzz entry reads the record of key 07...07.
    seeded = raw.replace(rec["key"].encode(), b"07" * 32)
    write("env_record", "published", seeded)
    write("env_record", "no-pack", json.dumps({k: v for k, v in json.loads(seeded).items() if k != "pack"}).encode())
    pack = rec.get("pack")
    assert pack, "the record names no pack"
    obj = next(p for p in files_under(store) if p.as_posix().endswith(pack["object"]))
    index_len = 12 + 36 * pack["chunks"]
    head = struct.pack("<QQ", pack["chunks"], pack["size"])
    write("pack_index", "published", head + obj.read_bytes()[:index_len])
    write("pack_index", "empty", struct.pack("<QQ", 0, 12) + b"HSPACK01" + bytes(4))


def seed_text() -> None:
    configs = {
        "full": """node_id = "node-a"
domain = "cluster.local"
listen = "0.0.0.0:7070"
http = "127.0.0.1:7071"
socket = "/run/hotstart/sidecar.sock"
socket_mode = "0o660"
peers = ["node-b=10.0.0.2:7070", "node-c=10.0.0.3:7070"]
replicas = 1
memory_budget = "8GiB"
store = "s3://bucket/ckpt"
disk_dir = "/var/lib/hotstart"
token = "a cluster token of enough bytes"
tls_dir = "/etc/hotstart/tls"
grace = "30s"
recovery_timeout = "30s"
keep = 2
peer_timeout = "30s"
probe_interval = "5s"
stage_timeout = "1m"
threads = 4
""",
        "insecure": 'node_id = "a"\nlisten = "127.0.0.1:7070"\nhttp = "127.0.0.1:0"\ninsecure = true\n'
                    'peers = ["b=127.0.0.1:7080,c=[::1]:7090"]\nreplicas = 2\nmemory_budget = "512MiB"\n',
        "dns": 'node_id = "a"\ntoken = "0123456789abcdef0123"\npeers_dns = "hotstart.ns.svc:7070"\n',
    }
    for name, text in configs.items():
        write("config", name, text.encode())
    for name, head in {
        "livez": b"GET /livez HTTP/1.1\r\nHost: node\r\n\r\n",
        "head": b"HEAD /metrics?x=1 HTTP/1.0\r\n\r\n",
        "post": b"POST /readyz HTTP/1.1\r\nContent-Length: 3\r\n\r\nabc",
        "bad": b"GET livez HTTP/2\r\n\r\n",
    }.items():
        write("http_request", name, head)


def main() -> None:
    with tempfile.TemporaryDirectory(prefix="hotstart-seeds-") as t:
        tmp = Path(t)
        manifest = seed_ckpt(tmp)
        seed_wire(manifest)
        seed_store(tmp)
        seed_layers()
        seed_oci()
        seed_profile()
        seed_snapshotter()
        seed_env(tmp)
        seed_text()
    for d in sorted(CORPUS.iterdir()):
        print(f"{d.name}: {len(list(d.iterdir()))} seeds")


if __name__ == "__main__":
    main()
