//! Small OS helpers.

use std::path::Path;

use crate::error::Result;

/// This machine's host name (`"unknown"` if it has none).
pub fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: `buf` is writable for its whole length, which is what we pass.
    let rc = unsafe { libc::gethostname(buf.as_mut_ptr().cast(), buf.len()) };
    if rc != 0 {
        return "unknown".to_string();
    }
    let end = buf.iter().position(|b| *b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

/// Sets the access and modification times of `path` to `mtime_ns`, without following a symlink
/// when `nofollow`.
pub fn set_mtime(path: &Path, mtime_ns: i64, nofollow: bool) -> Result<()> {
    Ok(hotstart_store::tree::set_mtime(path, mtime_ns, nofollow)?)
}

pub use hotstart_store::tree::rename2;

/// `st_mtime` of `m` in nanoseconds.
pub fn mtime_ns(m: &std::fs::Metadata) -> i64 {
    use std::os::unix::fs::MetadataExt;
    m.mtime() * 1_000_000_000 + m.mtime_nsec()
}
