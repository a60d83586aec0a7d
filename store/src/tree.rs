//! `Tree`: the manifest of a file tree whose file contents live in a [`ChunkStore`].
//!
//! Images and environment snapshots are trees. A tree lists every entry below a root (the root
//! itself excluded) sorted by path, so a parent always comes before its children and a hard link
//! after the file it links to. Each entry has a kind (directory, file with its chunk list, symlink
//! with its target, hard link to an earlier file), permission bits, owner and mtime.
//!
//! **Encoding** (versioned, compact): the 6 bytes `HSTREE`, a little-endian `u16` format version,
//! then one zstd frame holding the JSON of the tree. Decoding bounds the decompressed size and
//! validates every path before anything can use it.
//!
//! **Safety when materialising.** An entry path must be relative, with no empty, `.` or `..`
//! component and no NUL. Every ancestor directory is checked on disk before an entry is created
//! under it: an ancestor that is a symlink (say the tree made `lib -> /etc` and then lists
//! `lib/passwd`) is refused with [`Error::UnsafePath`] naming the entry, and files are created with
//! `O_NOFOLLOW | O_EXCL`, so nothing is ever written outside the destination.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::ffi::CString;
use std::io::Read;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use serde::{Deserialize, Serialize};

use crate::chunk::{ChunkId, ChunkStore};
use crate::error::{Error, Result};
use crate::file_meta::set_fd_metadata;

// A file entry lists its chunks as `ChunkRef`s; the type lives with the chunks and is named here
// too, where users of a tree have always found it.
pub use crate::chunk::ChunkRef;

mod xattr;

/// The format version written by this build.
pub const TREE_FORMAT_VERSION: u16 = 1;
const MAGIC: &[u8; 6] = b"HSTREE";
/// Largest decoded manifest accepted (bounds what a hostile manifest can allocate).
const MAX_DECODED_BYTES: usize = 512 << 20;
/// Default chunk size for files: 1 MiB.
pub const DEFAULT_CHUNK_SIZE: usize = 1 << 20;

/// The manifest of a file tree.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Tree {
    /// Entries sorted by path.
    #[serde(rename = "e")]
    pub entries: Vec<Entry>,
}

/// One file, directory, symlink or hard link.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Entry {
    /// Relative path, `/`-separated.
    #[serde(rename = "p")]
    pub path: String,
    #[serde(rename = "k")]
    pub kind: EntryKind,
    /// Permission bits (`mode & 0o7777`).
    #[serde(rename = "m")]
    pub mode: u32,
    #[serde(rename = "u", default)]
    pub uid: u32,
    #[serde(rename = "g", default)]
    pub gid: u32,
    /// Modification time in nanoseconds since the Unix epoch.
    #[serde(rename = "t", default)]
    pub mtime_ns: i64,
    /// Extended attributes (name → value), where the source had any. Empty for hard links: the
    /// file they link to carries them.
    #[serde(rename = "x", default, skip_serializing_if = "BTreeMap::is_empty")]
    pub xattrs: BTreeMap<String, Vec<u8>>,
}

/// What an entry is.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "t")]
pub enum EntryKind {
    #[serde(rename = "d")]
    Dir,
    #[serde(rename = "f")]
    File {
        #[serde(rename = "s")]
        size: u64,
        /// Chunks in file order; every chunk but the last is `chunk_size` long.
        #[serde(rename = "c")]
        chunks: Vec<ChunkRef>,
    },
    #[serde(rename = "l")]
    Symlink {
        #[serde(rename = "to")]
        target: String,
    },
    /// A hard link to an earlier file entry of the same tree.
    #[serde(rename = "h")]
    Hardlink {
        #[serde(rename = "to")]
        target: String,
    },
    /// An overlay whiteout: in a tree that is one layer of a stack (a container image layer
    /// served to overlayfs), it hides this path in the layers below. Served and written as a
    /// character device 0/0, overlayfs's own representation.
    #[serde(rename = "w")]
    Whiteout,
}

/// Checks that `path` is a safe relative entry path.
pub fn check_entry_path(path: &str) -> Result<()> {
    let unsafe_path = |reason: &str| Error::UnsafePath {
        entry: path.to_string(),
        reason: reason.to_string(),
    };
    if path.is_empty() {
        return Err(unsafe_path("empty path"));
    }
    if path.starts_with('/') {
        return Err(unsafe_path("absolute path"));
    }
    if path.contains('\0') {
        return Err(unsafe_path("NUL in path"));
    }
    for c in path.split('/') {
        match c {
            "" => return Err(unsafe_path("empty path component")),
            "." | ".." => return Err(unsafe_path("'.' or '..' component escapes the root")),
            _ => {}
        }
    }
    Ok(())
}

impl Tree {
    /// Files, directories, symlinks and hard links, in that order of counts.
    pub fn file_count(&self) -> usize {
        self.entries
            .iter()
            .filter(|e| matches!(e.kind, EntryKind::File { .. }))
            .count()
    }

