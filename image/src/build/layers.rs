//! Layer tarballs applied in order into one [`Tree`], refusing hostile entries.
//!
//! **Pipeline.** A blocking thread reads each layer (`.tar`, gzip or zstd, told apart by their
//! magic bytes, not their names), applies every entry to an in-memory model of the image, and
//! sends each regular file's bytes, cut into chunks, down a bounded channel. The async side
//! stores the chunks with bounded concurrency (in order, so each file's chunk list comes back in
//! file order). When both are done the model becomes a `Tree`. Nothing is written to local disk,
//! so a hostile archive has nowhere to write; what it could do is make a tree that escapes when
//! materialised or mounted, and that is what the model refuses.
//!
//! **The model** maps each path to a directory, a symlink, or a file inode (hard links share an
//! inode, and the inode carries mode, owner, mtime and xattrs). Applying entry `p` of layer `L`:
//!
//! 1. `p` is normalised (`./` prefix and trailing `/` dropped) and must be a safe relative path:
//!    absolute names, `..`, empty components and NUL are refused with [`Error::Hostile`] naming
//!    the entry.
//! 2. A whiteout `dir/.wh.name` removes `dir/name` and everything under it, and an opaque marker
//!    `dir/.wh..wh..opq` everything under `dir`, that came from layers below `L` (as the OCI
//!    spec says, entries of the same layer stay). Neither marker appears in the image.
//! 3. Every ancestor of `p` must be a directory: an ancestor that is a symlink (a layer that
//!    makes `lib -> /etc` and then writes `lib/passwd`) or a file is refused; a missing ancestor
//!    is created as a `0755` directory.
//! 4. The entry replaces whatever was at `p`, except that a directory over a directory only
//!    updates its metadata (its children stay). A hard link must name a regular file already in
//!    the image; anything else is refused.
//!
//! **One layer of an overlay stack.** With `keep_whiteouts` (a tree built from one layer, to be
//! served as that layer under overlayfs), markers are not applied but kept as overlayfs
//! represents them: a whiteout `dir/.wh.name` becomes a character device 0/0 at `dir/name`
//! ([`EntryKind::Whiteout`]), an opaque marker the xattr `trusted.overlay.opaque=y` on `dir`.
//!
//! Device nodes and FIFOs are skipped with a warning. A header whose size is above
//! [`LayerLimits::max_file_size`] is refused before any of it is read, and an archive that ends
//! inside an entry's data is an error naming the entry.

use std::collections::{BTreeMap, HashMap};
use std::io::{BufReader, Read};
use std::path::{Path, PathBuf};

use bytes::Bytes;
use futures::{StreamExt, TryStreamExt};
use hotstart_store::tree::{ChunkRef, check_entry_path};
use hotstart_store::{ChunkStore, Entry, EntryKind, Tree};

use crate::error::{Error, Result};

/// Whiteout prefix of the OCI layer format.
const WHITEOUT: &str = ".wh.";
/// Opaque-directory marker of the OCI layer format.
const OPAQUE: &str = ".wh..wh..opq";

/// Bounds on what a layer may claim.
#[derive(Debug, Clone, Copy)]
pub struct LayerLimits {
    /// The largest regular file accepted (its header size); larger is refused as absurd.
    pub max_file_size: u64,
    /// The most entries all layers together may hold.
    pub max_entries: usize,
}

impl Default for LayerLimits {
    fn default() -> Self {
        LayerLimits {
            max_file_size: 1 << 40,
            max_entries: 10_000_000,
        }
    }
}

/// One layer to apply: a tarball, plain or compressed.
#[derive(Debug, Clone)]
pub struct Layer {
    pub path: PathBuf,
}

#[derive(Debug, Clone, Default)]
struct Meta {
    mode: u32,
    uid: u32,
    gid: u32,
    mtime_ns: i64,
    xattrs: BTreeMap<String, Vec<u8>>,
}

