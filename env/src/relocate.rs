//! Relocation: a snapshot captured at one path, restored at another.
//!
//! A venv names its own path in a few places: `pyvenv.cfg` (`command = ... -m venv /old`), the
//! `activate` scripts (`VIRTUAL_ENV=/old`), and the shebang of every console script
//! (`#!/old/bin/python`, or pip's `/bin/sh` trampoline for long paths). The capture records every
//! entry that names its path ([`crate::record::PathRef`]); a restore at another path then
//!
//! - rewrites **text files** (no NUL byte): each occurrence of the old path that stands as a whole
//!   path (not inside a longer name such as `/old2` or `/x/old`) becomes the new path; the file is
//!   replaced by a new one with the old mode and mtime (never written in place, since restored
//!   files may share an inode with the chunk cache);
//! - re-points **symlinks** whose target lies under the old path;
//! - leaves **binary files** alone (their lengths are fixed) and reports them, except `.pyc`
//!   files, whose embedded source paths Python corrects on import.
//!
//! All of this happens in the restore's temporary directory, before it is renamed into place.

use std::io::Write;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::record::{PathRef, PathRefKind};
use crate::util;

/// What a relocation changed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RelocateReport {
    /// Text files rewritten.
    pub rewritten: Vec<String>,
    /// Symlinks re-pointed.
    pub relinked: Vec<String>,
    /// Binary files (other than `.pyc`) that still name the old path.
    pub binary: Vec<String>,
}

/// Whether `target` is `prefix` or a path below it.
pub fn under(target: &str, prefix: &str) -> bool {
    target
        .strip_prefix(prefix)
        .is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
}

/// A byte that can be part of a path name, so a match next to it is part of a longer path.
fn name_byte(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b'-' | b'+' | b'~')
}

/// `data` with every whole-path occurrence of `old` replaced by `new`; `None` when there is none.
pub fn rewrite(data: &[u8], old: &str, new: &str) -> Option<Vec<u8>> {
    let old_b = old.as_bytes();
    let mut out = Vec::new();
    let mut last = 0;
    let mut changed = false;
    for at in memchr::memmem::find_iter(data, old_b) {
        if at < last {
            continue;
        }
        let end = at + old_b.len();
        let before_ok = at == 0 || !(name_byte(data[at - 1]) || data[at - 1] == b'/');
        let after_ok = end == data.len() || !name_byte(data[end]);
        if !(before_ok && after_ok) {
            continue;
        }
        out.extend_from_slice(&data[last..at]);
        out.extend_from_slice(new.as_bytes());
        last = end;
        changed = true;
    }
    if !changed {
        return None;
    }
    out.extend_from_slice(&data[last..]);
    Some(out)
}

/// Rewrites the entries `refs` of the tree materialised in `dir` from `old` to `new`.
pub fn relocate_dir(dir: &Path, refs: &[PathRef], old: &str, new: &str) -> Result<RelocateReport> {
    let mut report = RelocateReport::default();
    // Replacing an entry changes its directory's mtime; put back the restored one afterwards.
    let mut parents: std::collections::BTreeMap<PathBuf, i64> = Default::default();
    for r in refs {
        let abs = checked_path(dir, &r.path)?;
        if r.kind != PathRefKind::Binary
            && let Some(parent) = abs.parent()
            && !parents.contains_key(parent)
        {
            let m = std::fs::metadata(parent).map_err(|e| Error::io("stat", parent, e))?;
            parents.insert(parent.to_path_buf(), util::mtime_ns(&m));
        }
        match r.kind {
            PathRefKind::Text => {
                if rewrite_file(&abs, old, new)? {
                    report.rewritten.push(r.path.clone());
                }
            }
            PathRefKind::Symlink => {
                if relink(&abs, old, new)? {
                    report.relinked.push(r.path.clone());
                }
            }
            PathRefKind::Binary => {
                if !r.path.ends_with(".pyc") {
                    report.binary.push(r.path.clone());
                }
            }
        }
    }
    for (parent, mtime) in &parents {
        util::set_mtime(parent, *mtime, false)?;
    }
    if !report.binary.is_empty() {
        tracing::warn!(
            count = report.binary.len(),
            first = %report.binary[0],
            old,
            "binary files still name the path the snapshot was captured at"
        );
    }
    Ok(report)
}