    /// Sum of file sizes (hard links counted once).
    pub fn total_bytes(&self) -> u64 {
        self.entries
            .iter()
            .map(|e| match &e.kind {
                EntryKind::File { size, .. } => *size,
                _ => 0,
            })
            .sum()
    }

    /// Every chunk id the tree refers to, first use order, without repeats.
    pub fn chunk_ids(&self) -> Vec<ChunkId> {
        self.chunk_refs().into_iter().map(|c| c.id).collect()
    }

    /// Every chunk the tree refers to (id and length), first use order, without repeats.
    pub fn chunk_refs(&self) -> Vec<ChunkRef> {
        let mut seen = std::collections::HashSet::new();
        let mut out = Vec::new();
        for e in &self.entries {
            if let EntryKind::File { chunks, .. } = &e.kind {
                for c in chunks {
                    if seen.insert(c.id) {
                        out.push(*c);
                    }
                }
            }
        }
        out
    }

    /// Validates paths, order, hard-link targets and chunk lengths.
    pub fn validate(&self) -> Result<()> {
        let mut files: HashMap<&str, ()> = HashMap::new();
        let mut prev: Option<&str> = None;
        for e in &self.entries {
            check_entry_path(&e.path)?;
            if let Some(p) = prev
                && p >= e.path.as_str()
            {
                return Err(Error::UnsafePath {
                    entry: e.path.clone(),
                    reason: format!("out of order or repeated after {p:?}"),
                });
            }
            prev = Some(&e.path);
            match &e.kind {
                EntryKind::File { size, chunks } => {
                    let sum: u64 = chunks.iter().map(|c| c.len as u64).sum();
                    if sum != *size {
                        return Err(Error::Format {
                            what: "tree",
                            reason: format!(
                                "{}: chunks hold {sum} bytes, size says {size}",
                                e.path
                            ),
                        });
                    }
                    files.insert(&e.path, ());
                }
                EntryKind::Hardlink { target } => {
                    if !files.contains_key(target.as_str()) {
                        return Err(Error::UnsafePath {
                            entry: e.path.clone(),
                            reason: format!(
                                "hard link to {target:?}, which is not an earlier file"
                            ),
                        });
                    }
                }
                EntryKind::Symlink { target } => {
                    if target.is_empty() || target.contains('\0') {
                        return Err(Error::UnsafePath {
                            entry: e.path.clone(),
                            reason: "empty symlink target or NUL in it".into(),
                        });
                    }
                }
                EntryKind::Dir | EntryKind::Whiteout => {}
            }
        }
        Ok(())
    }

