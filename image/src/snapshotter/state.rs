//! The snapshotter's state: every snapshot containerd made, kept in one metadata file that is
//! replaced atomically (written beside, fsynced, renamed, directory fsynced) on every change,
//! and one directory per snapshot.
//!
//! ```text
//! <root>/metadata.json        {"version":1,"next_id":N,"snapshots":{key: record}}
//! <root>/snapshots/<id>/fs    the snapshot's files (an active snapshot's upper directory)
//! <root>/snapshots/<id>/work  overlayfs's work directory (active snapshots with a parent)
//! ```
//!
//! The metadata file is the truth: a directory it does not name (a prepare that crashed before
//! its record was written, a remove that crashed after) is deleted by [`Snapshots::cleanup`],
//! which also runs at start. Semantics follow containerd's own snapshotters: a parent must be
//! committed, a snapshot with children cannot be removed, committing renames an active snapshot
//! to its committed name and syncs its files first.

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::io::Write;
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::SystemTime;

use serde::{Deserialize, Serialize};

/// What a snapshot is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Kind {
    /// Read-only, over a committed parent; never committed.
    View,
    /// Writable; becomes a committed snapshot when committed.
    Active,
    /// Read-only for good; may be the parent of others.
    Committed,
}

impl Kind {
    fn name(self) -> &'static str {
        match self {
            Kind::View => "view",
            Kind::Active => "active",
            Kind::Committed => "committed",
        }
    }
}

/// Bytes and inodes a snapshot's own directory uses (not its parents').
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Usage {
    pub size: i64,
    pub inodes: i64,
}

/// One snapshot, as the metadata file keeps it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Record {
    /// Names its directory; never reused.
    pub id: u64,
    pub kind: Kind,
    /// The committed snapshot it stacks on ("" for none).
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub parent: String,
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub labels: BTreeMap<String, String>,
    pub created: SystemTime,
    pub updated: SystemTime,
    /// Measured when committed (a committed snapshot never changes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub usage: Option<Usage>,
    /// The image in the store that serves this committed layer lazily (mounted read-only at
    /// its directory), when it is one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lazy: Option<String>,
}

/// The label CRI passes with the digests of the layer being prepared and those above it.
pub const IMAGE_LAYERS_LABEL: &str = "containerd.io/snapshot/cri.image-layers";

/// The label CRI passes with the reference of the image being pulled.
pub const IMAGE_REF_LABEL: &str = "containerd.io/snapshot/cri.image-ref";

/// A lazily served layer, as [`Snapshots::lazy_layers`] lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LazyLayer {
    pub id: u64,
    /// The image in the store that serves it.
    pub image: String,
    /// The container image whose pull unpacked it (CRI's label
    /// [`IMAGE_REF_LABEL`]), when containerd said.
    pub pulled_for: Option<String>,
}

impl LazyLayer {
    fn of(r: &Record) -> Option<LazyLayer> {
        Some(LazyLayer {
            id: r.id,
            image: r.lazy.clone()?,
            pulled_for: r.labels.get(IMAGE_REF_LABEL).cloned(),
        })
    }
}

/// A snapshot and its key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Info {
    pub key: String,
    pub record: Record,
}

/// A mount containerd performs, in its terms.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mount {
    pub kind: String,
    pub source: String,
    pub options: Vec<String>,
}

/// Why a request was refused; each maps to the gRPC code containerd expects.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    #[error("snapshot {key:?} does not exist")]
    NotFound { key: String },
    #[error("snapshot {key:?} already exists")]
    AlreadyExists { key: String },
    #[error("snapshot {key:?}: {reason}")]
    Precondition { key: String, reason: String },
    #[error("{0}")]
    Invalid(String),
    #[error("{op} {path}: {source}", path = path.display())]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
}

fn io<'a>(op: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> SnapshotError + 'a {
    move |source| SnapshotError::Io {
        op,
        path: path.to_path_buf(),
        source,
    }
}

type Result<T> = std::result::Result<T, SnapshotError>;

const VERSION: u32 = 1;

