"""Clippy's `-D warnings` for a build that also makes the test binaries.

Reads a cargo build's JSON messages (`--message-format=json`) on stdin, with clippy-driver as
the workspace's compiler (RUSTC_WORKSPACE_WRAPPER), prints every warning and error given for
this workspace's code, and exits 1 if there was any. Cargo replays a fresh crate's warnings, so
a build with nothing left to compile still reports them.
"""

import json
import sys

found = 0
for line in sys.stdin:
    msg = json.loads(line)
    if msg.get("reason") == "compiler-message" and msg["message"]["level"] in ("warning", "error"):
        found += 1
        sys.stderr.write(msg["message"]["rendered"])
if found:
    sys.exit(f"lints: {found} warning(s) or error(s) in this workspace's code; fix them")