    /// Encodes the tree: magic, version, zstd-compressed JSON.
    pub fn encode(&self) -> Result<Bytes> {
        let json = serde_json::to_vec(self).map_err(|e| Error::Format {
            what: "tree",
            reason: e.to_string(),
        })?;
        let body = zstd::bulk::compress(&json, 6).map_err(|e| Error::io("compress tree", "", e))?;
        let mut out = Vec::with_capacity(8 + body.len());
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&TREE_FORMAT_VERSION.to_le_bytes());
        out.extend_from_slice(&body);
        Ok(Bytes::from(out))
    }

    /// Decodes and validates an encoded tree.
    pub fn decode(data: &[u8]) -> Result<Tree> {
        let bad = |reason: String| Error::Format {
            what: "tree",
            reason,
        };
        if data.len() < 8 || &data[..6] != MAGIC {
            return Err(bad("not a hotstart tree (bad magic)".into()));
        }
        let version = u16::from_le_bytes([data[6], data[7]]);
        if version != TREE_FORMAT_VERSION {
            return Err(bad(format!(
                "format version {version}; this build reads version {TREE_FORMAT_VERSION}"
            )));
        }
        let mut json = Vec::new();
        zstd::stream::read::Decoder::new(&data[8..])
            .map_err(|e| bad(format!("zstd: {e}")))?
            .take(MAX_DECODED_BYTES as u64 + 1)
            .read_to_end(&mut json)
            .map_err(|e| bad(format!("zstd: {e}")))?;
        if json.len() > MAX_DECODED_BYTES {
            return Err(bad(format!(
                "decodes to more than {MAX_DECODED_BYTES} bytes"
            )));
        }
        let tree: Tree = serde_json::from_slice(&json).map_err(|e| bad(e.to_string()))?;
        tree.validate()?;
        Ok(tree)
    }

    /// Builds a tree from the directory `root`, storing file contents as chunks of `chunk_size`.
    /// Sockets, FIFOs and device nodes are skipped with a warning.
    pub async fn build(root: &Path, chunks: &ChunkStore, chunk_size: usize) -> Result<Tree> {
        let root = root.to_path_buf();
        let walked = tokio::task::spawn_blocking(move || walk(&root))
            .await
            .map_err(|e| Error::task("tree walk", e))??;
        let mut entries = Vec::with_capacity(walked.len());
        // Files are chunked as many at a time as the chunk store uploads (small files are one
        // round trip each); each file's chunks upload with the store's concurrency too.
        let built: Vec<Entry> = futures::stream::iter(walked)
            .map(|w| async move {
                match w.file {
                    Some(abs) => {
                        let (size, refs) = chunk_file(&abs, chunks, chunk_size.max(1)).await?;
                        Ok::<_, Error>(Entry {
                            kind: EntryKind::File { size, chunks: refs },
                            ..w.entry
                        })
                    }
                    None => Ok(w.entry),
                }
            })
            .buffered(chunks.config().concurrency.max(1))
            .try_collect()
            .await?;
        entries.extend(built);
        let tree = Tree { entries };
        tree.validate()?;
        Ok(tree)
    }

    /// Creates every entry under `dest` (created if missing), fetching file contents from
    /// `chunks`. Refuses, before writing anything, a tree with an unsafe path.
    pub async fn materialize(&self, dest: &Path, chunks: &ChunkStore) -> Result<()> {
        // Small files are one round trip each, so a tree of many small files is latency-bound
        // unless as many fetches overlap as the chunk store allows.
        let opts = MaterializeOptions {
            concurrency: chunks.config().concurrency,
            ..MaterializeOptions::default()
        };
        self.materialize_with(dest, chunks, &opts).await.map(|_| ())
    }

    /// [`Tree::materialize`] with explicit options: how many files are written at once, and
    /// whether single-chunk files are hard-linked from the chunk store's local cache
    /// ([`ChunkCache::link_to`](crate::ChunkCache::link_to)) instead of written.
    pub async fn materialize_with(
        &self,
        dest: &Path,
        chunks: &ChunkStore,
        opts: &MaterializeOptions,
    ) -> Result<MaterializeStats> {
        self.validate()?;
        std::fs::create_dir_all(dest).map_err(|e| Error::io("create directory", dest, e))?;
        let dest = dest.to_path_buf();
        // Directories, symlinks and hard links are cheap and ordered; files are fetched in
        // parallel once their parent directories exist.
        let mut files = Vec::new();
        let mut known = HashSet::from([dest.clone()]);
        for e in &self.entries {
            let abs = safe_join(&dest, &e.path, &mut known)?;
            match &e.kind {
                EntryKind::Dir => std::fs::create_dir(&abs)
                    .or_else(|err| {
                        let is_dir = std::fs::symlink_metadata(&abs).is_ok_and(|m| m.is_dir());
                        if err.kind() == std::io::ErrorKind::AlreadyExists && is_dir {
                            Ok(())
                        } else {
                            Err(err)
                        }
                    })
                    .map_err(|err| Error::io("create directory", &abs, err))?,
                EntryKind::Symlink { target } => std::os::unix::fs::symlink(target, &abs)
                    .map_err(|err| Error::io("create symlink", &abs, err))?,
                EntryKind::Hardlink { target } => {
                    // The target is an earlier file entry; it is linked once files are written.
                    files.push((e, abs, Some(safe_join(&dest, target, &mut known)?)));
                }
                EntryKind::File { .. } => files.push((e, abs, None)),
                EntryKind::Whiteout => mknod_whiteout(&abs)?,
            }
        }
        let (links, plain): (Vec<_>, Vec<_>) = files.into_iter().partition(|(_, _, t)| t.is_some());
        // Hard links need the cache on the destination's file system; elsewhere every file is
        // written and a remote store's chunks are cached one by one.
        let link = opts.link_from_cache
            && chunks.cache().is_some_and(|c| {
                let dev = |p: &Path| std::fs::metadata(p).map(|m| m.dev()).ok();
                dev(c.dir()).is_some_and(|d| dev(&dest) == Some(d))
            });
        // After the first error no new file is started, but those under way are waited for: their
        // writes run on blocking threads that would otherwise go on creating files in `dest`
        // while the caller removes it.
        let failed = AtomicBool::new(false);
        let mut writes = futures::stream::iter(
            plain
                .into_iter()
                .take_while(|_| !failed.load(Ordering::Relaxed)),
        )
        .map(|(e, abs, _)| write_file(e, abs, chunks, link))
        .buffer_unordered(opts.concurrency.max(1));
        let (mut linked, mut error) = (Vec::new(), None);
        while let Some(res) = writes.next().await {
            match res {
                Ok(l) => linked.push(l),
                Err(e) => {
                    failed.store(true, Ordering::Relaxed);
                    error.get_or_insert(e);
                }
            }
        }
        drop(writes);
        if let Some(e) = error {
            return Err(e);
        }
        let mut stats = MaterializeStats {
            files: linked.len() as u64,
            linked: linked.iter().filter(|l| **l).count() as u64,
            bytes: self.total_bytes(),
        };
        for (_, abs, target) in links {
            let target = target.expect("partitioned on Some");
            std::fs::hard_link(&target, &abs)
                .map_err(|err| Error::io("create hard link", &abs, err))?;
            stats.files += 1;
        }
        // Directory and symlink metadata last, deepest first, so creating children does not
        // disturb directory mtimes. Files got theirs when written (or linked).
        for e in self.entries.iter().rev() {
            let abs = dest.join(&e.path);
            match e.kind {
                EntryKind::Symlink { .. } => {
                    xattr::write(&abs, &e.xattrs)?;
                    set_mtime(&abs, e.mtime_ns, true)?;
                }
                EntryKind::Hardlink { .. } | EntryKind::Whiteout => {}
                EntryKind::File { .. } => xattr::write(&abs, &e.xattrs)?,
                EntryKind::Dir => {
                    xattr::write(&abs, &e.xattrs)?;
                    std::fs::set_permissions(
                        &abs,
                        std::fs::Permissions::from_mode(e.mode & 0o7777),
                    )
                    .map_err(|err| Error::io("set mode", &abs, err))?;
                    set_mtime(&abs, e.mtime_ns, false)?;
                }
            }
        }
        Ok(stats)
    }
}