#[derive(Debug, Default, Serialize, Deserialize)]
struct Metadata {
    version: u32,
    next_id: u64,
    snapshots: BTreeMap<String, Record>,
}

/// Every snapshot under one root directory.
#[derive(Debug)]
pub struct Snapshots {
    root: PathBuf,
    meta: Mutex<Metadata>,
}

impl Snapshots {
    /// Opens (or creates) the state under `root`, and deletes directories no snapshot names.
    pub fn open(root: impl Into<PathBuf>) -> Result<Snapshots> {
        let root = root.into();
        let dirs = root.join("snapshots");
        fs::create_dir_all(&dirs).map_err(io("create", &dirs))?;
        let file = root.join("metadata.json");
        let meta = match fs::read(&file) {
            Ok(bytes) => {
                let m: Metadata = serde_json::from_slice(&bytes).map_err(|e| {
                    SnapshotError::Invalid(format!(
                        "{}: not snapshotter metadata ({e}); move it aside to start empty, \
                         which forgets every snapshot containerd knows of",
                        file.display()
                    ))
                })?;
                if m.version != VERSION {
                    return Err(SnapshotError::Invalid(format!(
                        "{}: metadata version {} (this build reads {VERSION})",
                        file.display(),
                        m.version
                    )));
                }
                m
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Metadata {
                version: VERSION,
                next_id: 1,
                snapshots: BTreeMap::new(),
            },
            Err(e) => return Err(io("read", &file)(e)),
        };
        let s = Snapshots {
            root,
            meta: Mutex::new(meta),
        };
        s.cleanup()?;
        Ok(s)
    }

    /// The root directory.
    pub fn root(&self) -> &Path {
        &self.root
    }

    fn lock(&self) -> MutexGuard<'_, Metadata> {
        self.meta.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn dir(&self, id: u64) -> PathBuf {
        self.root.join("snapshots").join(id.to_string())
    }

    /// Writes the metadata file durably: beside, fsync, rename, fsync the directory.
    fn persist(&self, m: &Metadata) -> Result<()> {
        let file = self.root.join("metadata.json");
        let tmp = self.root.join("metadata.json.tmp");
        let bytes = serde_json::to_vec(m).expect("metadata serializes");
        let mut f = fs::File::create(&tmp).map_err(io("create", &tmp))?;
        f.write_all(&bytes).map_err(io("write", &tmp))?;
        f.sync_all().map_err(io("fsync", &tmp))?;
        fs::rename(&tmp, &file).map_err(io("rename", &file))?;
        fs::File::open(&self.root)
            .and_then(|d| d.sync_all())
            .map_err(io("fsync", &self.root))
    }

    /// Runs `change` on the metadata and writes it; on failure the change is undone.
    fn change<T>(&self, change: impl FnOnce(&mut Metadata) -> Result<T>) -> Result<T> {
        let mut m = self.lock();
        let before = (m.next_id, m.snapshots.clone());
        let out = change(&mut m)?;
        if let Err(e) = self.persist(&m) {
            (m.next_id, m.snapshots) = before;
            return Err(e);
        }
        Ok(out)
    }

    /// The snapshot under `key`.
    pub fn stat(&self, key: &str) -> Result<Record> {
        self.lock()
            .snapshots
            .get(key)
            .cloned()
            .ok_or_else(|| not_found(key))
    }

    /// Every snapshot that matches one of `filters` (all, without filters); see [`Filter`].
    pub fn list(&self, filters: &[String]) -> Result<Vec<Info>> {
        let filters = filters
            .iter()
            .map(|f| Filter::parse(f))
            .collect::<Result<Vec<_>>>()?;
        Ok(self
            .lock()
            .snapshots
            .iter()
            .map(|(k, r)| Info {
                key: k.clone(),
                record: r.clone(),
            })
            .filter(|i| filters.is_empty() || filters.iter().any(|f| f.matches(i)))
            .collect())
    }

    /// A new active snapshot over `parent` ("" for none).
    pub fn prepare(
        &self,
        key: &str,
        parent: &str,
        labels: BTreeMap<String, String>,
    ) -> Result<Vec<Mount>> {
        self.create(Kind::Active, key, parent, labels)
    }

    /// A new read-only view of `parent`.
    pub fn view(
        &self,
        key: &str,
        parent: &str,
        labels: BTreeMap<String, String>,
    ) -> Result<Vec<Mount>> {
        self.create(Kind::View, key, parent, labels)
    }

    fn create(
        &self,
        kind: Kind,
        key: &str,
        parent: &str,
        labels: BTreeMap<String, String>,
    ) -> Result<Vec<Mount>> {
        if key.is_empty() {
            return Err(SnapshotError::Invalid(
                "a snapshot key cannot be empty".into(),
            ));
        }
        let mut made = None;
        let res = self.change(|m| {
            if m.snapshots.contains_key(key) {
                return Err(SnapshotError::AlreadyExists { key: key.into() });
            }
            if !parent.is_empty() {
                match m.snapshots.get(parent) {
                    None => return Err(not_found(parent)),
                    Some(p) if p.kind != Kind::Committed => {
                        return Err(SnapshotError::Precondition {
                            key: parent.into(),
                            reason: format!(
                                "a parent must be committed, this one is {}",
                                p.kind.name()
                            ),
                        });
                    }
                    Some(_) => {}
                }
            }
            let id = m.next_id;
            m.next_id += 1;
            let dir = self.dir(id);
            made = Some(dir.clone());
            for sub in ["fs", "work"] {
                let p = dir.join(sub);
                fs::create_dir_all(&p).map_err(io("create", &p))?;
            }
            let now = SystemTime::now();
            m.snapshots.insert(
                key.to_string(),
                Record {
                    id,
                    kind,
                    parent: parent.to_string(),
                    labels,
                    created: now,
                    updated: now,
                    usage: None,
                    lazy: None,
                },
            );
            mounts(m, key, &self.root)
        });
        if res.is_err()
            && let Some(dir) = made
        {
            let _ = fs::remove_dir_all(dir);
        }
        res
    }

    /// The directory a lazily served layer is mounted at.
    pub fn fs_dir(&self, id: u64) -> PathBuf {
        self.dir(id).join("fs")
    }

    /// Takes an id and an empty directory for a layer served lazily as the committed snapshot
    /// `name` over `parent`; [`Snapshots::record_lazy`] records it (and the id with it) once
    /// it is mounted. Until then nothing on disk names the directory: a crash leaves it to the
    /// sweep at start, before any id is handed out again.
    pub fn reserve_lazy(&self, name: &str, parent: &str) -> Result<u64> {
        let id = {
            let mut m = self.lock();
            if m.snapshots.contains_key(name) {
                return Err(SnapshotError::AlreadyExists { key: name.into() });
            }
            check_parent(&m, parent)?;
            m.next_id += 1;
            m.next_id - 1
        };
        let fs_dir = self.fs_dir(id);
        fs::create_dir_all(&fs_dir).map_err(io("create", &fs_dir))?;
        Ok(id)
    }

    /// Records the layer mounted at [`Snapshots::fs_dir`]`(id)` as the committed snapshot `name`.
    pub fn record_lazy(
        &self,
        name: &str,
        id: u64,
        parent: &str,
        labels: BTreeMap<String, String>,
        image: &str,
        usage: Usage,
    ) -> Result<()> {
        self.change(|m| {
            if m.snapshots.contains_key(name) {
                return Err(SnapshotError::AlreadyExists { key: name.into() });
            }
            check_parent(m, parent)?;
            let now = SystemTime::now();
            m.snapshots.insert(
                name.into(),
                Record {
                    id,
                    kind: Kind::Committed,
                    parent: parent.into(),
                    labels,
                    created: now,
                    updated: now,
                    usage: Some(usage),
                    lazy: Some(image.into()),
                },
            );
            Ok(())
        })
    }

    /// Deletes the directory of an id no record names (a lazy layer that could not be mounted).
    pub fn discard(&self, id: u64) {
        let dir = self.dir(id);
        detach(&dir.join("fs"));
        let _ = fs::remove_dir_all(dir);
    }

    /// The lazily served layers `key` stacks on (itself included), top first.
    pub fn lazy_layers(&self, key: &str) -> Result<Vec<LazyLayer>> {
        let m = self.lock();
        let mut out = Vec::new();
        let mut k = key;
        while !k.is_empty() {
            let r = m.snapshots.get(k).ok_or_else(|| not_found(k))?;
            out.extend(LazyLayer::of(r));
            k = r.parent.as_str();
        }
        Ok(out)
    }

    /// Every lazily served layer.
    pub fn all_lazy(&self) -> Vec<LazyLayer> {
        self.lock()
            .snapshots
            .values()
            .filter_map(LazyLayer::of)
            .collect()
    }

    /// How to mount the active or view snapshot `key`.
    pub fn mounts(&self, key: &str) -> Result<Vec<Mount>> {
        mounts(&self.lock(), key, &self.root)
    }

    /// Commits the active snapshot `key` as `name`, with `labels`: its files are synced to disk
    /// and measured first, and it is read-only from then on.
    pub fn commit(&self, name: &str, key: &str, labels: BTreeMap<String, String>) -> Result<()> {
        if name.is_empty() {
            return Err(SnapshotError::Invalid(
                "a committed name cannot be empty".into(),
            ));
        }
        let rec = self.stat(key)?;
        if rec.kind != Kind::Active {
            return Err(SnapshotError::Precondition {
                key: key.into(),
                reason: format!(
                    "only an active snapshot can be committed, this one is {}",
                    rec.kind.name()
                ),
            });
        }
        let fs_dir = self.dir(rec.id).join("fs");
        // What was written through the mount reaches the disk before the record says committed.
        syncfs(&fs_dir)?;
        let usage = usage(&fs_dir)?;
        self.change(|m| {
            if m.snapshots.contains_key(name) {
                return Err(SnapshotError::AlreadyExists { key: name.into() });
            }
            let mut r = match m.snapshots.remove(key) {
                Some(r) if r.id == rec.id && r.kind == Kind::Active => r,
                Some(other) => {
                    m.snapshots.insert(key.into(), other);
                    return Err(SnapshotError::Precondition {
                        key: key.into(),
                        reason: "changed while being committed".into(),
                    });
                }
                None => return Err(not_found(key)),
            };
            r.kind = Kind::Committed;
            r.labels = labels;
            r.updated = SystemTime::now();
            r.usage = Some(usage);
            m.snapshots.insert(name.into(), r);
            Ok(())
        })?;
        // An empty work directory is all a committed snapshot would keep of it.
        let _ = fs::remove_dir_all(self.dir(rec.id).join("work"));
        Ok(())
    }

    /// The record of `key` if it may be removed: it exists and nothing stacks on it.
    pub fn removable(&self, key: &str) -> Result<Record> {
        removable(&self.lock(), key).cloned()
    }

    /// Removes `key` and its files; refused while another snapshot stacks on it.
    pub fn remove(&self, key: &str) -> Result<()> {
        let id = self.change(|m| {
            let id = removable(m, key)?.id;
            m.snapshots.remove(key);
            Ok(id)
        })?;
        // Gone from the record: a crash from here on leaves a directory cleanup deletes.
        let dir = self.dir(id);
        detach(&dir.join("fs"));
        fs::remove_dir_all(&dir).map_err(io("remove", &dir))
    }

    /// Sets the labels of `key`: all of them (`paths` empty, or `["labels"]`), or the named ones
    /// (`labels.<name>`: set to `labels[name]`, or removed if `labels` has none). Nothing else of
    /// a snapshot may change.
    pub fn update(
        &self,
        key: &str,
        labels: BTreeMap<String, String>,
        paths: &[String],
    ) -> Result<Record> {
        let mut set = Vec::new();
        let mut all = paths.is_empty();
        for p in paths {
            if p == "labels" {
                all = true;
            } else if let Some(name) = p.strip_prefix("labels.") {
                set.push(name.to_string());
            } else {
                return Err(SnapshotError::Invalid(format!(
                    "cannot update field {p:?} of snapshot {key:?}: only labels change"
                )));
            }
        }
        self.change(|m| {
            let r = m.snapshots.get_mut(key).ok_or_else(|| not_found(key))?;
            if all {
                r.labels = labels.clone();
            }
            for name in &set {
                match labels.get(name) {
                    Some(v) => r.labels.insert(name.clone(), v.clone()),
                    None => r.labels.remove(name),
                };
            }
            r.updated = SystemTime::now();
            Ok(r.clone())
        })
    }

    /// What `key`'s own directory uses: measured at commit for a committed snapshot, now for
    /// an active one.
    pub fn usage(&self, key: &str) -> Result<Usage> {
        let r = self.stat(key)?;
        match r.usage {
            Some(u) => Ok(u),
            None => usage(&self.dir(r.id).join("fs")),
        }
    }

    /// Deletes every snapshot directory the metadata does not name; returns how many.
    pub fn cleanup(&self) -> Result<usize> {
        let ids: BTreeSet<String> = self
            .lock()
            .snapshots
            .values()
            .map(|r| r.id.to_string())
            .collect();
        let dirs = self.root.join("snapshots");
        let mut removed = 0;
        for e in fs::read_dir(&dirs).map_err(io("read", &dirs))? {
            let e = e.map_err(io("read", &dirs))?;
            if !ids.contains(e.file_name().to_string_lossy().as_ref()) {
                let p = e.path();
                detach(&p.join("fs"));
                fs::remove_dir_all(&p).map_err(io("remove", &p))?;
                removed += 1;
            }
        }
        Ok(removed)
    }
}

fn removable<'a>(m: &'a Metadata, key: &str) -> Result<&'a Record> {
    let r = m.snapshots.get(key).ok_or_else(|| not_found(key))?;
    if let Some(child) = m.snapshots.iter().find(|(_, c)| c.parent == key) {
        return Err(SnapshotError::Precondition {
            key: key.into(),
            reason: format!("snapshot {:?} stacks on it; remove that first", child.0),
        });
    }
    Ok(r)
}

