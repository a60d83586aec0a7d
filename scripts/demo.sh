#!/usr/bin/env bash
# The main job on the embedded default (a local directory as the store): build hotstart, copy a
# 256 MiB file into the store with striped parallel writes, list the store, copy it back with
# striped parallel reads, and prove the bytes are identical.
#
#   bash scripts/demo.sh [STORE_DIR]      (default: a fresh temporary directory)
#
# The same commands work against S3: set AWS_ENDPOINT_URL/AWS_REGION/credentials and use
# s3://bucket/prefix instead of file://DIR.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
STORE="${1:-$WORK/store}"
mkdir -p "$STORE"
STORE="$(cd "$STORE" && pwd)"

echo "==> building hotstart (release)"
cargo build --release --quiet --bin hotstart
HS="$ROOT/target/release/hotstart"

echo "==> making a 256 MiB file"
head -c $((256 << 20)) /dev/urandom >"$WORK/model.bin"

echo "==> hotstart store cp model.bin file://$STORE/runs/demo/model.bin"
"$HS" store cp "$WORK/model.bin" "file://$STORE/runs/demo/model.bin"

echo "==> hotstart store ls file://$STORE/runs/"
"$HS" store ls "file://$STORE/runs/"

echo "==> hotstart store cp file://$STORE/runs/demo/model.bin back.bin"
"$HS" store cp "file://$STORE/runs/demo/model.bin" "$WORK/back.bin"

a="$(sha256sum <"$WORK/model.bin" | cut -d' ' -f1)"
b="$(sha256sum <"$WORK/back.bin" | cut -d' ' -f1)"
echo "source     sha256 $a"
echo "round trip sha256 $b"
if [ "$a" != "$b" ]; then
    echo "FAILED: the round trip changed the bytes" >&2
    exit 1
fi
echo "==> round trip bit-exact"
