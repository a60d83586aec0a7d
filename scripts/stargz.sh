#!/usr/bin/env bash
# Installs stargz-snapshotter for `hotstart-benches container`, which compares hotstart's
# snapshotter with it on the same image and link. Idempotent.
#
#   - apt packages: stargz-snapshotter (ctr-remote, which converts images to eStargz),
#     golang-github-containerd-stargz-snapshotter-dev (its library: Debian does not package
#     the daemon) and golang-go.
#   - .cache/bin/stargz-grpc (gitignored): benches/peers/stargz/main.go, the library served as
#     a containerd proxy snapshotter, built offline against Debian's Go sources.
#
# Run as root, or as a user with sudo. Needs network access to Debian apt only when a package
# is missing.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SRC="$ROOT/benches/peers/stargz"
OUT="$ROOT/.cache/bin/stargz-grpc"

say() { printf 'stargz: %s\n' "$*"; }
as_root() { if [ "$(id -u)" -eq 0 ]; then "$@"; else sudo "$@"; fi; }

missing=()
for pkg in stargz-snapshotter golang-github-containerd-stargz-snapshotter-dev golang-go; do
    dpkg -s "$pkg" 2>/dev/null | grep -q '^Status: install ok installed' || missing+=("$pkg")
done
if [ "${#missing[@]}" -gt 0 ]; then
    say "installing ${missing[*]}"
    as_root apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

if [ -x "$OUT" ] && [ "$OUT" -nt "$SRC/main.go" ]; then
    say "$OUT is up to date"
    exit 0
fi
mkdir -p "$(dirname "$OUT")"
say "building $OUT"
# GOPATH mode over Debian's packaged sources: no module download.
(cd "$SRC" && env GOPATH=/usr/share/gocode GO111MODULE=off GOFLAGS= GOTOOLCHAIN=local \
    GOCACHE="$ROOT/.cache/go-build" go build -o "$OUT" .)
say "built $OUT"
