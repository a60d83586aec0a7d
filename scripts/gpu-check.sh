#!/usr/bin/env bash
# The GPU check, in two halves.
#
#   bash scripts/gpu-check.sh build   # here: Rust toolchain and crates.io at hand
#   bash .gpu-check/gpu-check.sh run  # on the GPU machine: driver, PyTorch, Python 3.9+,
#                                     #   no Rust and no network needed
#
# `build` puts everything the GPU machine runs into one git-ignored folder (GPU_CHECK_DIR,
# default .gpu-check/, under 64 MiB): the CUDA test binary of hotstart-ckpt, the stall
# benchmark (ckpt/examples/gpu_stall.rs), a wheel of the Python package (abi3, CUDA path built
# in), the Python half of the check (scripts/gpu_check.py) and this script.
#
# `run`, from that folder, runs with a time limit per part:
#   1. the CUDA tests of hotstart-ckpt (device tensors round trip bit-exact into host memory and
#      device buffers; bad ordinals and driver errors are clear errors);
#   2. the Python checks and figures (gpu_check.py): torch CUDA tensors through Checkpointer and
#      torch.distributed.checkpoint bit-exact; save stall against the raw pinned D2H copy and
#      DCP async_save's blocking part; restore into device tensors against the raw H2D copy;
#   3. the Rust stall benchmark at 4 and 16 GiB (engine stall against a raw cuMemcpyDtoHAsync);
#   4. a PyTorch job under torchrun (examples/torchrun/train.py, NCCL): a worker killed after a
#      save resumes from the sidecar's memory bit-exact; its restart against its floor;
#   5. a training loop (gpu_check.py --train-loop): the training time a checkpoint costs, hotstart
#      (local disk, and through the sidecar) against the raw pinned D2H copy and DCP async_save
#      (default, and with pinned-memory staging); hotstart's last checkpoint bit-exact.
# It writes results/summary.md (one Markdown table, then each part's output) and
# results/summary.json, and prints the summary. Without a GPU it says so and exits 0.
#
# GPU_CHECK_SELFTEST=1 runs the same steps without a GPU (the Python half on small CPU tensors,
# the Rust benchmark's "no driver" exit counted as skipped): how this script is tested.
# GPU_CHECK_GIB="4" measures only those sizes in the Python part (default "4 16").
# GPU_CHECK_PARTS="cuda-tests python" runs only those parts (default: all six), for a rerun.
# GPU_CHECK_PROFILE=dev builds the bundle with the dev profile instead of release: the same
# parts, from what `cargo test` and `maturin develop` already compiled, in about a minute. For
# testing this script only (the 64 MiB bound is not checked); figures want the default, release.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
LIMIT_BYTES=$((64 << 20))

usage() {
    sed -n '2,28p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
    exit 2
}

build() {
    local root out
    root="$(cd "$HERE/.." && pwd)"
    out="${GPU_CHECK_DIR:-$root/.gpu-check}"
    local profile="${GPU_CHECK_PROFILE:-release}" dir
    case "$profile" in release) dir=release ;; dev) dir=debug ;;
        *) echo "gpu-check: GPU_CHECK_PROFILE is release or dev, not '$profile'" >&2; exit 2 ;;
    esac
    cd "$root"
    rm -rf "$out"
    mkdir -p "$out/bin" "$out/wheel"
    # Every part is built with the workspace's feature set, the one `cargo test --workspace`
    # uses, plus CUDA (the wheel through bindings' `workspace-features`): the dependencies are
    # compiled once for all of them (and, with the dev profile, not at all after `cargo test`).
    local scope=(--profile "$profile" --workspace --features hotstart-ckpt/cuda)
    echo "==> CUDA tests of hotstart-ckpt ($profile, --features cuda)" >&2
    local exe
    exe="$(cargo test "${scope[@]}" --test cuda --no-run \
        --message-format=json | python3 -c '