/// A parent must exist and be committed.
fn check_parent(m: &Metadata, parent: &str) -> Result<()> {
    match m.snapshots.get(parent) {
        _ if parent.is_empty() => Ok(()),
        None => Err(not_found(parent)),
        Some(p) if p.kind != Kind::Committed => Err(SnapshotError::Precondition {
            key: parent.into(),
            reason: format!("a parent must be committed, this one is {}", p.kind.name()),
        }),
        Some(_) => Ok(()),
    }
}

/// Detaches whatever is mounted at `path` (a lazy layer's FUSE mount, live or left by a
/// crash); nothing if nothing is.
fn detach(path: &Path) {
    let Ok(c) = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()) else {
        return;
    };
    // SAFETY: umount2 reads the NUL-terminated path `c` owns; EINVAL (not a mount point) and
    // ENOENT are the expected failures and change nothing.
    unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) };
}

fn not_found(key: &str) -> SnapshotError {
    SnapshotError::NotFound { key: key.into() }
}

/// The mounts of `key`: a bind mount of its own directory without a parent; over parents,
/// an overlay whose lower directories are the parents' (nearest first); a view of one parent
/// is a read-only bind mount of it.
fn mounts(m: &Metadata, key: &str, root: &Path) -> Result<Vec<Mount>> {
    let r = m.snapshots.get(key).ok_or_else(|| not_found(key))?;
    if r.kind == Kind::Committed {
        return Err(SnapshotError::Precondition {
            key: key.into(),
            reason: "a committed snapshot has no mounts; view or prepare on it".into(),
        });
    }
    let dir = |id: u64| root.join("snapshots").join(id.to_string());
    let mut lower = Vec::new();
    let mut p = r.parent.as_str();
    while !p.is_empty() {
        let pr = m.snapshots.get(p).ok_or_else(|| not_found(p))?;
        lower.push(dir(pr.id).join("fs").display().to_string());
        p = pr.parent.as_str();
    }
    let bind = |source: String, rw: &str| Mount {
        kind: "bind".into(),
        source,
        options: vec![rw.into(), "rbind".into()],
    };
    let own = dir(r.id);
    Ok(vec![match (r.kind, lower.len()) {
        (Kind::Active, 0) => bind(own.join("fs").display().to_string(), "rw"),
        (Kind::View, 0) => bind(own.join("fs").display().to_string(), "ro"),
        (Kind::View, 1) => bind(lower.remove(0), "ro"),
        (Kind::View, _) => Mount {
            kind: "overlay".into(),
            source: "overlay".into(),
            options: vec![format!("lowerdir={}", lower.join(":"))],
        },
        (_, _) => Mount {
            kind: "overlay".into(),
            source: "overlay".into(),
            options: vec![
                format!("workdir={}", own.join("work").display()),
                format!("upperdir={}", own.join("fs").display()),
                format!("lowerdir={}", lower.join(":")),
            ],
        },
    }])
}