/// Creates the character device 0/0 overlayfs reads as a whiteout (needs CAP_MKNOD).
fn mknod_whiteout(path: &Path) -> Result<()> {
    let c = CString::new(path.as_os_str().as_bytes()).map_err(|_| {
        Error::io(
            "create whiteout",
            path,
            std::io::ErrorKind::InvalidInput.into(),
        )
    })?;
    // SAFETY: mknod reads the NUL-terminated path `c` owns; S_IFCHR with device 0 creates no
    // usable device, only the marker overlayfs knows.
    if unsafe { libc::mknod(c.as_ptr(), libc::S_IFCHR, 0) } != 0 {
        return Err(Error::io(
            "create whiteout (a character device 0/0; needs root)",
            path,
            std::io::Error::last_os_error(),
        ));
    }
    Ok(())
}

/// How [`Tree::materialize_with`] writes files.
#[derive(Debug, Clone)]
pub struct MaterializeOptions {
    /// Files written at once (each also fetches up to 8 of its chunks ahead).
    pub concurrency: usize,
    /// Hard-link files of exactly one chunk from the chunk store's local cache when the cache is
    /// on the destination's file system (a chunk not cached yet is written into the file, which
    /// the cache then adopts as its copy); such files then share their inode with the cache (and
    /// with other trees restored from it), so they must be replaced, never modified in place.
    pub link_from_cache: bool,
}

impl Default for MaterializeOptions {
    fn default() -> Self {
        MaterializeOptions {
            concurrency: 4,
            link_from_cache: false,
        }
    }
}

/// What [`Tree::materialize_with`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MaterializeStats {
    /// Regular files created (hard links of the tree included).
    pub files: u64,
    /// Files that share their inode with the chunk cache: hard-linked from it, or written and
    /// then adopted by it ([`ChunkCache::adopt`](crate::ChunkCache::adopt)).
    pub linked: u64,
    /// Bytes of file content in the tree.
    pub bytes: u64,
}

/// `dest/rel`, after checking `rel` and that no existing ancestor under `dest` is a symlink or
/// anything but a directory.
///
/// Ancestors already in `known` (directories this materialisation created or checked) are not
/// checked again, and the ones checked are added, so a deep tree is not stat'ed over and over.
fn safe_join(dest: &Path, rel: &str, known: &mut HashSet<PathBuf>) -> Result<PathBuf> {
    check_entry_path(rel)?;
    let mut cur = dest.to_path_buf();
    let comps: Vec<&str> = rel.split('/').collect();
    for (i, c) in comps.iter().enumerate() {
        cur.push(c);
        if i + 1 == comps.len() {
            break;
        }
        if known.contains(&cur) {
            continue;
        }
        match std::fs::symlink_metadata(&cur) {
            Ok(m) if m.file_type().is_symlink() => {
                return Err(Error::UnsafePath {
                    entry: rel.to_string(),
                    reason: format!("would write through the symlink {}", cur.display()),
                });
            }
            Ok(m) if !m.is_dir() => {
                return Err(Error::UnsafePath {
                    entry: rel.to_string(),
                    reason: format!("parent {} is not a directory", cur.display()),
                });
            }
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                std::fs::create_dir(&cur).map_err(|e| Error::io("create directory", &cur, e))?;
            }
            Err(e) => return Err(Error::io("stat", &cur, e)),
        }
        known.insert(cur.clone());
    }
    Ok(cur)
}

/// Runs blocking file-system work on the blocking pool, so that the files of a tree are
/// created, written and linked in parallel rather than one at a time on the runtime's thread.
async fn blocking<T: Send + 'static>(f: impl FnOnce() -> Result<T> + Send + 'static) -> Result<T> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| Error::task("write files", e))?
}

/// `Ok` when a file's chunks added up to the size the tree gives it.
fn check_written(path: &str, written: u64, size: u64) -> Result<()> {
    if written == size {
        Ok(())
    } else {
        Err(Error::Format {
            what: "tree",
            reason: format!("{path}: wrote {written} bytes, expected {size}"),
        })
    }
}

