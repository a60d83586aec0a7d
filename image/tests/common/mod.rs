//! Helpers shared by the image tests: raw tar entries (so hostile headers can be written as
//! they are), a tarball of a directory, and stores.

#![allow(dead_code, unused_imports)]

use std::collections::HashMap;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use hotstart_image::Images;
use hotstart_store::{ChunkStore, ChunkStoreConfig, Store};
pub use hotstart_testkit::tree::{assert_trees_equal, assert_trees_equal_but_mtimes, sample_dir};

/// Entry types of the tar format.
pub const REGULAR: u8 = b'0';
pub const HARDLINK: u8 = b'1';
pub const SYMLINK: u8 = b'2';
pub const DIR: u8 = b'5';
pub const FIFO: u8 = b'6';
pub const PAX: u8 = b'x';

/// One ustar header block plus the data padded to 512 bytes. `size` overrides the size field
/// (octal text written as given), so a header can lie about its size.
pub fn tar_entry(
    name: &[u8],
    kind: u8,
    mode: u32,
    link: &[u8],
    data: &[u8],
    size: Option<&[u8]>,
) -> Vec<u8> {
    let mut h = [0u8; 512];
    h[..name.len()].copy_from_slice(name);
    let octal = |field: &mut [u8], v: u64| {
        let s = format!("{:0width$o}", v, width = field.len() - 1);
        field[..s.len()].copy_from_slice(s.as_bytes());
    };
    octal(&mut h[100..108], mode as u64);
    octal(&mut h[108..116], 0);
    octal(&mut h[116..124], 0);
    match size {
        Some(raw) => h[124..124 + raw.len()].copy_from_slice(raw),
        None => octal(&mut h[124..136], data.len() as u64),
    }
    octal(&mut h[136..148], 1_700_000_000);
    h[156] = kind;
    h[157..157 + link.len()].copy_from_slice(link);
    h[257..263].copy_from_slice(b"ustar\0");
    h[263..265].copy_from_slice(b"00");
    h[148..156].copy_from_slice(b"        ");
    let sum: u32 = h.iter().map(|b| *b as u32).sum();
    let s = format!("{sum:06o}\0 ");
    h[148..156].copy_from_slice(s.as_bytes());
    let mut out = h.to_vec();
    out.extend_from_slice(data);
    out.resize(out.len().div_ceil(512) * 512, 0);
    out
}

/// A regular file entry, mode 0644, holding `data`.
pub fn file_entry(name: &str, data: &[u8]) -> Vec<u8> {
    tar_entry(name.as_bytes(), REGULAR, 0o644, b"", data, None)
}

/// A directory entry, mode 0755.
pub fn dir_entry(name: &str) -> Vec<u8> {
    tar_entry(name.as_bytes(), DIR, 0o755, b"", b"", None)
}

/// A whole archive: the entries then the two zero blocks that end it.
pub fn tar(entries: &[Vec<u8>]) -> Vec<u8> {
    let mut out: Vec<u8> = entries.concat();
    out.extend_from_slice(&[0u8; 1024]);
    out
}

pub fn gzip(data: &[u8]) -> Vec<u8> {
    use std::io::Write;
    let mut e = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    e.write_all(data).unwrap();
    e.finish().unwrap()
}

pub fn zstd(data: &[u8]) -> Vec<u8> {
    zstd::bulk::compress(data, 3).unwrap()
}

/// Images in a local-directory store under `dir`, small chunks so that files span several.
pub fn local_images(dir: &Path) -> Images {
    let store = Store::open(dir.to_str().unwrap()).unwrap();
    Images::new(ChunkStore::new(store, ChunkStoreConfig::default()).unwrap())
}

/// A PAX extended header carrying `records` (key, value) for the entry that follows.
pub fn pax(records: &[(&str, &[u8])]) -> Vec<u8> {
    let mut body = Vec::new();
    for (k, v) in records {
        // "<len> <key>=<value>\n", where <len> counts itself.
        let rest = k.len() + v.len() + 3;
        let mut len = rest + 1;
        while len.to_string().len() + rest != len {
            len += 1;
        }
        body.extend_from_slice(format!("{len} {k}=").as_bytes());
        body.extend_from_slice(v);
        body.push(b'\n');
    }
    tar_entry(b"././@PaxHeader", PAX, 0o644, b"", &body, None)
}

/// A tar of the directory `root`: entries in path order with `./` names, hard links as link
/// entries, and PAX records for nanosecond mtimes and xattrs, as GNU tar `--xattrs` writes them.
pub fn tar_of(root: &Path) -> Vec<u8> {
    let mut paths = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if std::fs::symlink_metadata(&p).unwrap().is_dir() {
                stack.push(p.clone());
            }
            paths.push(p);
        }
    }
    paths.sort();
    let mut first: HashMap<u64, String> = HashMap::new();
    let mut entries = Vec::new();
    for p in paths {
        let rel = p.strip_prefix(root).unwrap().to_str().unwrap().to_string();
        let m = std::fs::symlink_metadata(&p).unwrap();
        let mode = m.mode() & 0o7777;
        let name = format!("./{rel}");
        let mtime = format!("{}.{:09}", m.mtime(), m.mtime_nsec());
        let xattrs = hotstart_testkit::tree::xattrs(&p);
        let mut records: Vec<(String, Vec<u8>)> = vec![("mtime".into(), mtime.into_bytes())];
        for (k, v) in xattrs {
            records.push((format!("SCHILY.xattr.{k}"), v));
        }
        let records: Vec<(&str, &[u8])> = records
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_slice()))
            .collect();
        entries.push(pax(&records));
        let e = if m.file_type().is_symlink() {
            let t = std::fs::read_link(&p).unwrap();
            tar_entry(
                name.as_bytes(),
                SYMLINK,
                mode,
                t.to_str().unwrap().as_bytes(),
                b"",
                None,
            )
        } else if m.is_dir() {
            tar_entry(format!("{name}/").as_bytes(), DIR, mode, b"", b"", None)
        } else if let Some(target) = first.get(&m.ino()) {
            tar_entry(
                name.as_bytes(),
                HARDLINK,
                mode,
                target.as_bytes(),
                b"",
                None,
            )
        } else {
            first.insert(m.ino(), rel.clone());
            tar_entry(
                name.as_bytes(),
                REGULAR,
                mode,
                b"",
                &std::fs::read(&p).unwrap(),
                None,
            )
        };
        entries.push(e);
    }
    tar(&entries)
}

/// [`tar_of`] `root`, plus a whiteout of `hidden`, an opaque marker in `opaque` and a FIFO:
/// markers that, in a single layer, hide nothing and must not appear in the image, and a
/// special file that is skipped.
pub fn tar_with_markers(root: &Path, hidden: &str, opaque: &str) -> Vec<u8> {
    let mut raw = tar_of(root);
    raw.truncate(raw.len() - 1024);
    let (dir, name) = hidden.rsplit_once('/').unwrap_or(("", hidden));
    let whiteout = format!("./{dir}/.wh.{name}");
    raw.extend(tar_entry(
        whiteout.as_bytes(),
        REGULAR,
        0o644,
        b"",
        b"",
        None,
    ));
    let marker = format!("./{opaque}/.wh..wh..opq");
    raw.extend(tar_entry(marker.as_bytes(), REGULAR, 0o644, b"", b"", None));
    raw.extend(tar_entry(b"./fifo", FIFO, 0o644, b"", b"", None));
    raw.extend_from_slice(&[0u8; 1024]);
    raw
}