fn syncfs(dir: &Path) -> Result<()> {
    let f = fs::File::open(dir).map_err(io("open", dir))?;
    // SAFETY: syncfs only reads the descriptor, which `f` keeps open for the call.
    if unsafe { libc::syncfs(std::os::fd::AsRawFd::as_raw_fd(&f)) } != 0 {
        return Err(io("syncfs", dir)(std::io::Error::last_os_error()));
    }
    Ok(())
}

/// Bytes (allocated blocks) and inodes under `dir`, each inode counted once.
fn usage(dir: &Path) -> Result<Usage> {
    let mut seen = BTreeSet::new();
    let mut u = Usage::default();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in fs::read_dir(&d).map_err(io("read", &d))? {
            let p = e.map_err(io("read", &d))?.path();
            let md = fs::symlink_metadata(&p).map_err(io("stat", &p))?;
            if seen.insert((md.dev(), md.ino())) {
                u.inodes += 1;
                u.size += (md.blocks() * 512) as i64;
            }
            if md.is_dir() {
                stack.push(p);
            }
        }
    }
    Ok(u)
}

/// One filter of a list request: comma-separated conditions that must all hold, each
/// `field==value` or `field!=value` over `name`, `parent`, `kind` and `labels.<name>` (the label
/// name may be quoted: `labels."a.b"`; an absent field equals `""`), or a bare `field` that
/// must be present.
#[derive(Debug)]
pub struct Filter(Vec<(String, Option<(bool, String)>)>);

