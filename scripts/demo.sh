#!/usr/bin/env bash
# The main job on the embedded default (a local directory as the store): build hotstart and run
# `hotstart demo`: 3 sidecars and 3 trainers with about 1 GiB of state each on this machine,
# a trainer killed with kill -9, a whole node killed, a corrupt chunk on disk, each recovered
# from the nearest tier and proved bit-exact, then a summary table.
#
#   bash scripts/demo.sh                    # the defaults (needs about 20 GiB of memory)
#   bash scripts/demo.sh --size 256MiB      # any `hotstart demo` flags (see --help)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

echo "==> building hotstart (release)" >&2
cargo build --release --quiet --bin hotstart
exec "$ROOT/target/release/hotstart" demo "$@"