#[derive(Debug, Clone)]
enum Kind {
    Dir,
    Symlink(String),
    File(u64),
    /// A whiteout kept for overlayfs.
    Whiteout,
}

/// The xattr that makes a directory of a lower layer opaque to overlayfs.
const OVERLAY_OPAQUE: &str = "trusted.overlay.opaque";

#[derive(Debug, Clone)]
struct Node {
    kind: Kind,
    /// Metadata of directories and symlinks; a file's lives in its inode.
    meta: Meta,
    /// The layer the entry came from (opaque markers remove only lower ones).
    layer: usize,
}

/// The image so far: path → node, and file inodes.
#[derive(Debug, Default)]
struct Model {
    nodes: BTreeMap<String, Node>,
    inodes: HashMap<u64, Meta>,
    next_inode: u64,
    /// Keep whiteouts and opaque markers for overlayfs instead of applying them.
    keep_whiteouts: bool,
    /// Directories an opaque marker was kept for.
    opaque: std::collections::BTreeSet<String>,
}

/// One chunk of one file inode, in file order.
struct Piece {
    inode: u64,
    data: Bytes,
}

/// Applies `layers` in order and returns the resulting tree, its file contents stored in
/// `chunks` in chunks of `chunk_size`; with `keep_whiteouts`, the one layer's whiteouts and
/// opaque markers are kept for overlayfs (see the module docs).
pub async fn tree_from_layers(
    layers: Vec<Layer>,
    chunks: &ChunkStore,
    chunk_size: usize,
    limits: LayerLimits,
    keep_whiteouts: bool,
) -> Result<Tree> {
    if keep_whiteouts && layers.len() != 1 {
        return Err(Error::source(
            layers.first().map_or(Path::new(""), |l| l.path.as_path()),
            "whiteouts are kept only in a tree of one layer",
        ));
    }
    let concurrency = chunks.config().concurrency.max(1);
    let (tx, mut rx) = tokio::sync::mpsc::channel::<Piece>(concurrency * 2);
    let reader = tokio::task::spawn_blocking(move || {
        let mut model = Model {
            keep_whiteouts,
            ..Model::default()
        };
        for (i, layer) in layers.iter().enumerate() {
            apply_layer(&mut model, i, layer, &tx, chunk_size.max(1), &limits)?;
        }
        Ok::<_, Error>(model)
    });
    let pieces = futures::stream::poll_fn(move |cx| rx.poll_recv(cx));
    let stored = pieces
        .map(|p| async move {
            let len = p.data.len() as u32;
            let id = chunks.put(p.data).await?;
            Ok::<_, Error>((p.inode, ChunkRef { id, len }))
        })
        .buffered(concurrency)
        .try_fold(HashMap::<u64, Vec<ChunkRef>>::new(), |mut m, (inode, r)| {
            m.entry(inode).or_default().push(r);
            async move { Ok(m) }
        });
    let (model, refs) = tokio::join!(reader, stored);
    // A reader error explains why the chunk side stopped early; report it first.
    let model = model.map_err(|e| Error::task("layer reader", e))??;
    let refs = refs?;
    model.into_tree(refs)
}

fn hostile(layer: &Path, entry: &str, reason: impl Into<String>) -> Error {
    Error::Hostile {
        path: layer.to_path_buf(),
        entry: entry.to_string(),
        reason: reason.into(),
    }
}

/// Opens a layer, undoing gzip or zstd compression as its first bytes say.
fn open_layer(path: &Path) -> Result<Box<dyn Read>> {
    let file = std::fs::File::open(path).map_err(|e| Error::io("open layer", path, e))?;
    let mut r = BufReader::with_capacity(1 << 20, file);
    let magic = std::io::BufRead::fill_buf(&mut r)
        .map_err(|e| Error::io("read layer", path, e))?
        .to_vec();
    Ok(if magic.starts_with(&[0x1f, 0x8b]) {
        Box::new(flate2::read::MultiGzDecoder::new(r))
    } else if magic.starts_with(&[0x28, 0xb5, 0x2f, 0xfd]) {
        Box::new(
            zstd::stream::read::Decoder::with_buffer(r).map_err(|e| Error::io("zstd", path, e))?,
        )
    } else {
        Box::new(r)
    })
}