impl Filter {
    pub fn parse(text: &str) -> Result<Filter> {
        let bad = |why: &str| SnapshotError::Invalid(format!("filter {text:?}: {why}"));
        let mut conds = Vec::new();
        for cond in text.split(',').map(str::trim).filter(|c| !c.is_empty()) {
            let (field, test) = if let Some((f, v)) = cond.split_once("==") {
                (f, Some((true, v)))
            } else if let Some((f, v)) = cond.split_once("!=") {
                (f, Some((false, v)))
            } else if cond.contains(['~', '=', '!']) {
                return Err(bad("only ==, != and presence are supported"));
            } else {
                (cond, None)
            };
            let field = field.trim();
            let field = match field.strip_prefix("labels.") {
                Some(l) => format!("labels.{}", unquote(l)),
                None if ["name", "parent", "kind"].contains(&field) => field.to_string(),
                None => return Err(bad(&format!("unknown field {field:?}"))),
            };
            conds.push((field, test.map(|(eq, v)| (eq, unquote(v.trim())))));
        }
        Ok(Filter(conds))
    }

    fn matches(&self, i: &Info) -> bool {
        self.0.iter().all(|(field, test)| {
            let value = match field.strip_prefix("labels.") {
                Some(l) => i.record.labels.get(l).cloned(),
                None => Some(match field.as_str() {
                    "name" => i.key.clone(),
                    "parent" => i.record.parent.clone(),
                    _ => i.record.kind.name().to_string(),
                })
                .filter(|v| !v.is_empty()),
            };
            match (test, value) {
                (None, v) => v.is_some(),
                // A field that is absent equals "" (containerd asks for `parent==""`).
                (Some((eq, want)), v) => (v.as_deref().unwrap_or("") == want) == *eq,
            }
        })
    }
}

