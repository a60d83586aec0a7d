//! Small OS helpers.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
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

/// Renames `from` to `to`; with `exchange`, atomically swaps the two (both must exist), else
/// fails if `to` exists.
pub fn rename2(from: &Path, to: &Path, exchange: bool) -> std::io::Result<()> {
    let a = CString::new(from.as_os_str().as_bytes())?;
    let b = CString::new(to.as_os_str().as_bytes())?;
    let flags = if exchange {
        libc::RENAME_EXCHANGE
    } else {
        libc::RENAME_NOREPLACE
    };
    // SAFETY: both paths are valid NUL-terminated strings that outlive the call.
    let rc = unsafe {
        libc::renameat2(
            libc::AT_FDCWD,
            a.as_ptr(),
            libc::AT_FDCWD,
            b.as_ptr(),
            flags,
        )
    };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// `st_mtime` of `m` in nanoseconds.
pub fn mtime_ns(m: &std::fs::Metadata) -> i64 {
    use std::os::unix::fs::MetadataExt;
    m.mtime() * 1_000_000_000 + m.mtime_nsec()
}