/// `Ok` when a fetched chunk has the length the tree gives it.
fn check_len(c: &ChunkRef, got: usize) -> Result<()> {
    if got as u64 == u64::from(c.len) {
        Ok(())
    } else {
        Err(Error::Corrupt {
            id: c.id.to_hex(),
            reason: format!("{got} bytes, the tree says {}", c.len),
        })
    }
}

/// Writes one file entry; `Ok(true)` when it shares its inode with the chunk cache.
async fn write_file(e: &Entry, abs: PathBuf, chunks: &ChunkStore, link: bool) -> Result<bool> {
    let EntryKind::File { size, chunks: refs } = &e.kind else {
        return Ok(false);
    };
    let create = |abs: &Path| {
        std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .custom_flags(libc::O_NOFOLLOW)
            .mode(0o600)
            .open(abs)
            .map_err(|err| Error::io("create file", abs, err))
    };
    let (mode, mtime_ns, size) = (e.mode, e.mtime_ns, *size);
    // A file with extended attributes gets its own inode: the cache's is shared.
    let link = link && e.xattrs.is_empty() && chunks.cache().is_some();
    if let ([only], true) = (refs.as_slice(), link) {
        let (only, id) = (*only, only.id);
        let place = move |chunks: &ChunkStore, data: &[u8]| -> Result<bool> {
            let cache = chunks.cache().expect("checked above");
            if cache.link_to(&id, &abs, mode, mtime_ns)? {
                return Ok(true);
            }
            let mut file = create(&abs)?;
            std::io::Write::write_all(&mut file, data)
                .map_err(|err| Error::io("write file", &abs, err))?;
            set_fd_metadata(&file, &abs, mode, mtime_ns)?;
            drop(file);
            cache.adopt(&id, &abs, data.len() as u64, mode)
        };
        // A chunk near at hand (held in memory, cached, or in a local-directory store) is read,
        // verified and placed in one hand-off to the blocking pool; one from a remote store is
        // fetched here, then decoded, verified, written into the tree once and adopted by the
        // cache in one hand-off.
        let near = chunks.store().is_local()
            || chunks.is_held(&id)
            || chunks.cache().is_some_and(|c| c.contains(&id));
        let placed = if !near {
            None
        } else {
            let (chunks, place) = (chunks.clone(), place.clone());
            blocking(move || match chunks.get_uncached_blocking(&id)? {
                Some(data) => {
                    check_len(&only, data.len())?;
                    place(&chunks, &data).map(Some)
                }
                None => Ok(None),
            })
            .await?
        };
        if let Some(linked) = placed {
            return Ok(linked);
        }
        let frame = chunks.fetch_frame(&id).await?;
        let chunks = chunks.clone();
        return blocking(move || {
            let data = chunks.decode(&id, &frame)?;
            check_len(&only, data.len())?;
            place(&chunks, &data)
        })
        .await;
    }
    // A file of several chunks is kept in the cache whole (a hard link, as a one-chunk file is)
    // under a key derived from its chunk list; a later restore re-hashes it and links it.
    let whole = (link && refs.len() > 1).then(|| crate::ChunkCache::file_key(refs));
    if let Some(key) = whole
        && chunks.cache().is_some_and(|c| c.contains(&key))
    {
        let (chunks, refs, abs) = (chunks.clone(), refs.clone(), abs.clone());
        let linked = blocking(move || {
            let cache = chunks.cache().expect("checked above");
            Ok(cache.verify_file(&key, &refs)? && cache.link_to(&key, &abs, mode, mtime_ns)?)
        })
        .await?;
        if linked {
            return Ok(true);
        }
    }
    // The written file gets its metadata, then becomes the cache's copy.
    let finish = move |chunks: &ChunkStore, file: &std::fs::File, abs: &Path| -> Result<bool> {
        set_fd_metadata(file, abs, mode, mtime_ns)?;
        match (whole, chunks.cache()) {
            (Some(key), Some(cache)) => cache.adopt(&key, abs, size, mode),
            _ => Ok(false),
        }
    };
    if chunks.store().is_local() || refs.iter().all(|r| chunks.is_held(&r.id)) {
        // Reading a local store or chunks held in memory costs less than a hand-off per chunk:
        // the whole file is written by one blocking thread, and its chunks are not copied into
        // the cache (the file itself may become the cache's copy). A held chunk that turns out
        // not to be there (its bulk fetch failed) sends the file down the fetching path below.
        let (chunks, refs, path, abs) = (chunks.clone(), refs.clone(), e.path.clone(), abs.clone());
        let written = blocking(move || {
            let mut file = create(&abs)?;
            let mut written = 0u64;
            for r in &refs {
                let Some(data) = chunks.get_uncached_blocking(&r.id)? else {
                    drop(file);
                    std::fs::remove_file(&abs)
                        .map_err(|err| Error::io("remove file", &abs, err))?;
                    return Ok(None);
                };
                check_len(r, data.len())?;
                std::io::Write::write_all(&mut file, &data)
                    .map_err(|err| Error::io("write file", &abs, err))?;
                written += data.len() as u64;
            }
            check_written(&path, written, size)?;
            finish(&chunks, &file, &abs).map(Some)
        })
        .await?;
        if let Some(linked) = written {
            return Ok(linked);
        }
    }
    let file = Arc::new({
        let abs = abs.clone();
        blocking(move || create(&abs)).await?
    });
    let mut written = 0u64;
    // Fetch ahead while writing in order. A file the cache keeps whole needs no cached chunks.
    let mut stream = futures::stream::iter(refs.iter())
        .map(|r| async move {
            match whole {
                Some(_) => chunks.get_uncached(&r.id).await,
                None => chunks.get(&r.id).await,
            }
        })
        .buffered(8);
    let mut i = 0;
    while let Some(data) = stream.next().await {
        let data = data?;
        check_len(&refs[i], data.len())?;
        written += data.len() as u64;
        let (file, abs) = (file.clone(), abs.clone());
        blocking(move || {
            std::io::Write::write_all(&mut &*file, &data)
                .map_err(|err| Error::io("write file", &abs, err))
        })
        .await?;
        i += 1;
    }
    check_written(&e.path, written, size)?;
    let chunks = chunks.clone();
    blocking(move || finish(&chunks, &file, &abs)).await
}

