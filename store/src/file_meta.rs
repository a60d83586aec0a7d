//! File metadata helpers shared by the tree's materialisation and the chunk cache's hard links.

use std::path::Path;

use crate::error::{Error, Result};

/// Sets the permission bits and the access and modification times of an open file.
pub(crate) fn set_fd_metadata(
    file: &std::fs::File,
    path: &Path,
    mode: u32,
    mtime_ns: i64,
) -> Result<()> {
    use std::os::fd::AsRawFd;
    let fd = file.as_raw_fd();
    let ts = libc::timespec {
        tv_sec: mtime_ns.div_euclid(1_000_000_000),
        tv_nsec: mtime_ns.rem_euclid(1_000_000_000),
    };
    let times = [ts, ts];
    // SAFETY: `fd` is open for as long as `file`, which outlives both calls; `times` points to two
    // initialised timespecs that outlive the call.
    unsafe {
        if libc::fchmod(fd, mode & 0o7777) != 0 {
            return Err(Error::io("set mode", path, std::io::Error::last_os_error()));
        }
        if libc::futimens(fd, times.as_ptr()) != 0 {
            return Err(Error::io(
                "set mtime",
                path,
                std::io::Error::last_os_error(),
            ));
        }
    }
    Ok(())
}
