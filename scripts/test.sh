#!/usr/bin/env bash
# The project's test command (the README's and CI's): setup, format check, clippy, tests.
#
# Tests run with `cargo test` (not nextest) so that every test binary starts one SeaweedFS
# server and shares it among its tests. HOTSTART_WEED points at the venv's `weed`. With CI set
# (non-empty, not "false"/"0"), tests that need a real part refuse to skip and fail instead.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

# Each section says how long the one before it took, so a slow CI run shows where its time went.
start=$SECONDS
last=$SECONDS
section() {
    printf '\n==== %s ==== (previous section %ds, %ds in all)\n' "$*" $((SECONDS - last)) $((SECONDS - start))
    last=$SECONDS
}

section "setup"
bash scripts/setup.sh

export HOTSTART_WEED="$ROOT/.venv/bin/weed"
export HOTSTART_ROOT="$ROOT"
export CI="${CI:-}"
export RUST_BACKTRACE="${RUST_BACKTRACE:-1}"

section "cargo fmt --check"
cargo fmt --all -- --check

# Clippy's lints run inside the test build: clippy-driver compiles the workspace's own crates
# (RUSTC_WORKSPACE_WRAPPER, as `cargo clippy` sets it), so the dependencies are built once rather
# than checked for clippy and built again for the tests. Exported, so that the later builds of
# the workspace (maturin, the GPU check's bundle in pytest) find the same artifacts.
export RUSTC_WORKSPACE_WRAPPER="$(rustc --print sysroot)/bin/clippy-driver"

# With the `cuda` feature, as the Python package and the GPU check's bundle are built. Without a
# driver the code runs as on any machine without a GPU (the CUDA tests skip, saying so).
section "cargo test: build, clippy's lints as errors"
cargo test --workspace --features hotstart-ckpt/cuda --no-run --message-format=json \
    | python3 scripts/lints.py
# The code that stands in for the GPU path in a build without the feature.
cargo clippy -p hotstart-ckpt --all-targets -- -D warnings

section "cargo test"
cargo test --workspace --features hotstart-ckpt/cuda

# Every parser of bytes from outside the process, fuzzed briefly: its crash regressions, then
# a few seconds of new inputs from its seed corpus (scripts/fuzz.sh campaign is the long run).
# The targets are a workspace of their own, instrumented, and compiled by plain rustc.
section "fuzz: a short pass over every target"
env -u RUSTC_WORKSPACE_WRAPPER bash scripts/fuzz.sh run "${HOTSTART_FUZZ_SECONDS:-6}"

# The Python package: build the extension (with the cuda feature, see bindings/pyproject.toml)
# into .venv, then run its tests against it. GPU tests skip, saying so, without a GPU.
# `workspace-features` (bindings/Cargo.toml) lets it reuse the test build's dependencies.
section "python: maturin develop"
(cd bindings && VIRTUAL_ENV="$ROOT/.venv" PATH="$ROOT/.venv/bin:$PATH" \
    maturin develop --features cuda,workspace-features)

section "pytest"
.venv/bin/python -m pytest bindings/tests -q -rs --durations=12

section "all checks passed"