/// `p` without `./` prefixes and trailing `/`; `None` for the root itself.
fn normalise(raw: &str) -> Option<&str> {
    let mut p = raw;
    while let Some(rest) = p.strip_prefix("./") {
        p = rest;
    }
    let p = p.trim_end_matches('/');
    (!p.is_empty() && p != ".").then_some(p)
}

fn apply_layer(
    model: &mut Model,
    index: usize,
    layer: &Layer,
    tx: &tokio::sync::mpsc::Sender<Piece>,
    chunk_size: usize,
    limits: &LayerLimits,
) -> Result<()> {
    let path = &layer.path;
    let mut archive = tar::Archive::new(open_layer(path)?);
    let entries = archive
        .entries()
        .map_err(|e| Error::source(path, format!("not a tar archive: {e}")))?;
    let mut last = String::from("(start of archive)");
    for entry in entries {
        let mut entry = entry.map_err(|e| {
            Error::source(path, format!("unreadable tar header after {last:?}: {e}"))
        })?;
        let raw = entry.path_bytes();
        let raw = String::from_utf8(raw.into_owned()).map_err(|e| {
            hostile(
                path,
                &String::from_utf8_lossy(e.as_bytes()),
                "name is not UTF-8",
            )
        })?;
        last.clone_from(&raw);
        if raw.starts_with('/') {
            return Err(hostile(path, &raw, "absolute name"));
        }
        let Some(rel) = normalise(&raw).map(str::to_string) else {
            continue; // the root directory's own entry
        };
        check_entry_path(&rel).map_err(|e| hostile(path, &raw, root_reason(e)))?;
        if model.nodes.len() >= limits.max_entries {
            return Err(hostile(
                path,
                &raw,
                format!("more than {} entries", limits.max_entries),
            ));
        }
        let header = entry.header();
        let kind = header.entry_type();
        let mut meta = Meta {
            mode: header
                .mode()
                .map_err(|e| hostile(path, &raw, format!("mode: {e}")))?
                & 0o7777,
            uid: header
                .uid()
                .map_err(|e| hostile(path, &raw, format!("uid: {e}")))? as u32,
            gid: header
                .gid()
                .map_err(|e| hostile(path, &raw, format!("gid: {e}")))? as u32,
            mtime_ns: header
                .mtime()
                .map_err(|e| hostile(path, &raw, format!("mtime: {e}")))?
                .min(i64::MAX as u64 / 1_000_000_000) as i64
                * 1_000_000_000,
            xattrs: BTreeMap::new(),
        };
        let link = entry
            .link_name_bytes()
            .map(|l| String::from_utf8(l.into_owned()))
            .transpose()
            .map_err(|_| hostile(path, &raw, "link target is not UTF-8"))?;
        read_pax(&mut entry, &mut meta).map_err(|e| hostile(path, &raw, e))?;

        let (dir, name) = match rel.rsplit_once('/') {
            Some((d, n)) => (d, n),
            None => ("", rel.as_str()),
        };
        if name == OPAQUE {
            model
                .check_parents(&rel, index)
                .map_err(|r| hostile(path, &raw, r))?;
            if model.keep_whiteouts {
                if dir.is_empty() {
                    tracing::warn!(layer = %path.display(), "opaque marker at the layer's root ignored");
                } else {
                    model.opaque.insert(dir.to_string());
                }
            } else {
                model.remove_below(dir, Some(index));
            }
            continue;
        }
        if let Some(hidden) = name.strip_prefix(WHITEOUT) {
            model
                .check_parents(&rel, index)
                .map_err(|r| hostile(path, &raw, r))?;
            let target = if dir.is_empty() {
                hidden.to_string()
            } else {
                format!("{dir}/{hidden}")
            };
            check_entry_path(&target).map_err(|e| hostile(path, &raw, root_reason(e)))?;
            if model.keep_whiteouts {
                model.put(
                    target,
                    Node {
                        kind: Kind::Whiteout,
                        meta: Meta::default(),
                        layer: index,
                    },
                );
                continue;
            }
            if model.nodes.get(&target).is_some_and(|n| n.layer < index) {
                model.nodes.remove(&target);
            }
            model.remove_below(&target, Some(index));
            continue;
        }

        use tar::EntryType as T;
        match kind {
            T::Directory => {
                model
                    .check_parents(&rel, index)
                    .map_err(|r| hostile(path, &raw, r))?;
                model.put_dir(rel, meta, index);
            }
            T::Symlink => {
                let target = link.ok_or_else(|| hostile(path, &raw, "symlink without a target"))?;
                if target.is_empty() || target.contains('\0') {
                    return Err(hostile(path, &raw, "empty symlink target"));
                }
                model
                    .check_parents(&rel, index)
                    .map_err(|r| hostile(path, &raw, r))?;
                model.put(
                    rel,
                    Node {
                        kind: Kind::Symlink(target),
                        meta,
                        layer: index,
                    },
                );
            }
            T::Link => {
                let target =
                    link.ok_or_else(|| hostile(path, &raw, "hard link without a target"))?;
                let target = normalise(&target)
                    .ok_or_else(|| hostile(path, &raw, "hard link to the root"))?
                    .to_string();
                check_entry_path(&target).map_err(|e| {
                    hostile(path, &raw, format!("hard link target: {}", root_reason(e)))
                })?;
                let inode = match model.nodes.get(&target).map(|n| &n.kind) {
                    Some(Kind::File(ino)) => *ino,
                    _ => {
                        return Err(hostile(
                            path,
                            &raw,
                            format!("hard link to {target:?}, which is not a file in the image"),
                        ));
                    }
                };
                model
                    .check_parents(&rel, index)
                    .map_err(|r| hostile(path, &raw, r))?;
                if target != rel {
                    model.put_file(rel, inode, index);
                }
            }
            T::Regular | T::Continuous | T::GNUSparse => {
                let size = entry.size();
                if size > limits.max_file_size {
                    return Err(hostile(
                        path,
                        &raw,
                        format!(
                            "header claims {size} bytes, more than the {}-byte limit",
                            limits.max_file_size
                        ),
                    ));
                }
                model
                    .check_parents(&rel, index)
                    .map_err(|r| hostile(path, &raw, r))?;
                let inode = model.next_inode;
                model.next_inode += 1;
                model.inodes.insert(inode, meta);
                model.put_file(rel, inode, index);
                send_chunks(&mut entry, inode, size, chunk_size, tx).map_err(|e| match e {
                    SendError::Io(e) => hostile(
                        path,
                        &raw,
                        format!("archive ends or fails inside the entry's {size} bytes: {e}"),
                    ),
                    SendError::Closed => Error::source(path, "chunk upload stopped"),
                })?;
            }
            other => {
                tracing::warn!(layer = %path.display(), entry = %raw, kind = ?other,
                    "skipping a device node, FIFO or unknown entry type");
            }
        }
    }
    Ok(())
}

