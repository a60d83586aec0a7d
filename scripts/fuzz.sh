#!/usr/bin/env bash
# Fuzzing: one coverage-guided target per parser of bytes from outside the process (fuzz/,
# libFuzzer through the libfuzzer-sys crate, built on the stable toolchain with LLVM's coverage
# instrumentation, in the layout `cargo fuzz` reads).
#
#   scripts/fuzz.sh build                       build every target (target/fuzz)
#   scripts/fuzz.sh run [SECONDS] [TARGET...]   each target's regressions, then SECONDS (default
#                                               20) of fuzzing from its seeds; the CI pass. It
#                                               builds the `smoke` profile (fuzz/Cargo.toml):
#                                               a shorter build, fewer executions a second
#   scripts/fuzz.sh campaign [RUNS] [TARGET...] RUNS executions per target (default 10000000),
#                                               two targets at a time; a summary per target in
#                                               target/fuzz/campaign/<target>.log
#   scripts/fuzz.sh seeds                       rewrite the seeds in fuzz/corpus/<target>/
#
# A crash (panic, abort, an allocation above the target's bound, a timeout or more than 2 GiB
# of memory) stops its target and leaves the input in target/fuzz/artifacts/<target>/; add it
# to fuzz/regressions/<target>/ once fixed. Every run replays those first, with the hostile
# inputs kept there that must stay within bounds (decompression bombs).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
triple="$(rustc -vV | sed -n 's/^host: //p')"
out="$root/target/fuzz"
# The cargo profile the targets are built with: `release` (the most executions per second) unless
# a command or HOTSTART_FUZZ_PROFILE says otherwise.
profile="${HOTSTART_FUZZ_PROFILE:-}"
bin() { echo "$out/$triple/${profile:-release}"; }
targets_all() { ls fuzz/fuzz_targets | sed 's/\.rs$//'; }

build() {
    # Instrumentation for the fuzz targets' code and their dependencies only: `--target` keeps
    # the flags away from build scripts and procedural macros.
    RUSTFLAGS="-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
-Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
-Cllvm-args=-sanitizer-coverage-trace-compares --cfg fuzzing -Cdebug-assertions -Coverflow-checks" \
        cargo build --profile "${profile:-release}" --locked --manifest-path fuzz/Cargo.toml --target "$triple" \
        --target-dir "$out" --bins
}

# One target: libFuzzer with the bounds every run uses, new inputs into a scratch corpus (the
# committed seeds stay as they are), crashes into target/fuzz/artifacts/<target>/.
fuzz_one() {
    local t="$1"; shift
    local work="$out/corpus/$t" art="$out/artifacts/$t"
    mkdir -p "$work" "$art" "fuzz/corpus/$t"
    local max_len=4096
    case "$t" in layer_tar|oci_index|tree|profile|local_frames|peer_messages) max_len=16384 ;; esac
    "$(bin)/$t" "$work" "fuzz/corpus/$t" -artifact_prefix="$art/" -max_len="$max_len" \
        -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 "$@"
}

# The inputs of fuzz/regressions/<target>/, each run once.
regressions() {
    local t="$1" dir="fuzz/regressions/$1" log="$out/regressions-$1.log"
    compgen -G "$dir/*" >/dev/null || return 0
    if ! "$(bin)/$t" -rss_limit_mb=2048 -timeout=10 "$dir"/* >"$log" 2>&1; then
        tail -40 "$log"
        echo "fuzz target $t failed on an input of $dir" >&2
        return 1
    fi
    echo "$(ls "$dir" | wc -l) regression inputs pass"
}

cleanup() { rm -rf /dev/shm/hotstart-fuzz-*; }

case "${1:-run}" in
    build) build ;;
    run)
        shift || true
        seconds="${1:-20}"; shift || true
        profile="${profile:-smoke}"
        build
        trap cleanup EXIT
        for t in ${@:-$(targets_all)}; do
            echo "== $t: regressions, then $seconds s"
            regressions "$t"
            log="$out/run-$t.log"
            if ! fuzz_one "$t" -max_total_time="$seconds" >"$log" 2>&1; then
                tail -40 "$log"
                echo "fuzz target $t failed; its input is in target/fuzz/artifacts/$t/" >&2
                exit 1
            fi
            grep -E "^(Done|stat::number_of_executed_units)" "$log" | tr '\n' ' '; echo
        done ;;
    campaign)
        shift || true
        runs="${1:-10000000}"; shift || true
        build
        trap cleanup EXIT
        mkdir -p "$out/campaign"
        export HOTSTART_FUZZ_PROFILE="${profile:-release}"
        printf '%s\n' ${@:-$(targets_all)} | xargs -P 2 -I{} sh -c \
            "'$0' one {} -runs=$runs > '$out/campaign/{}.log' 2>&1; echo \"{}: exit \$? \$(grep -E '^#[0-9]+[[:space:]]+DONE|^stat::(number_of_executed_units|peak_rss_mb)' '$out/campaign/{}.log' | tr '\n' ' ')\""
        ;;
    one) shift; t="$1"; shift; fuzz_one "$t" "$@" ;;
    seeds) "$root/.venv/bin/python" fuzz/seeds.py ;;
    *) echo "usage: $0 build | run [SECONDS] [TARGET...] | campaign [RUNS] [TARGET...] | seeds" >&2; exit 2 ;;
esac