/// `dir/rel`, refusing a path whose ancestors under `dir` are not plain directories (a hostile
/// record must not make us write through a symlink).
fn checked_path(dir: &Path, rel: &str) -> Result<PathBuf> {
    hotstart_store::tree::check_entry_path(rel)?;
    let mut cur = dir.to_path_buf();
    let comps: Vec<&str> = rel.split('/').collect();
    for c in &comps[..comps.len() - 1] {
        cur.push(c);
        let m = std::fs::symlink_metadata(&cur).map_err(|e| Error::io("stat", &cur, e))?;
        if !m.is_dir() {
            return Err(Error::BadSnapshot {
                key: String::new(),
                reason: format!("relocation entry {rel:?} lies under a non-directory"),
            });
        }
    }
    cur.push(comps[comps.len() - 1]);
    Ok(cur)
}

fn rewrite_file(abs: &Path, old: &str, new: &str) -> Result<bool> {
    let meta = std::fs::symlink_metadata(abs).map_err(|e| Error::io("stat", abs, e))?;
    if !meta.is_file() {
        return Ok(false);
    }
    let data = std::fs::read(abs).map_err(|e| Error::io("read", abs, e))?;
    let Some(out) = rewrite(&data, old, new) else {
        return Ok(false);
    };
    let tmp = abs.with_file_name(format!(
        ".{}.hotstart-relocate",
        abs.file_name().unwrap_or_default().to_string_lossy()
    ));
    let write = || -> std::io::Result<()> {
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .custom_flags(libc::O_NOFOLLOW)
            .mode(0o600)
            .open(&tmp)?;
        f.write_all(&out)?;
        f.set_permissions(std::fs::Permissions::from_mode(meta.mode() & 0o7777))?;
        Ok(())
    };
    let res = write()
        .map_err(|e| Error::io("rewrite", abs, e))
        .and_then(|()| util::set_mtime(&tmp, util::mtime_ns(&meta), false))
        .and_then(|()| std::fs::rename(&tmp, abs).map_err(|e| Error::io("rewrite", abs, e)));
    if res.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    res.map(|()| true)
}