fn unquote(s: &str) -> String {
    s.strip_prefix('"')
        .and_then(|s| s.strip_suffix('"'))
        .unwrap_or(s)
        .to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(kv: &[(&str, &str)]) -> BTreeMap<String, String> {
        kv.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn dir_of(s: &Snapshots, key: &str) -> PathBuf {
        s.dir(s.stat(key).unwrap().id)
    }

    #[test]
    fn a_chain_of_layers_mounts_as_overlay_and_survives_a_reopen() {
        let root = tempfile::tempdir().unwrap();
        let s = Snapshots::open(root.path()).unwrap();
        let m = s.prepare("a-key", "", labels(&[("x", "1")])).unwrap();
        assert_eq!(m[0].kind, "bind");
        assert!(m[0].options.contains(&"rw".to_string()));
        std::fs::write(Path::new(&m[0].source).join("f"), b"layer a").unwrap();
        s.commit("a", "a-key", labels(&[("y", "2")])).unwrap();
        assert!(matches!(
            s.stat("a-key"),
            Err(SnapshotError::NotFound { .. })
        ));
        let a = s.stat("a").unwrap();
        assert_eq!(
            (a.kind, a.labels.clone()),
            (Kind::Committed, labels(&[("y", "2")]))
        );
        assert!(a.usage.unwrap().size > 0 && a.usage.unwrap().inodes == 1);

        s.prepare("b-key", "a", BTreeMap::new()).unwrap();
        s.commit("b", "b-key", BTreeMap::new()).unwrap();
        let top = s.prepare("top", "b", BTreeMap::new()).unwrap();
        let (da, db, dt) = (dir_of(&s, "a"), dir_of(&s, "b"), dir_of(&s, "top"));
        assert_eq!(
            top[0].options,
            vec![
                format!("workdir={}", dt.join("work").display()),
                format!("upperdir={}", dt.join("fs").display()),
                format!(
                    "lowerdir={}:{}",
                    db.join("fs").display(),
                    da.join("fs").display()
                ),
            ]
        );
        // A view of one layer binds it read-only; of two, a lower-only overlay.
        let v = s.view("v1", "a", BTreeMap::new()).unwrap();
        assert_eq!(
            (v[0].kind.as_str(), v[0].source.clone()),
            ("bind", da.join("fs").display().to_string())
        );
        assert!(v[0].options.contains(&"ro".to_string()));
        let v = s.view("v2", "b", BTreeMap::new()).unwrap();
        assert_eq!(
            v[0].options,
            vec![format!(
                "lowerdir={}:{}",
                db.join("fs").display(),
                da.join("fs").display()
            )]
        );

        let before = s.list(&[]).unwrap();
        drop(s);
        let s = Snapshots::open(root.path()).unwrap();
        assert_eq!(s.list(&[]).unwrap(), before);
        assert_eq!(s.mounts("top").unwrap(), top);
        assert_eq!(std::fs::read(da.join("fs/f")).unwrap(), b"layer a");
    }

    #[test]
    fn refusals_have_containerds_kinds_and_change_nothing() {
        let root = tempfile::tempdir().unwrap();
        let s = Snapshots::open(root.path()).unwrap();
        s.prepare("k", "", BTreeMap::new()).unwrap();
        assert!(matches!(
            s.prepare("k", "", BTreeMap::new()),
            Err(SnapshotError::AlreadyExists { .. })
        ));
        assert!(matches!(
            s.prepare("j", "nope", BTreeMap::new()),
            Err(SnapshotError::NotFound { .. })
        ));
        // A parent must be committed.
        let e = s.prepare("j", "k", BTreeMap::new()).unwrap_err();
        assert!(matches!(e, SnapshotError::Precondition { .. }), "{e}");
        assert!(matches!(
            s.commit("c", "nope", BTreeMap::new()),
            Err(SnapshotError::NotFound { .. })
        ));
        s.commit("c", "k", BTreeMap::new()).unwrap();
        assert!(matches!(
            s.mounts("c"),
            Err(SnapshotError::Precondition { .. })
        ));
        s.prepare("k2", "", BTreeMap::new()).unwrap();
        assert!(matches!(
            s.commit("c", "k2", BTreeMap::new()),
            Err(SnapshotError::AlreadyExists { .. })
        ));
        // A committed snapshot cannot be committed again; one with children cannot go.
        s.view("v", "c", BTreeMap::new()).unwrap();
        assert!(matches!(
            s.commit("d", "v", BTreeMap::new()),
            Err(SnapshotError::Precondition { .. })
        ));
        let e = s.remove("c").unwrap_err();
        assert!(e.to_string().contains("\"v\" stacks on it"), "{e}");
        assert!(matches!(
            s.update("c", BTreeMap::new(), &["parent".into()]),
            Err(SnapshotError::Invalid(_))
        ));
        let keys: Vec<String> = s.list(&[]).unwrap().into_iter().map(|i| i.key).collect();
        assert_eq!(keys, ["c", "k2", "v"]);
        s.remove("v").unwrap();
        s.remove("c").unwrap();
        assert!(matches!(s.stat("c"), Err(SnapshotError::NotFound { .. })));
    }

    #[test]
    fn labels_update_whole_or_by_name_and_filters_select() {
        let root = tempfile::tempdir().unwrap();
        let s = Snapshots::open(root.path()).unwrap();
        s.prepare("k", "", labels(&[("a", "1"), ("b", "2")]))
            .unwrap();
        s.commit("c", "k", labels(&[("a", "1"), ("b", "2")]))
            .unwrap();
        s.prepare("w", "c", labels(&[("gc", "x")])).unwrap();
        let r = s
            .update(
                "c",
                labels(&[("b", "3"), ("z", "9")]),
                &["labels.b".into(), "labels.a".into()],
            )
            .unwrap();
        assert_eq!(
            r.labels,
            labels(&[("b", "3")]),
            "a removed, b set, z not named"
        );
        let r = s.update("c", labels(&[("q", "1")]), &[]).unwrap();
        assert_eq!(r.labels, labels(&[("q", "1")]));
        let keys = |f: &[&str]| -> Vec<String> {
            let f: Vec<String> = f.iter().map(|s| s.to_string()).collect();
            s.list(&f).unwrap().into_iter().map(|i| i.key).collect()
        };
        assert_eq!(keys(&["kind==committed"]), ["c"]);
        assert_eq!(keys(&["parent==c"]), ["w"]);
        assert_eq!(keys(&["labels.\"gc\"==x"]), ["w"]);
        assert_eq!(keys(&["labels.q", "name==w"]), ["c", "w"]);
        assert_eq!(keys(&["kind!=committed,parent"]), ["w"]);
        assert_eq!(keys(&["labels.q==1,parent==\"\""]), ["c"]);
        assert!(matches!(
            s.list(&["size>3".into()]),
            Err(SnapshotError::Invalid(_))
        ));
    }

    #[test]
    fn directories_no_record_names_are_swept_and_a_bad_record_is_refused() {
        let root = tempfile::tempdir().unwrap();
        let s = Snapshots::open(root.path()).unwrap();
        s.prepare("k", "", BTreeMap::new()).unwrap();
        let kept = dir_of(&s, "k");
        drop(s);
        // A prepare that crashed before its record was written.
        std::fs::create_dir_all(root.path().join("snapshots/99/fs")).unwrap();
        let s = Snapshots::open(root.path()).unwrap();
        assert!(!root.path().join("snapshots/99").exists());
        assert!(kept.exists());
        assert_eq!(s.cleanup().unwrap(), 0);
        drop(s);
        std::fs::write(root.path().join("metadata.json"), b"{not json").unwrap();
        let e = Snapshots::open(root.path()).unwrap_err().to_string();
        assert!(e.contains("move it aside"), "{e}");
        assert!(kept.exists(), "nothing deleted for a record it cannot read");
    }
}