fn root_reason(e: hotstart_store::Error) -> String {
    match e {
        hotstart_store::Error::UnsafePath { reason, .. } => reason,
        other => other.to_string(),
    }
}

/// PAX records: fractional mtime and `SCHILY.xattr.*`.
fn read_pax<R: Read>(entry: &mut tar::Entry<'_, R>, meta: &mut Meta) -> Result<(), String> {
    let Some(exts) = entry
        .pax_extensions()
        .map_err(|e| format!("pax header: {e}"))?
    else {
        return Ok(());
    };
    for ext in exts {
        let ext = ext.map_err(|e| format!("pax record: {e}"))?;
        let Ok(key) = ext.key() else { continue };
        if key == "mtime" {
            if let Some(ns) = ext.value().ok().and_then(parse_pax_time) {
                meta.mtime_ns = ns;
            }
        } else if let Some(name) = key.strip_prefix("SCHILY.xattr.") {
            meta.xattrs
                .insert(name.to_string(), ext.value_bytes().to_vec());
        }
    }
    Ok(())
}

/// `seconds[.fraction]` as nanoseconds.
fn parse_pax_time(s: &str) -> Option<i64> {
    let (secs, frac) = s.split_once('.').unwrap_or((s, ""));
    let secs: i64 = secs.parse().ok()?;
    let mut digits: String = frac.chars().take(9).collect();
    if !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    while digits.len() < 9 {
        digits.push('0');
    }
    let nanos: i64 = digits.parse().ok()?;
    let nanos = if secs < 0 { -nanos } else { nanos };
    secs.checked_mul(1_000_000_000)?.checked_add(nanos)
}

