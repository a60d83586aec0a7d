//! Helpers shared by the image tests: raw tar entries (so hostile headers can be written as
//! they are), a sample source tree, and a walk that compares two trees entry by entry.

#![allow(dead_code)]

use std::collections::{BTreeMap, HashMap};
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;

use hotstart_prefetch::Images;
use hotstart_store::{ChunkStore, ChunkStoreConfig, Store};
use hotstart_testkit::pattern;

/// Entry types of the tar format.
pub const REGULAR: u8 = b'0';
pub const HARDLINK: u8 = b'1';
pub const SYMLINK: u8 = b'2';
pub const DIR: u8 = b'5';
pub const FIFO: u8 = b'6';

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

/// A source tree with every kind of entry: nested directories with several modes, files of
/// many sizes (empty, small, several chunks), duplicate content, a hard link, relative and
/// absolute symlinks, a dangling symlink, a non-ASCII name and an xattr where supported.
pub fn sample_tree(root: &Path) {
    let w = |p: &str, data: &[u8], mode: u32| {
        let path = root.join(p);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, data).unwrap();
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
    };
    w("bin/tool", b"#!/bin/sh\necho tool\n", 0o755);
    w("etc/conf", b"key = value\n", 0o640);
    w("lib/libbig.so", &pattern((2 << 20) + 12_345, 1), 0o644);
    w("lib/copy.so", &pattern((2 << 20) + 12_345, 1), 0o644);
    w("lib/python/mod.py", &pattern(70_000, 2), 0o644);
    w("lib/python/pkg/__init__.py", b"", 0o644);
    w(
        "share/dir with space/\u{fc}n\u{ef}code.txt",
        b"unicode\n",
        0o600,
    );
    w("setuid", b"s", 0o4755);
    std::fs::hard_link(root.join("lib/libbig.so"), root.join("lib/libbig.so.1")).unwrap();
    std::os::unix::fs::symlink("libbig.so", root.join("lib/link.so")).unwrap();
    std::os::unix::fs::symlink("/usr/bin/env", root.join("bin/env")).unwrap();
    std::os::unix::fs::symlink("missing/target", root.join("dangling")).unwrap();
    std::fs::create_dir_all(root.join("empty/dir")).unwrap();
    std::fs::set_permissions(root.join("empty"), std::fs::Permissions::from_mode(0o700)).unwrap();
    // user.* xattrs need a filesystem that takes them; where it does not, none is kept.
    set_xattr(&root.join("etc/conf"), "user.origin", b"sample");
}

fn c_path(path: &Path) -> std::ffi::CString {
    std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).unwrap()
}

/// Sets an xattr; returns whether the filesystem took it.
pub fn set_xattr(path: &Path, name: &str, value: &[u8]) -> bool {
    let (p, n) = (c_path(path), std::ffi::CString::new(name).unwrap());
    // SAFETY: NUL-terminated strings and a valid buffer, all alive for the call.
    unsafe {
        libc::setxattr(
            p.as_ptr(),
            n.as_ptr(),
            value.as_ptr().cast(),
            value.len(),
            0,
        ) == 0
    }
}

/// What one path is, as compared.
#[derive(Debug, PartialEq, Eq)]
enum Node {
    Dir {
        mode: u32,
    },
    File {
        mode: u32,
        blake3: String,
        size: u64,
    },
    Symlink {
        target: String,
    },
}

fn walk(root: &Path) -> (BTreeMap<String, Node>, Vec<Vec<String>>) {
    let mut out = BTreeMap::new();
    let mut inodes: HashMap<u64, Vec<String>> = HashMap::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for e in std::fs::read_dir(&dir).unwrap() {
            let e = e.unwrap();
            let p = e.path();
            let rel = p.strip_prefix(root).unwrap().to_str().unwrap().to_string();
            let m = std::fs::symlink_metadata(&p).unwrap();
            let node = if m.file_type().is_symlink() {
                Node::Symlink {
                    target: std::fs::read_link(&p)
                        .unwrap()
                        .to_str()
                        .unwrap()
                        .to_string(),
                }
            } else if m.is_dir() {
                stack.push(p.clone());
                Node::Dir {
                    mode: m.mode() & 0o7777,
                }
            } else {
                inodes.entry(m.ino()).or_default().push(rel.clone());
                Node::File {
                    mode: m.mode() & 0o7777,
                    blake3: blake3::hash(&std::fs::read(&p).unwrap())
                        .to_hex()
                        .to_string(),
                    size: m.len(),
                }
            };
            out.insert(rel, node);
        }
    }
    let mut links: Vec<Vec<String>> = inodes
        .into_values()
        .filter(|v| v.len() > 1)
        .map(|mut v| {
            v.sort();
            v
        })
        .collect();
    links.sort();
    (out, links)
}

/// Walks both trees and asserts every path has the same kind, mode, bytes and link target, and
/// that the same paths share an inode (hard links).
pub fn assert_same_tree(expected: &Path, actual: &Path) {
    let (want, want_links) = walk(expected);
    let (got, got_links) = walk(actual);
    let missing: Vec<_> = want.keys().filter(|k| !got.contains_key(*k)).collect();
    let extra: Vec<_> = got.keys().filter(|k| !want.contains_key(*k)).collect();
    assert!(
        missing.is_empty() && extra.is_empty(),
        "missing {missing:?}, extra {extra:?}"
    );
    for (path, node) in &want {
        assert_eq!(&got[path], node, "{path}");
    }
    assert_eq!(got_links, want_links, "hard links");
}

/// The xattr `name` of `path`, if the filesystem keeps it.
pub fn xattr(path: &Path, name: &str) -> Option<Vec<u8>> {
    let (p, n) = (c_path(path), std::ffi::CString::new(name).unwrap());
    let mut buf = vec![0u8; 4096];
    // SAFETY: NUL-terminated strings and a buffer valid for its length, all alive for the call.
    let got = unsafe { libc::getxattr(p.as_ptr(), n.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    (got >= 0).then(|| {
        buf.truncate(got as usize);
        buf
    })
}
