#!/usr/bin/env bash
# Downloads a wheelhouse once: scripts/wheelhouse.sh NAME REQUIREMENTS [PIP DOWNLOAD ARGS...]
#
# Wheels land in <repo>/.cache/wheelhouse/NAME (gitignored) for the interpreter of .venv, so
# installs from it need no network (`pip install --no-index --find-links DIR`). A stamp file
# holds the hash of the requirements and arguments: a second run with the same inputs does
# nothing and needs no network. Extra arguments go to `pip download` (default: wheels only).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
NAME="${1:?usage: wheelhouse.sh NAME REQUIREMENTS [PIP DOWNLOAD ARGS...]}"
REQ="${2:?usage: wheelhouse.sh NAME REQUIREMENTS [PIP DOWNLOAD ARGS...]}"
shift 2
ARGS=("$@")
[ "${#ARGS[@]}" -eq 0 ] && ARGS=(--only-binary=:all:)
PY="${HOTSTART_WHEELHOUSE_PYTHON:-$ROOT/.venv/bin/python}"
DIR="$ROOT/.cache/wheelhouse/$NAME"
STAMP="$DIR/.complete"

want="$( { cat "$REQ"; printf '%s\n' "${ARGS[@]}"; "$PY" -c 'import sys; print(sys.version)'; } | sha256sum | cut -d' ' -f1)"
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
    echo "wheelhouse: $NAME present ($DIR)"
    exit 0
fi
mkdir -p "$DIR"
# One download at a time per wheelhouse (tests may ask concurrently).
exec 9>"$DIR/.lock"
flock 9
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
    exit 0
fi
echo "wheelhouse: downloading $NAME from ${REQ#"$ROOT"/} into $DIR"
"$PY" -m pip download --disable-pip-version-check -q -d "$DIR" "${ARGS[@]}" -r "$REQ"
echo "$want" >"$STAMP"