enum SendError {
    Io(std::io::Error),
    Closed,
}

/// Reads the entry's data in chunks and sends them; fails if the data ends early.
fn send_chunks(
    r: &mut impl Read,
    inode: u64,
    size: u64,
    chunk_size: usize,
    tx: &tokio::sync::mpsc::Sender<Piece>,
) -> Result<(), SendError> {
    let mut left = size;
    while left > 0 {
        let n = left.min(chunk_size as u64) as usize;
        let mut buf = vec![0u8; n];
        r.read_exact(&mut buf).map_err(SendError::Io)?;
        left -= n as u64;
        tx.blocking_send(Piece {
            inode,
            data: Bytes::from(buf),
        })
        .map_err(|_| SendError::Closed)?;
    }
    Ok(())
}

impl Model {
    /// Checks every ancestor of `path` is a directory, creating missing ones.
    fn check_parents(&mut self, path: &str, layer: usize) -> Result<(), String> {
        let mut end = 0;
        while let Some(i) = path[end..].find('/') {
            let ancestor = &path[..end + i];
            match self.nodes.get(ancestor).map(|n| &n.kind) {
                Some(Kind::Dir) => {}
                Some(Kind::Symlink(to)) => {
                    return Err(format!(
                        "would write through the symlink {ancestor:?} (-> {to:?})"
                    ));
                }
                Some(Kind::File(_) | Kind::Whiteout) => {
                    return Err(format!("parent {ancestor:?} is not a directory"));
                }
                None => {
                    let meta = Meta {
                        mode: 0o755,
                        ..Meta::default()
                    };
                    self.nodes.insert(
                        ancestor.to_string(),
                        Node {
                            kind: Kind::Dir,
                            meta,
                            layer,
                        },
                    );
                }
            }
            end += i + 1;
        }
        Ok(())
    }

    /// A directory entry: metadata only if a directory is already there, else a replacement.
    fn put_dir(&mut self, path: String, meta: Meta, layer: usize) {
        if let Some(n) = self.nodes.get_mut(&path)
            && matches!(n.kind, Kind::Dir)
        {
            n.meta = meta;
            n.layer = layer;
            return;
        }
        self.put(
            path,
            Node {
                kind: Kind::Dir,
                meta,
                layer,
            },
        );
    }

    /// A file entry naming `inode` (a hard link names an existing one); its metadata lives in
    /// the inode, not the node.
    fn put_file(&mut self, path: String, inode: u64, layer: usize) {
        self.put(
            path,
            Node {
                kind: Kind::File(inode),
                meta: Meta::default(),
                layer,
            },
        );
    }

    /// Puts `node` at `path`, removing what was there (and under it, if a directory).
    fn put(&mut self, path: String, node: Node) {
        self.remove(&path);
        self.nodes.insert(path, node);
    }