import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m["target"]["name"] == "cuda" and m.get("executable"):
        print(m["executable"])')"
    [ -x "$exe" ] || { echo "gpu-check: no CUDA test binary was built" >&2; exit 1; }
    cp "$exe" "$out/bin/ckpt-cuda-tests"
    echo "==> stall benchmark (ckpt/examples/gpu_stall.rs) and the hotstart binary" >&2
    cargo build "${scope[@]}" --quiet --example gpu_stall --bin hotstart
    cp "target/$dir/examples/gpu_stall" "$out/bin/gpu_stall"
    cp "target/$dir/hotstart" "$out/bin/hotstart"
    strip "$out"/bin/*
    echo "==> wheel of the Python package (abi3, CUDA path built in)" >&2
    local maturin="maturin"
    [ -x "$root/.venv/bin/maturin" ] && maturin="$root/.venv/bin/maturin"
    (cd bindings && "$maturin" build --profile "$profile" --features cuda,workspace-features \
        --strip --quiet --out "$out/wheel" >&2)
    cp scripts/gpu_check.py scripts/gpu-check.sh examples/torchrun/train.py "$out/"
    local size
    size="$(du -sb "$out" | cut -f1)"
    # The bound is the device machine's, for the release bundle it takes; a dev bundle (its
    # unoptimised code larger) only tests this script and never travels.
    if [ "$profile" = release ] && [ "$size" -ge "$LIMIT_BYTES" ]; then
        echo "gpu-check: $out is $size bytes, over the 64 MiB the device machine takes" >&2
        exit 1
    fi
    echo "gpu-check: built $out ($((size >> 20)) MiB): run 'bash gpu-check.sh run' there" >&2
}

# Runs part $1 (a name) with a limit of $2 seconds: the command that follows, its output to
# results/<name>.txt; records its status.
STATUS=()
part() {
    local name="$1" limit="$2"
    shift 2
    if [ -n "${GPU_CHECK_PARTS:-}" ] && [[ " $GPU_CHECK_PARTS " != *" $name "* ]]; then
        STATUS+=("$name|not run (GPU_CHECK_PARTS)|")
        return
    fi
    echo "==> $name (at most ${limit}s)" >&2
    # Each part's temporary files in a folder of its own, removed after it: a part stopped at its
    # limit leaves gigabytes behind, and the next part needs the disk.
    local tmp="$GPU_CHECK_TMP/gpu-check-$name" rc=0
    rm -rf "$tmp" && mkdir -p "$tmp"
    TMPDIR="$tmp" GPU_CHECK_TMP="$tmp" timeout "$limit" "$@" > "$HERE/results/$name.txt" 2>&1 || rc=$?
    rm -rf "$tmp"
    case "$rc" in
        0) STATUS+=("$name|passed|") ;;
        2) if [ -n "${GPU_CHECK_SELFTEST:-}" ]; then
               STATUS+=("$name|skipped: $(head -n 1 "$HERE/results/$name.txt" | sed 's/^skipping: //')|")
           else
               STATUS+=("$name|failed (exit 2)|")
           fi ;;
        124) STATUS+=("$name|timed out after ${limit}s|") ;;
        *) STATUS+=("$name|failed (exit $rc)|") ;;
    esac
    tail -n 40 "$HERE/results/$name.txt" >&2
}

run() {
    local py="${PYTHON:-python3}"
    local selftest="${GPU_CHECK_SELFTEST:-}"
    if [ -z "$selftest" ] && ! "$py" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
        echo "gpu-check: no GPU here (no torch, or torch.cuda.is_available() is False): nothing to run"
        exit 0
    fi
    local wheel
    wheel="$(ls "$HERE"/wheel/*.whl 2>/dev/null | head -n 1)"
    [ -n "$wheel" ] || { echo "gpu-check: no wheel in $HERE/wheel: run 'gpu-check.sh build' first" >&2; exit 1; }
    mkdir -p "$HERE/results"
    rm -rf "$HERE/site"
    "$py" -m pip install --quiet --no-deps --no-index --target "$HERE/site" "$wheel"
    export PYTHONPATH="$HERE/site${PYTHONPATH:+:$PYTHONPATH}"
    export PYTHONUNBUFFERED=1
    export GPU_CHECK_TMP="${GPU_CHECK_TMP:-${TMPDIR:-/tmp}}"
    # The limits add up to 585 s: with the wheel's install and the summary, within a device
    # command's 10 minutes. Every part but the Python one takes well under its limit.
    # The Rust figures first: they are short, and the Python part (which also writes to disk)
    # keeps what it measured if it runs out of time.
    part cuda-tests 30 "$HERE/bin/ckpt-cuda-tests" --test-threads 1
    part stall-4gib 45 "$HERE/bin/gpu_stall" --gib 4 --tensors 64 --runs 5
    part stall-16gib 75 "$HERE/bin/gpu_stall" --gib 16 --tensors 64 --runs 2
    local device_arg=()
    [ -n "$selftest" ] && device_arg=(--device cpu)
    part torchrun 100 "$py" "$HERE/gpu_check.py" --out "$HERE/results" --torchrun "$HERE/train.py" \
        --hotstart "$HERE/bin/hotstart" "${device_arg[@]}"
    part train-loop 100 "$py" "$HERE/gpu_check.py" --out "$HERE/results" --train-loop \
        --hotstart "$HERE/bin/hotstart" "${device_arg[@]}"
    if [ -n "$selftest" ]; then
        part python 300 "$py" "$HERE/gpu_check.py" --out "$HERE/results" --device cpu --gib 0.03125 --runs 1 \
            --hotstart "$HERE/bin/hotstart"
    else
        # shellcheck disable=SC2086 # a list of sizes
        part python 235 "$py" "$HERE/gpu_check.py" --out "$HERE/results" --gib ${GPU_CHECK_GIB:-4 16} \
            --runs 3 --hotstart "$HERE/bin/hotstart"
    fi
    local device
    device="$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -n 1 || true)"
    {
        echo "# GPU check: ${device:-unknown device}"
        echo
        echo "| part | result |"
        echo "|---|---|"
        for s in "${STATUS[@]}"; do
            IFS='|' read -r name result _ <<< "$s"
            echo "| $name | $result |"
        done
        for md in python torchrun train_loop; do
            if [ -f "$HERE/results/$md.md" ]; then
                echo
                cat "$HERE/results/$md.md"
            fi
        done
        for name in cuda-tests stall-4gib stall-16gib; do
            [ -f "$HERE/results/$name.txt" ] || continue
            echo
            echo "## $name"
            echo
            echo '```'
            tail -n 30 "$HERE/results/$name.txt"
            echo '```'
        done
    } > "$HERE/results/summary.md"
    "$py" - "$HERE/results" "${device:-unknown}" "${STATUS[@]}" <<'EOF'
import json, pathlib, sys
out, device, parts = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
summary = {"device": device, "parts": {p.split("|")[0]: p.split("|")[1] for p in parts}}
for name in ("python", "torchrun", "train_loop"):
    part = out / f"{name}.json"
    if part.exists():
        summary[name] = json.loads(part.read_text())
(out / "summary.json").write_text(json.dumps(summary, indent=2))
EOF
    echo
    cat "$HERE/results/summary.md"
    for s in "${STATUS[@]}"; do
        [[ "$s" == *"|passed|" || "$s" == *"|skipped: "* || "$s" == *"|not run ("* ]] || exit 1
    done
}

case "${1:-}" in
    build) build ;;
    run) run ;;
    *) usage ;;
esac