fn relink(abs: &Path, old: &str, new: &str) -> Result<bool> {
    let target = std::fs::read_link(abs).map_err(|e| Error::io("read symlink", abs, e))?;
    let target = target.to_string_lossy();
    let Some(rest) = target.strip_prefix(old).filter(|_| under(&target, old)) else {
        return Ok(false);
    };
    let meta = std::fs::symlink_metadata(abs).map_err(|e| Error::io("stat", abs, e))?;
    std::fs::remove_file(abs).map_err(|e| Error::io("remove symlink", abs, e))?;
    std::os::unix::fs::symlink(format!("{new}{rest}"), abs)
        .map_err(|e| Error::io("create symlink", abs, e))?;
    util::set_mtime(abs, util::mtime_ns(&meta), true)?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rewrites_whole_paths_only() {
        let old = "/opt/venv";
        let new = "/srv/jobs/42/venv";
        let cases: &[(&str, Option<&str>)] = &[
            (
                "#!/opt/venv/bin/python\n",
                Some("#!/srv/jobs/42/venv/bin/python\n"),
            ),
            (
                "VIRTUAL_ENV=\"/opt/venv\"\nexport",
                Some("VIRTUAL_ENV=\"/srv/jobs/42/venv\"\nexport"),
            ),
            (
                "command = /usr/bin/python3 -m venv /opt/venv",
                Some("command = /usr/bin/python3 -m venv /srv/jobs/42/venv"),
            ),
            (
                "'''exec' \"/opt/venv/bin/python\" \"$0\"",
                Some("'''exec' \"/srv/jobs/42/venv/bin/python\" \"$0\""),
            ),
            (
                "a /opt/venv b /opt/venv",
                Some("a /srv/jobs/42/venv b /srv/jobs/42/venv"),
            ),
            ("/opt/venv", Some("/srv/jobs/42/venv")),
            // Longer names that merely contain the old path stay.
            ("/opt/venv2/bin", None),
            ("/opt/venv.bak", None),
            ("/x/opt/venv", None),
            ("nothing here", None),
        ];
        for (input, want) in cases {
            let got = rewrite(input.as_bytes(), old, new).map(|b| String::from_utf8(b).unwrap());
            assert_eq!(got.as_deref(), *want, "{input:?}");
        }
        assert!(under("/opt/venv/bin/python", old));
        assert!(under("/opt/venv", old));
        assert!(!under("/opt/venv2", old));
    }

    #[test]
    fn relocates_text_and_symlinks_and_refuses_escapes() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        std::fs::create_dir(d.join("bin")).unwrap();
        std::fs::write(d.join("bin/tool"), "#!/old/env/bin/python\nimport x\n").unwrap();
        std::fs::set_permissions(d.join("bin/tool"), std::fs::Permissions::from_mode(0o751))
            .unwrap();
        let when = std::time::UNIX_EPOCH + std::time::Duration::new(1_600_000_000, 5);
        std::fs::File::options()
            .write(true)
            .open(d.join("bin/tool"))
            .unwrap()
            .set_times(std::fs::FileTimes::new().set_modified(when))
            .unwrap();
        std::os::unix::fs::symlink("/old/env/lib", d.join("lib64")).unwrap();
        std::fs::write(d.join("blob"), b"\0/old/env\0").unwrap();
        let bin_mtime = std::time::UNIX_EPOCH + std::time::Duration::new(1_500_000_000, 7);
        std::fs::File::open(d.join("bin"))
            .unwrap()
            .set_times(std::fs::FileTimes::new().set_modified(bin_mtime))
            .unwrap();
        let refs = vec![
            PathRef {
                path: "bin/tool".into(),
                kind: PathRefKind::Text,
            },
            PathRef {
                path: "blob".into(),
                kind: PathRefKind::Binary,
            },
            PathRef {
                path: "lib64".into(),
                kind: PathRefKind::Symlink,
            },
        ];
        let report = relocate_dir(d, &refs, "/old/env", "/new/place").unwrap();
        assert_eq!(report.rewritten, vec!["bin/tool"]);
        assert_eq!(report.relinked, vec!["lib64"]);
        assert_eq!(report.binary, vec!["blob"]);
        assert_eq!(
            std::fs::read_to_string(d.join("bin/tool")).unwrap(),
            "#!/new/place/bin/python\nimport x\n"
        );
        let m = std::fs::metadata(d.join("bin/tool")).unwrap();
        assert_eq!(
            std::fs::metadata(d.join("bin"))
                .unwrap()
                .modified()
                .unwrap(),
            bin_mtime
        );
        assert_eq!(m.mode() & 0o7777, 0o751);
        assert_eq!(m.modified().unwrap(), when);
        assert_eq!(
            std::fs::read_link(d.join("lib64")).unwrap(),
            Path::new("/new/place/lib")
        );
        assert_eq!(std::fs::read(d.join("blob")).unwrap(), b"\0/old/env\0");

        // A record that points through a symlink is refused before anything is touched.
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("victim"), "/old/env").unwrap();
        std::os::unix::fs::symlink(outside.path(), d.join("escape")).unwrap();
        let bad = vec![PathRef {
            path: "escape/victim".into(),
            kind: PathRefKind::Text,
        }];
        assert!(relocate_dir(d, &bad, "/old/env", "/new/place").is_err());
        assert_eq!(
            std::fs::read_to_string(outside.path().join("victim")).unwrap(),
            "/old/env"
        );
        let bad = vec![PathRef {
            path: "../x".into(),
            kind: PathRefKind::Text,
        }];
        assert!(relocate_dir(d, &bad, "/old/env", "/new/place").is_err());
    }
}