    /// Removes `path` and everything under it.
    fn remove(&mut self, path: &str) {
        self.nodes.remove(path);
        self.remove_below(path, None);
    }

    /// Removes everything under `dir` (the whole tree for `""`), or only what came from layers
    /// below `below_layer`.
    fn remove_below(&mut self, dir: &str, below_layer: Option<usize>) {
        let prefix = if dir.is_empty() {
            String::new()
        } else {
            format!("{dir}/")
        };
        let doomed: Vec<String> = self
            .nodes
            .range(prefix.clone()..)
            .take_while(|(p, _)| p.starts_with(&prefix))
            .filter(|(_, n)| below_layer.is_none_or(|l| n.layer < l))
            .map(|(p, _)| p.clone())
            .collect();
        for p in &doomed {
            self.nodes.remove(p);
        }
        // An opaque marker removes lower directories, but this layer's entries under them stay:
        // give those their parent directories back.
        if let Some(layer) = below_layer
            && !doomed.is_empty()
        {
            let kept: Vec<String> = self
                .nodes
                .range(prefix.clone()..)
                .take_while(|(p, _)| p.starts_with(&prefix))
                .map(|(p, _)| p.clone())
                .collect();
            for p in kept {
                // Only directories were ancestors of kept entries, so this cannot fail.
                let _ = self.check_parents(&p, layer);
            }
        }
    }

    /// The tree: paths in order, the first path of each inode holding the file and later ones
    /// hard links to it.
    fn into_tree(self, mut refs: HashMap<u64, Vec<ChunkRef>>) -> Result<Tree> {
        let mut first_of: HashMap<u64, String> = HashMap::new();
        let mut entries = Vec::with_capacity(self.nodes.len());
        for (path, mut node) in self.nodes {
            if self.opaque.contains(&path) {
                node.meta
                    .xattrs
                    .insert(OVERLAY_OPAQUE.into(), b"y".to_vec());
            }
            let (kind, meta) = match node.kind {
                Kind::Dir => (EntryKind::Dir, node.meta),
                Kind::Whiteout => (EntryKind::Whiteout, node.meta),
                Kind::Symlink(target) => (EntryKind::Symlink { target }, node.meta),
                Kind::File(ino) => match first_of.get(&ino) {
                    Some(first) => (
                        EntryKind::Hardlink {
                            target: first.clone(),
                        },
                        self.inodes
                            .get(&ino)
                            .cloned()
                            .map(|m| Meta {
                                xattrs: BTreeMap::new(),
                                ..m
                            })
                            .unwrap_or_default(),
                    ),
                    None => {
                        first_of.insert(ino, path.clone());
                        let chunks = refs.remove(&ino).unwrap_or_default();
                        let size = chunks.iter().map(|c| c.len as u64).sum();
                        (
                            EntryKind::File { size, chunks },
                            self.inodes.get(&ino).cloned().unwrap_or_default(),
                        )
                    }
                },
            };
            entries.push(Entry {
                path,
                kind,
                mode: meta.mode,
                uid: meta.uid,
                gid: meta.gid,
                mtime_ns: meta.mtime_ns,
                xattrs: meta.xattrs,
            });
        }
        let tree = Tree { entries };
        tree.validate()?;
        Ok(tree)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pax_times() {
        assert_eq!(parse_pax_time("12"), Some(12_000_000_000));
        assert_eq!(parse_pax_time("12.5"), Some(12_500_000_000));
        assert_eq!(parse_pax_time("1.123456789123"), Some(1_123_456_789));
        assert_eq!(parse_pax_time("x"), None);
        assert_eq!(parse_pax_time("1.x"), None);
    }

    #[test]
    fn normalised_names() {
        assert_eq!(normalise("./a/b/"), Some("a/b"));
        assert_eq!(normalise("././a"), Some("a"));
        assert_eq!(normalise("./"), None);
        assert_eq!(normalise("."), None);
    }
}