/// Sets the access and modification times of `path` to `mtime_ns` (nanoseconds since the Unix
/// epoch), of a symlink itself when `nofollow`.
pub fn set_mtime(path: &Path, mtime_ns: i64, nofollow: bool) -> Result<()> {
    let c = CString::new(path.as_os_str().as_bytes()).map_err(|_| Error::UnsafePath {
        entry: path.display().to_string(),
        reason: "NUL in path".into(),
    })?;
    let ts = libc::timespec {
        tv_sec: mtime_ns.div_euclid(1_000_000_000),
        tv_nsec: mtime_ns.rem_euclid(1_000_000_000),
    };
    let times = [ts, ts];
    let flags = if nofollow {
        libc::AT_SYMLINK_NOFOLLOW
    } else {
        0
    };
    // SAFETY: `c` is a valid NUL-terminated path and `times` points to two initialised timespecs
    // that outlive the call.
    let rc = unsafe { libc::utimensat(libc::AT_FDCWD, c.as_ptr(), times.as_ptr(), flags) };
    if rc != 0 {
        return Err(Error::io(
            "set mtime",
            path,
            std::io::Error::last_os_error(),
        ));
    }
    Ok(())
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

struct Walked {
    entry: Entry,
    /// For regular files: the absolute path whose content is still to be chunked.
    file: Option<PathBuf>,
    /// (device, inode) of a regular file with more than one link.
    inode: Option<(u64, u64)>,
}

fn walk(root: &Path) -> Result<Vec<Walked>> {
    let mut out = Vec::new();
    let mut stack = vec![(root.to_path_buf(), String::new())];
    while let Some((dir, rel)) = stack.pop() {
        let mut names: Vec<_> = std::fs::read_dir(&dir)
            .map_err(|e| Error::io("read directory", &dir, e))?
            .map(|d| d.map(|d| d.file_name()))
            .collect::<std::io::Result<_>>()
            .map_err(|e| Error::io("read directory", &dir, e))?;
        names.sort();
        for name in names {
            let Some(name) = name.to_str() else {
                return Err(Error::UnsafePath {
                    entry: format!("{rel}/{}", name.to_string_lossy()),
                    reason: "file name is not UTF-8".into(),
                });
            };
            let abs = dir.join(name);
            let path = if rel.is_empty() {
                name.to_string()
            } else {
                format!("{rel}/{name}")
            };
            let m = std::fs::symlink_metadata(&abs).map_err(|e| Error::io("stat", &abs, e))?;
            let ft = m.file_type();
            let mut entry = Entry {
                path: path.clone(),
                kind: EntryKind::Dir,
                mode: m.mode() & 0o7777,
                uid: m.uid(),
                gid: m.gid(),
                mtime_ns: m.mtime() * 1_000_000_000 + m.mtime_nsec(),
                xattrs: xattr::read(&abs)?,
            };
            let mut file = None;
            let mut inode = None;
            if ft.is_dir() {
                stack.push((abs.clone(), path.clone()));
            } else if ft.is_symlink() {
                let target =
                    std::fs::read_link(&abs).map_err(|e| Error::io("read symlink", &abs, e))?;
                let target = target.to_str().ok_or_else(|| Error::UnsafePath {
                    entry: path.clone(),
                    reason: "symlink target is not UTF-8".into(),
                })?;
                entry.kind = EntryKind::Symlink {
                    target: target.to_string(),
                };
            } else if ft.is_file() {
                if m.nlink() > 1 {
                    inode = Some((m.dev(), m.ino()));
                }
                entry.kind = EntryKind::File {
                    size: 0,
                    chunks: Vec::new(),
                };
                file = Some(abs);
            } else {
                tracing::warn!(path = %abs.display(), "skipping a socket, FIFO or device node");
                continue;
            }
            out.push(Walked { entry, file, inode });
        }
    }
    // Sorted by path, parents come before children; the first path of a multiply-linked inode
    // holds the content and later paths become hard links to it.
    out.sort_by(|a, b| a.entry.path.cmp(&b.entry.path));
    let mut first_of: HashMap<(u64, u64), String> = HashMap::new();
    for w in &mut out {
        let Some(inode) = w.inode else { continue };
        match first_of.get(&inode) {
            Some(first) => {
                w.entry.kind = EntryKind::Hardlink {
                    target: first.clone(),
                };
                w.entry.xattrs.clear();
                w.file = None;
            }
            None => {
                first_of.insert(inode, w.entry.path.clone());
            }
        }
    }
    Ok(out)
}

async fn chunk_file(
    path: &Path,
    chunks: &ChunkStore,
    chunk_size: usize,
) -> Result<(u64, Vec<ChunkRef>)> {
    let mut file = std::fs::File::open(path).map_err(|e| Error::io("open", path, e))?;
    let mut refs = Vec::new();
    let mut size = 0u64;
    loop {
        // Read a batch of chunks, then upload them in parallel.
        let mut batch = Vec::new();
        for _ in 0..8 {
            let mut buf = vec![0u8; chunk_size];
            let n = read_full(&mut file, &mut buf).map_err(|e| Error::io("read", path, e))?;
            if n == 0 {
                break;
            }
            buf.truncate(n);
            batch.push(Bytes::from(buf));
            if n < chunk_size {
                break;
            }
        }
        if batch.is_empty() {
            break;
        }
        let last_short = batch.last().is_some_and(|b| b.len() < chunk_size);
        let lens: Vec<u32> = batch.iter().map(|b| b.len() as u32).collect();
        let ids = chunks.put_many(batch).await?;
        for (id, len) in ids.into_iter().zip(lens) {
            size += len as u64;
            refs.push(ChunkRef { id, len });
        }
        if last_short {
            break;
        }
    }
    Ok((size, refs))
}

fn read_full(f: &mut std::fs::File, buf: &mut [u8]) -> std::io::Result<usize> {
    let mut n = 0;
    while n < buf.len() {
        match f.read(&mut buf[n..]) {
            Ok(0) => break,
            Ok(k) => n += k,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entry_paths_that_escape_are_refused() {
        for bad in [
            "",
            "/etc/passwd",
            "../x",
            "a/../../x",
            "a//b",
            "a/./b",
            "a\0b",
        ] {
            let err = check_entry_path(bad).unwrap_err();
            assert!(matches!(err, Error::UnsafePath { .. }), "{bad:?}: {err}");
        }
        check_entry_path("a/b/c.txt").unwrap();
    }

    #[test]
    fn decode_rejects_garbage_and_future_versions() {
        assert!(Tree::decode(b"").is_err());
        assert!(Tree::decode(b"HSTREE\x01\x00garbage").is_err());
        let tree = Tree { entries: vec![] };
        let mut enc = tree.encode().unwrap().to_vec();
        assert_eq!(Tree::decode(&enc).unwrap(), tree);
        enc[6] = 9;
        let err = Tree::decode(&enc).unwrap_err().to_string();
        assert!(err.contains("version 9"), "{err}");
    }

    #[test]
    fn decode_refuses_a_hostile_manifest() {
        let tree = Tree {
            entries: vec![Entry {
                path: "../../etc/cron.d/x".into(),
                kind: EntryKind::Dir,
                mode: 0o755,
                uid: 0,
                gid: 0,
                mtime_ns: 0,
                xattrs: BTreeMap::new(),
            }],
        };
        let enc = tree.encode().unwrap();
        assert!(matches!(Tree::decode(&enc), Err(Error::UnsafePath { .. })));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn materialize_from_a_local_store_caches_whole_files() {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("src");
        std::fs::create_dir_all(&src).unwrap();
        let big: Vec<u8> = (0..5000u32).map(|i| (i * 7 % 251) as u8).collect();
        std::fs::write(src.join("small.py"), b"x = 1\n").unwrap();
        std::fs::write(src.join("big.so"), &big).unwrap();
        let cfg = crate::ChunkStoreConfig {
            cache_dir: Some(dir.path().join("cache")),
            ..Default::default()
        };
        let store = crate::Store::open(dir.path().join("store").to_str().unwrap()).unwrap();
        let chunks = ChunkStore::new(store.prefixed("envs"), cfg).unwrap();
        let tree = Tree::build(&src, &chunks, 1024).await.unwrap();
        let opts = MaterializeOptions {
            concurrency: 4,
            link_from_cache: true,
        };
        let out = dir.path().join("out");
        let stats = tree.materialize_with(&out, &chunks, &opts).await.unwrap();
        assert_eq!(std::fs::read(out.join("big.so")).unwrap(), big);
        assert_eq!(std::fs::read(out.join("small.py")).unwrap(), b"x = 1\n");
        // Both files became the cache's copies: the small one as its chunk, the large one whole.
        // The large file's chunks are not cached one by one.
        assert_eq!(stats.linked, 2);
        let cache = chunks.cache().unwrap();
        assert!(cache.contains(&ChunkId::of(b"x = 1\n")));
        let big_refs = match &tree
            .entries
            .iter()
            .find(|e| e.path == "big.so")
            .unwrap()
            .kind
        {
            EntryKind::File { chunks, .. } => chunks.clone(),
            other => panic!("{other:?}"),
        };
        assert!(big_refs.len() > 1);
        assert!(big_refs.iter().all(|r| !cache.contains(&r.id)));
        let whole = crate::ChunkCache::file_key(&big_refs);
        let ino = |p: &Path| std::fs::metadata(p).unwrap().ino();
        assert_eq!(ino(&cache.path_of(&whole)), ino(&out.join("big.so")));
        assert_eq!(chunks.stats().fetched, 1 + big_refs.len() as u64);
        // A second restore links both and fetches nothing.
        let again = dir.path().join("again");
        let stats = tree.materialize_with(&again, &chunks, &opts).await.unwrap();
        assert_eq!(stats.linked, 2);
        assert_eq!(chunks.stats().fetched, 1 + big_refs.len() as u64);
        assert_eq!(ino(&again.join("big.so")), ino(&out.join("big.so")));
        // A cached whole file that was changed is dropped, and the file written from the store.
        std::fs::remove_dir_all(&out).unwrap();
        std::fs::remove_dir_all(&again).unwrap();
        let mut damaged = big.clone();
        damaged[4000] ^= 1;
        std::fs::write(cache.path_of(&whole), &damaged).unwrap();
        let third = dir.path().join("third");
        tree.materialize_with(&third, &chunks, &opts).await.unwrap();
        assert_eq!(std::fs::read(third.join("big.so")).unwrap(), big);
        assert_eq!(std::fs::read(cache.path_of(&whole)).unwrap(), big);
        assert_eq!(chunks.stats().fetched, 1 + 2 * big_refs.len() as u64);
        // A chunk that went bad in the store fails the restore with the chunk named.
        cache.remove(&whole);
        let victim = big_refs[1].id;
        let frame = chunks.store().get(&victim.key()).await.unwrap();
        let mut bad = frame.to_vec();
        let last = bad.len() - 1;
        bad[last] ^= 0xff;
        chunks.store().put(&victim.key(), bad.into()).await.unwrap();
        let err = tree
            .materialize_with(&dir.path().join("out2"), &chunks, &opts)
            .await
            .unwrap_err();
        assert!(err.to_string().contains(&victim.to_hex()), "{err}");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn materialize_links_single_chunk_files_from_the_cache() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("src");
        std::fs::create_dir_all(src.join("pkg")).unwrap();
        std::fs::write(src.join("pkg/small.py"), b"x = 1\n").unwrap();
        std::fs::write(src.join("pkg/same.py"), b"x = 1\n").unwrap();
        std::fs::write(src.join("pkg/big.bin"), vec![9u8; 3000]).unwrap();
        std::fs::write(src.join("pkg/empty"), b"").unwrap();
        std::fs::set_permissions(
            src.join("pkg/same.py"),
            std::fs::Permissions::from_mode(0o600),
        )
        .unwrap();
        let cfg = crate::ChunkStoreConfig {
            cache_dir: Some(dir.path().join("cache")),
            ..Default::default()
        };
        let chunks = ChunkStore::new(crate::Store::open("memory://").unwrap(), cfg).unwrap();
        let tree = Tree::build(&src, &chunks, 1024).await.unwrap();
        let opts = MaterializeOptions {
            concurrency: 8,
            link_from_cache: true,
        };
        let out = dir.path().join("out");
        let stats = tree.materialize_with(&out, &chunks, &opts).await.unwrap();
        // small.py and same.py hold the same bytes with different modes: whichever comes first
        // becomes the cache's copy, the other is written. big.bin has several chunks and is kept
        // whole; the empty file has none.
        assert_eq!(stats.files, 4);
        assert_eq!(stats.linked, 2);
        let cache = chunks.cache().unwrap();
        let small_id = ChunkId::of(b"x = 1\n");
        let cached = std::fs::metadata(cache.path_of(&small_id)).unwrap();
        let ino = |name: &str| std::fs::metadata(out.join("pkg").join(name)).unwrap().ino();
        assert_eq!(
            [ino("small.py"), ino("same.py")]
                .iter()
                .filter(|i| **i == cached.ino())
                .count(),
            1
        );
        for name in ["small.py", "same.py", "big.bin", "empty"] {
            let a = std::fs::metadata(src.join("pkg").join(name)).unwrap();
            let b = std::fs::metadata(out.join("pkg").join(name)).unwrap();
            assert_eq!(
                std::fs::read(src.join("pkg").join(name)).unwrap(),
                std::fs::read(out.join("pkg").join(name)).unwrap(),
                "{name}"
            );
            assert_eq!(a.mode(), b.mode(), "{name}");
            assert_eq!(
                (a.mtime(), a.mtime_nsec()),
                (b.mtime(), b.mtime_nsec()),
                "{name}"
            );
        }
    }
}
