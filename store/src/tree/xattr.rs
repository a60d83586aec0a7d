//! Extended attributes of local files, read when a tree is built and written when it is
//! materialised. Symlinks are never followed (`l*xattr`).

use std::collections::BTreeMap;
use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

use crate::error::{Error, Result};

fn c_path(path: &Path) -> Result<CString> {
    CString::new(path.as_os_str().as_bytes()).map_err(|_| Error::UnsafePath {
        entry: path.display().to_string(),
        reason: "NUL in path".into(),
    })
}

/// Calls a size-probing xattr function twice: once for the size, once to fill the buffer
/// (retrying if the value grew in between).
fn sized(mut call: impl FnMut(*mut libc::c_void, usize) -> isize) -> std::io::Result<Vec<u8>> {
    loop {
        let n = call(std::ptr::null_mut(), 0);
        if n < 0 {
            return Err(std::io::Error::last_os_error());
        }
        let mut buf = vec![0u8; n as usize];
        let got = call(buf.as_mut_ptr().cast(), buf.len());
        if got >= 0 {
            buf.truncate(got as usize);
            return Ok(buf);
        }
        let err = std::io::Error::last_os_error();
        if err.raw_os_error() != Some(libc::ERANGE) {
            return Err(err);
        }
    }
}

/// Every extended attribute of `path` (not following a symlink). A filesystem without xattr
/// support has none.
pub fn read(path: &Path) -> Result<BTreeMap<String, Vec<u8>>> {
    let c = c_path(path)?;
    // SAFETY: `c` is NUL-terminated and outlives the call; `buf` is valid for `len` bytes (or
    // null with len 0, which asks only for the size).
    let names = sized(|buf, len| unsafe { libc::llistxattr(c.as_ptr(), buf.cast(), len) });
    let names = match names {
        Ok(n) => n,
        Err(e) if matches!(e.raw_os_error(), Some(libc::ENOTSUP) | Some(libc::ENODATA)) => {
            return Ok(BTreeMap::new());
        }
        Err(e) => return Err(Error::io("list xattrs", path, e)),
    };
    let mut out = BTreeMap::new();
    for name in names.split(|b| *b == 0).filter(|n| !n.is_empty()) {
        let Ok(text) = std::str::from_utf8(name) else {
            tracing::warn!(path = %path.display(), "skipping an xattr whose name is not UTF-8");
            continue;
        };
        let cname = CString::new(name).expect("split on NUL");
        // SAFETY: both strings are NUL-terminated and outlive the call; `buf` as above.
        let value =
            sized(|buf, len| unsafe { libc::lgetxattr(c.as_ptr(), cname.as_ptr(), buf, len) });
        match value {
            Ok(v) => {
                out.insert(text.to_string(), v);
            }
            // Removed between the listing and the read.
            Err(e) if e.raw_os_error() == Some(libc::ENODATA) => {}
            Err(e) => return Err(Error::io("read xattr", path, e)),
        }
    }
    Ok(out)
}

/// Sets `attrs` on `path` (not following a symlink). Attributes the destination refuses (no
/// xattr support, a namespace that needs privileges) are skipped with a warning: the file's
/// bytes are all there.
pub fn write(path: &Path, attrs: &BTreeMap<String, Vec<u8>>) -> Result<()> {
    if attrs.is_empty() {
        return Ok(());
    }
    let c = c_path(path)?;
    for (name, value) in attrs {
        let Ok(cname) = CString::new(name.as_bytes()) else {
            continue;
        };
        // SAFETY: both strings are NUL-terminated and `value` is valid for its length; all
        // outlive the call.
        let rc = unsafe {
            libc::lsetxattr(
                c.as_ptr(),
                cname.as_ptr(),
                value.as_ptr().cast(),
                value.len(),
                0,
            )
        };
        if rc != 0 {
            let e = std::io::Error::last_os_error();
            tracing::warn!(path = %path.display(), xattr = %name, error = %e, "could not set xattr");
        }
    }
    Ok(())
}
