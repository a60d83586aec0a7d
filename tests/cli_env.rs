//! End-to-end: `hotstart env` with real pip, real venvs and real stores (a local directory and
//! SeaweedFS).
//!
//! The venvs are built from a small wheelhouse (numpy and a few pure-Python packages) that
//! `scripts/wheelhouse.sh` downloads once into `.cache/wheelhouse/test`; installs use
//! `--no-index`, so the tests need no network after that.

use std::collections::BTreeMap;
use std::os::unix::fs::MetadataExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use hotstart_store::chunk::decode_frame;
use hotstart_store::{ChunkId, Store};
use hotstart_testkit::{SeaweedFs, workspace_root};
use serde_json::Value;

fn root() -> PathBuf {
    workspace_root().expect("workspace root")
}

/// The interpreter every test venv is made from: the project's `.venv` (made by setup.sh).
fn python() -> PathBuf {
    let py = root().join(".venv/bin/python");
    assert!(
        py.exists(),
        "{} is missing; run scripts/setup.sh",
        py.display()
    );
    py
}

/// The test wheelhouse, downloaded once (later runs need no network).
fn wheelhouse() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let root = root();
        let status = Command::new("bash")
            .arg(root.join("scripts/wheelhouse.sh"))
            .arg("test")
            .arg(root.join("scripts/wheelhouse-test.txt"))
            .status()
            .expect("run scripts/wheelhouse.sh");
        assert!(status.success(), "scripts/wheelhouse.sh failed");
        root.join(".cache/wheelhouse/test")
    })
}

/// One store and one node's cache, in a fresh temporary directory.
struct Fixture {
    work: tempfile::TempDir,
    store: String,
    aws: Vec<(String, String)>,
    /// Client options of the store (SeaweedFS's endpoint), for reading and damaging it directly.
    client: Vec<(String, String)>,
    cache: PathBuf,
}

impl Fixture {
    fn local() -> Fixture {
        let work = tempfile::tempdir().unwrap();
        let store = work.path().join("store").display().to_string();
        let cache = work.path().join("node-a");
        Fixture {
            work,
            store,
            aws: Vec::new(),
            client: Vec::new(),
            cache,
        }
    }

    fn seaweedfs(name: &str) -> Option<Fixture> {
        let weed = SeaweedFs::shared()?;
        let mut f = Fixture::local();
        f.store = format!("{}/snapshots", weed.fresh_bucket(name));
        f.aws = weed.env();
        f.client = weed.client_options();
        Some(f)
    }

    /// The store the snapshots go to, opened directly.
    fn open_store(&self) -> Store {
        Store::open_with(&self.store, &self.client).unwrap()
    }

    /// Every object in the store.
    fn stored_objects(&self) -> Vec<String> {
        let store = self.open_store();
        block_on(store.list(""))
            .unwrap_or_default()
            .into_iter()
            .map(|o| o.key)
            .collect()
    }

    fn path(&self, rel: &str) -> PathBuf {
        self.work.path().join(rel)
    }

    fn hotstart(&self) -> Command {
        let mut c = Command::new(env!("CARGO_BIN_EXE_hotstart"));
        c.envs(self.aws.iter().map(|(k, v)| (k, v)))
            .env("HOTSTART_CACHE_DIR", &self.cache)
            .env("HOTSTART_ENV_PYTHON", python());
        c
    }

    /// `hotstart env ensure --json` with these arguments before `--` and `install` after it.
    fn ensure_cmd(&self, target: &Path, lock: &Path, extra: &[&str], install: &[&str]) -> Command {
        let mut c = self.hotstart();
        c.args(["env", "ensure", "--json", "--store", &self.store, "--lock"])
            .arg(lock)
            .arg("--target")
            .arg(target)
            .args(extra)
            .arg("--")
            .args(install);
        c
    }

    /// Runs ensure, asserts success, returns its JSON outcome.
    fn ensure(&self, target: &Path, lock: &Path, extra: &[&str], install: &[&str]) -> Value {
        let out = self
            .ensure_cmd(target, lock, extra, install)
            .output()
            .unwrap();
        outcome(&out)
    }
}

fn block_on<F: std::future::Future>(f: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
        .block_on(f)
}

fn outcome(out: &Output) -> Value {
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "ensure failed ({}):\n{stdout}\n{stderr}",
        out.status
    );
    let line = stdout
        .lines()
        .rev()
        .find(|l| l.starts_with('{'))
        .unwrap_or_else(|| panic!("no JSON outcome in:\n{stdout}\n{stderr}"));
    serde_json::from_str(line).unwrap()
}

/// A requirements file in `dir`.
fn lock_file(dir: &Path, name: &str, body: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, body).unwrap();
    p
}

/// The install command of a venv with the packages of `lock` from the wheelhouse. It names the
/// target only through $HOTSTART_ENV_TARGET, so it is the same command for every target.
fn venv_install(lock: &Path) -> Vec<String> {
    let script = format!(
        "'{py}' -m venv --without-pip \"$HOTSTART_ENV_TARGET\" && \
         '{py}' -m pip --disable-pip-version-check --python \"$HOTSTART_ENV_TARGET/bin/python\" \
         install -q --no-index --find-links '{wh}' -r '{lock}'",
        py = python().display(),
        wh = wheelhouse().display(),
        lock = lock.display()
    );
    vec!["sh".into(), "-c".into(), script]
}

fn strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Node {
    Dir {
        mode: u32,
        mtime: (i64, i64),
    },
    File {
        mode: u32,
        mtime: (i64, i64),
        hash: ChunkId,
        /// The bytes, kept only for files that name the path being compared away.
        bytes: Option<Vec<u8>>,
    },
    Symlink {
        target: String,
        mtime: (i64, i64),
    },
}

/// Every entry under `root`: kind, mode, mtime, content hash, symlink target. Files that contain
/// `needle` keep their bytes.
fn listing(root: &Path, needle: &str) -> BTreeMap<String, Node> {
    fn go(root: &Path, dir: &Path, needle: &[u8], out: &mut BTreeMap<String, Node>) {
        for e in std::fs::read_dir(dir).unwrap() {
            let p = e.unwrap().path();
            let rel = p.strip_prefix(root).unwrap().to_string_lossy().into_owned();
            let m = std::fs::symlink_metadata(&p).unwrap();
            let mtime = (m.mtime(), m.mtime_nsec());
            let node = if m.file_type().is_symlink() {
                let target = std::fs::read_link(&p).unwrap();
                Node::Symlink {
                    target: target.to_string_lossy().into_owned(),
                    mtime,
                }
            } else if m.is_dir() {
                go(root, &p, needle, out);
                Node::Dir {
                    mode: m.mode() & 0o7777,
                    mtime,
                }
            } else {
                let data = std::fs::read(&p).unwrap();
                let names = data.windows(needle.len()).any(|w| w == needle);
                Node::File {
                    mode: m.mode() & 0o7777,
                    mtime,
                    hash: ChunkId::of(&data),
                    bytes: names.then_some(data),
                }
            };
            out.insert(rel, node);
        }
    }
    let mut out = BTreeMap::new();
    go(root, root, needle.as_bytes(), &mut out);
    out
}

fn assert_same_entries(a: &BTreeMap<String, Node>, b: &BTreeMap<String, Node>) {
    let ka: Vec<_> = a.keys().collect();
    let kb: Vec<_> = b.keys().collect();
    assert_eq!(ka, kb, "entry lists differ");
}

/// Asserts `restored` equals `original` entry for entry (bytes, modes, mtimes, symlinks).
fn assert_identical(original: &BTreeMap<String, Node>, restored: &BTreeMap<String, Node>) {
    assert_same_entries(original, restored);
    for (k, v) in original {
        let mut w = restored[k].clone();
        if let (Node::File { bytes: b1, .. }, Node::File { bytes: b2, .. }) = (v, &mut w) {
            *b2 = b1.clone(); // both hashed; the kept bytes are only for relocation checks
        }
        assert!(v == &w, "{k} differs:\n  {v:?}\n  {w:?}");
    }
}

/// Runs `python -c code` from a venv and returns its stdout.
fn run_python(venv: &Path, code: &str) -> String {
    let out = Command::new(venv.join("bin/python"))
        .args(["-c", code])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}/bin/python -c {code:?}: {}",
        venv.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

const IMPORT_NUMPY: &str = "import sys, numpy, tqdm; print(sys.prefix); print(numpy.__file__); print(numpy.arange(10).sum())";

/// The whole test wheelhouse (numpy and friends): its lock file and install command.
fn numpy_venv(f: &Fixture) -> (PathBuf, Vec<String>) {
    let lock = lock_file(
        f.work.path(),
        "requirements.txt",
        &std::fs::read_to_string(root().join("scripts/wheelhouse-test.txt")).unwrap(),
    );
    let install = venv_install(&lock);
    (lock, install)
}

/// Capture a numpy venv, delete it, restore it at the same path and at another path.
fn a_numpy_venv_round_trips_at_the_same_and_another_path(f: &Fixture) {
    let (lock, install) = numpy_venv(f);
    let a = f.path("jobs/a/venv");
    let a_str = a.display().to_string();
    let reloc = ["--relocatable"];

    let first = f.ensure(&a, &lock, &reloc, &strs(&install));
    assert_eq!(first["action"], "installed", "{first}");
    assert_eq!(first["published"], true, "{first}");
    let key = first["key"].as_str().unwrap().to_string();
    let original = listing(&a, &a_str);
    assert!(
        original.len() > 1000,
        "a real numpy venv: {}",
        original.len()
    );

    // Same path: identical, and numpy works.
    std::fs::remove_dir_all(&a).unwrap();
    let restored = f.ensure(&a, &lock, &reloc, &strs(&install));
    assert_eq!(restored["action"], "restored", "{restored}");
    assert_eq!(restored["key"], key.as_str());
    assert!(restored.get("relocated").is_none(), "{restored}");
    assert!(
        restored["linked"].as_u64().unwrap() > 100,
        "small files are hard-linked from the chunk cache: {restored}"
    );
    assert_identical(&original, &listing(&a, &a_str));
    let out = run_python(&a, IMPORT_NUMPY);
    assert!(out.starts_with(&format!("{a_str}\n{a_str}/lib/")), "{out}");
    assert!(out.ends_with("\n45"), "{out}");

    // Again: nothing to do.
    let again = f.ensure(&a, &lock, &reloc, &strs(&install));
    assert_eq!(again["action"], "present", "{again}");

    // Another path: relocated.
    let b = f.path("elsewhere/b/venv");
    let b_str = b.display().to_string();
    let moved = f.ensure(&b, &lock, &reloc, &strs(&install));
    assert_eq!(moved["action"], "restored", "{moved}");
    let rewritten: Vec<String> =
        serde_json::from_value(moved["relocated"]["rewritten"].clone()).unwrap();
    for must in ["pyvenv.cfg", "bin/activate", "bin/tqdm", "bin/f2py"] {
        assert!(
            rewritten.iter().any(|r| r == must),
            "{must} not rewritten: {rewritten:?}"
        );
    }
    let relocated = listing(&b, &a_str);
    assert_same_entries(&original, &relocated);
    for (k, v) in &original {
        let got = &relocated[k];
        if rewritten.contains(k) {
            let (
                Node::File {
                    mode: m1,
                    mtime: t1,
                    bytes: Some(old),
                    ..
                },
                Node::File {
                    mode: m2,
                    mtime: t2,
                    hash,
                    ..
                },
            ) = (v, got)
            else {
                panic!("{k}: rewritten but {v:?} / {got:?}");
            };
            let want = String::from_utf8(old.clone())
                .unwrap()
                .replace(&a_str, &b_str);
            assert_eq!(*hash, ChunkId::of(want.as_bytes()), "{k}: content");
            assert_eq!((m1, t1), (m2, t2), "{k}: mode and mtime kept");
        } else {
            let mut w = got.clone();
            if let (Node::File { bytes: b1, .. }, Node::File { bytes: b2, .. }) = (v, &mut w) {
                *b2 = b1.clone();
            }
            assert!(v == &w, "{k} differs:\n  {v:?}\n  {w:?}");
        }
    }
    // No text file at the new place names the old one any more.
    for (k, v) in &relocated {
        if let Node::File {
            bytes: Some(data), ..
        } = v
        {
            assert!(
                data.contains(&0) || k.ends_with(".pyc"),
                "{k} still names {a_str}"
            );
        }
    }
    let out = run_python(&b, IMPORT_NUMPY);
    assert!(out.starts_with(&format!("{b_str}\n{b_str}/lib/")), "{out}");
    // A console script runs through its rewritten shebang.
    let tqdm = Command::new(b.join("bin/tqdm"))
        .arg("--version")
        .output()
        .unwrap();
    assert!(tqdm.status.success(), "{tqdm:?}");
    assert_eq!(String::from_utf8_lossy(&tqdm.stdout).trim(), "4.70.1");
    // The environment at `a` was left as it was.
    assert_identical(&original, &listing(&a, &a_str));
}

/// The smallest real environment: a venv without pip, plus `six` from the wheelhouse.
fn small_venv(f: &Fixture) -> (PathBuf, Vec<String>) {
    let lock = lock_file(f.work.path(), "small.txt", "six==1.17.0\n");
    let install = venv_install(&lock);
    (lock, install)
}

fn key_of(f: &Fixture, args: &[&str]) -> String {
    let out = f
        .hotstart()
        .args(["env", "key"])
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let key = String::from_utf8_lossy(&out.stdout).trim().to_string();
    assert_eq!(key.len(), 64, "{key}");
    key
}

/// Interpreters on this machine, found the way a user would name them.
fn interpreters() -> Vec<PathBuf> {
    let mut out = vec![python(), PathBuf::from("/usr/bin/python3")];
    for minor in 8..=14 {
        if let Ok(p) = which(&format!("python3.{minor}")) {
            out.push(p);
        }
    }
    // pyenv shims exist for versions that are not selected; keep what really runs.
    out.retain(|p| {
        Command::new(p)
            .args(["-c", "pass"])
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    });
    out
}

fn which(name: &str) -> Result<PathBuf, ()> {
    let path = std::env::var_os("PATH").ok_or(())?;
    std::env::split_paths(&path)
        .map(|d| d.join(name))
        .find(|p| p.is_file())
        .ok_or(())
}

#[test]
fn the_key_changes_with_every_input_and_only_then() {
    let f = Fixture::local();
    let lock = lock_file(f.work.path(), "requirements.txt", "numpy==2.4.6\n");
    let py = python().display().to_string();
    let base = |target: &str, cmd: &str| {
        vec![
            "--lock".to_string(),
            lock.display().to_string(),
            "--python".into(),
            py.clone(),
            "--target".into(),
            target.to_string(),
            "--".into(),
            "sh".into(),
            "-c".into(),
            cmd.to_string(),
        ]
    };
    let k = key_of(&f, &strs(&base("/opt/venv", "pip install")));
    assert_eq!(
        k,
        key_of(&f, &strs(&base("/opt/venv", "pip install"))),
        "same inputs, same key"
    );
    // The same bytes under another name and place: the same key.
    let copy = f.path("elsewhere/reqs.txt");
    std::fs::create_dir_all(copy.parent().unwrap()).unwrap();
    std::fs::copy(&lock, &copy).unwrap();
    let mut moved = base("/opt/venv", "pip install");
    moved[1] = copy.display().to_string();
    assert_eq!(key_of(&f, &strs(&moved)), k);
    // A relative target means the same absolute path.
    let rel = base("venv", "pip install");
    let cwd_key = {
        let out = f
            .hotstart()
            .current_dir("/opt")
            .args(["env", "key"])
            .args(&rel)
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    };
    assert_eq!(cwd_key, k, "venv relative to /opt is /opt/venv");

    let mut keys = std::collections::HashSet::from([k.clone()]);
    let mut differs = |what: &str, args: Vec<String>| {
        let key = key_of(&f, &strs(&args));
        assert!(keys.insert(key), "{what} did not change the key");
    };
    differs("target", base("/opt/venv2", "pip install"));
    differs("command", base("/opt/venv", "pip install -q"));
    std::fs::write(&lock, "numpy==2.4.5\n").unwrap();
    differs("lock bytes", base("/opt/venv", "pip install"));
    std::fs::write(&lock, "numpy==2.4.6\n").unwrap();
    let mut reloc = base("/opt/venv", "pip install");
    reloc.insert(0, "--relocatable".into());
    differs("relocatable", reloc.clone());
    // Relocatable keys ignore the target.
    let mut reloc2 = base("/elsewhere", "pip install");
    reloc2.insert(0, "--relocatable".into());
    assert_eq!(key_of(&f, &strs(&reloc)), key_of(&f, &strs(&reloc2)));

    // Another interpreter (version or installation): another key.
    let mut by_python = BTreeMap::new();
    for p in interpreters() {
        let mut args = base("/opt/venv", "pip install");
        args[3] = p.display().to_string();
        by_python.insert(key_of(&f, &strs(&args)), p);
    }
    assert!(
        by_python.len() >= 2,
        "need two distinct Python interpreters to test this (found {:?}); scripts/setup.sh \
         makes .venv from python3 on PATH and Debian's python3 is /usr/bin/python3",
        interpreters()
    );

    // A missing lock file or interpreter is a clear error.
    let out = f
        .hotstart()
        .args(["env", "key", "--lock", "/nonexistent/req.txt"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("/nonexistent/req.txt"),
        "{out:?}"
    );
    let out = f
        .hotstart()
        .args(["env", "key", "--python", "/nonexistent/python"])
        .arg("--lock")
        .arg(&lock)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("/nonexistent/python"),
        "{err}"
    );
}

/// Files and directories beside `target` whose names show they are a restore's leftovers.
fn leftovers(target: &Path) -> Vec<String> {
    let name = target.file_name().unwrap().to_string_lossy().into_owned();
    std::fs::read_dir(target.parent().unwrap())
        .map(|d| {
            d.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with(&format!(".{name}.hotstart-")))
                .collect()
        })
        .unwrap_or_default()
}

/// Flips a bit in the stored chunk of `six.py` of the venv at `venv` (one chunk: the file is
/// under 1 MiB), and in its copy in every snapshot's pack (laid out as `hotstart_env::pack`
/// says); returns the chunk's id.
fn damage_six_py(f: &Fixture, venv: &Path) -> ChunkId {
    let six_py = walk_files(venv)
        .into_iter()
        .find(|p| p.ends_with("site-packages/six.py"))
        .expect("six.py in the venv");
    let id = ChunkId::of(&std::fs::read(six_py).unwrap());
    let store = f.open_store();
    let flip = |object: &str, at: usize| {
        let mut data = block_on(store.get(object)).unwrap().to_vec();
        data[at] ^= 0x40;
        block_on(store.put(object, data.into())).unwrap();
    };
    let object = format!("envs/{}", id.key());
    let len = block_on(store.get(&object)).unwrap().len();
    flip(&object, len / 2);
    let packs = f
        .stored_objects()
        .into_iter()
        .filter(|k| k.contains("/pack-"));
    for pack in packs {
        let data = block_on(store.get(&pack)).unwrap();
        let count = u32::from_le_bytes(data[8..12].try_into().unwrap()) as usize;
        let mut offset = 12 + 36 * count;
        for entry in data[12..12 + 36 * count].chunks_exact(36) {
            let len = u32::from_le_bytes(entry[32..].try_into().unwrap()) as usize;
            if entry[..32] == id.0 {
                flip(&pack, offset + len / 2);
            }
            offset += len;
        }
    }
    id
}

/// A published venv (six) whose stored chunk of `six.py` is then damaged: the restore fails
/// naming the chunk, and nothing is left at the target. The damaged copy and the snapshot's
/// record are deleted, so the next ensure installs and publishes anew, uploading the chunk
/// again instead of reusing the damaged copy, and the ensure after it restores.
fn a_corrupt_chunk_fails_the_restore_and_leaves_no_directory(f: &Fixture) {
    let (lock, install) = small_venv(f);
    let target = f.path("venv");
    let first = f.ensure(&target, &lock, &[], &strs(&install));
    assert_eq!(first["published"], true, "{first}");
    let id = damage_six_py(f, &target);

    std::fs::remove_dir_all(&target).unwrap();
    let out = f
        .ensure_cmd(&target, &lock, &[], &strs(&install))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains(&format!("corrupt chunk {id}")), "{err}");
    assert!(err.contains("restoring snapshot"), "{err}");
    assert!(!target.exists(), "no directory at the target");
    assert!(leftovers(&target).is_empty(), "{:?}", leftovers(&target));
    // The install command did not run instead: the damage is reported, not papered over.
    assert!(!String::from_utf8_lossy(&out.stdout).contains("installed"));
    assert!(
        err.contains("was damaged and is deleted")
            && err.contains("installs and publishes it anew"),
        "{err}"
    );
    let store = f.open_store();
    let object = format!("envs/{}", id.key());
    assert!(block_on(store.get(&object)).unwrap_err().is_not_found());

    let again = f.ensure(&target, &lock, &[], &strs(&install));
    assert_eq!(again["published"], true, "{again}");
    let stored = block_on(store.get(&object)).unwrap();
    let six_py = walk_files(&target)
        .into_iter()
        .find(|p| p.ends_with("site-packages/six.py"))
        .unwrap();
    let six_py = std::fs::read(six_py).unwrap();
    assert_eq!(decode_frame(&id, &stored, 64 << 20).unwrap(), six_py);
    std::fs::remove_dir_all(&target).unwrap();
    let restored = f.ensure(&target, &lock, &[], &strs(&install));
    assert_eq!(restored["action"], "restored", "{restored}");
}

/// Install commands that fail (pip itself, a script's exit code, a signal, a missing program)
/// publish nothing, remove what they left, and hand back their exit code.
fn a_failing_install_publishes_nothing_and_returns_its_exit_code(f: &Fixture) {
    let target = f.path("venv");
    // Real pip, asked for a package the wheelhouse does not have.
    let lock = lock_file(
        f.work.path(),
        "missing.txt",
        "six==1.17.0\nno-such-package==1.0\n",
    );
    let out = f
        .ensure_cmd(&target, &lock, &[], &strs(&venv_install(&lock)))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "pip's exit code: {err}");
    assert!(
        err.contains("no-such-package"),
        "pip's output is streamed: {err}"
    );
    assert!(
        err.contains("failed with exit code 1; nothing was published"),
        "{err}"
    );
    assert!(!target.exists(), "the venv pip left is removed");
    assert_eq!(
        f.stored_objects(),
        Vec::<String>::new(),
        "nothing published"
    );

    // A code no hotstart failure uses, so it can only be the command's.
    let failing = [
        "sh",
        "-c",
        "mkdir -p \"$HOTSTART_ENV_TARGET\" && echo half > \"$HOTSTART_ENV_TARGET/x\" && \
         echo 'installer says no' >&2 && exit 7",
    ];
    let out = f
        .ensure_cmd(&target, &lock, &[], &failing)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(7), "{err}");
    assert!(err.contains("installer says no"), "{err}");
    assert!(err.contains("exit code 7"), "{err}");
    assert!(!target.exists(), "what it left is removed");

    // A signal is reported as 128 + its number.
    let killed = ["sh", "-c", "kill -TERM $$"];
    let out = f.ensure_cmd(&target, &lock, &[], &killed).output().unwrap();
    assert_eq!(out.status.code(), Some(128 + 15));

    // A command that cannot start is a clear error too.
    let out = f
        .ensure_cmd(&target, &lock, &[], &["/nonexistent/installer"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("/nonexistent/installer"));
    assert_eq!(
        f.stored_objects(),
        Vec::<String>::new(),
        "nothing published"
    );

    // Then a pip install that works installs and publishes.
    let (lock, install) = small_venv(f);
    let ok = f.ensure(&target, &lock, &[], &strs(&install));
    assert_eq!(ok["action"], "installed", "{ok}");
    assert_eq!(ok["published"], true, "{ok}");
    assert_eq!(
        run_python(&target, "import six; print(six.__version__)"),
        "1.17.0"
    );
    let key = ok["key"].as_str().unwrap();
    let stored = f.stored_objects();
    assert!(
        stored.contains(&format!("envs/snapshots/{key}/snapshot.json")),
        "{stored:?}"
    );
}

fn walk_files(root: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&d) else {
            continue;
        };
        for e in entries.flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else {
                out.push(p);
            }
        }
    }
    out
}

/// An install command that counts its runs in `counter` and takes a second.
fn counting_install(counter: &Path) -> Vec<String> {
    let script = format!(
        "echo run >> '{}' && sleep 1 && mkdir -p \"$HOTSTART_ENV_TARGET/lib\" && \
         echo 'print(42)' > \"$HOTSTART_ENV_TARGET/lib/app.py\"",
        counter.display()
    );
    vec!["sh".into(), "-c".into(), script]
}

/// The real venv install of `lock` that first counts its run in `counter`, then waits while
/// `hold` exists: a test decides when it goes on, so other ensures start while it is under way.
fn held_install(lock: &Path, counter: &Path, hold: &Path) -> Vec<String> {
    let mut install = venv_install(lock);
    install[2] = format!(
        "echo run >> '{counter}' && while [ -e '{hold}' ]; do sleep 0.05; done && {pip}",
        counter = counter.display(),
        hold = hold.display(),
        pip = install[2]
    );
    install
}

fn runs(counter: &Path) -> usize {
    std::fs::read_to_string(counter)
        .map(|s| s.lines().count())
        .unwrap_or(0)
}

/// Waits (with a generous watchdog, not a timing assumption) until `cond` holds.
fn wait_until(what: &str, cond: impl Fn() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(300);
    while !cond() {
        assert!(Instant::now() < deadline, "gave up waiting until {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A running `hotstart env ensure --json` (logging at info), its stderr read as it comes.
struct Running {
    child: std::process::Child,
    lines: std::sync::mpsc::Receiver<String>,
    stderr: String,
}

impl Running {
    fn start(mut cmd: Command) -> Running {
        let mut child = cmd
            .env("HOTSTART_LOG", "info")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stderr = child.stderr.take().unwrap();
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            use std::io::BufRead;
            for line in std::io::BufReader::new(stderr)
                .lines()
                .map_while(Result::ok)
            {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Running {
            child,
            lines,
            stderr: String::new(),
        }
    }

    /// Waits until it has written a line containing `what` to stderr.
    fn wait_for(&mut self, what: &str) {
        let deadline = Instant::now() + Duration::from_secs(300);
        while !self.stderr.contains(what) {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok(line) => {
                    self.stderr.push_str(&line);
                    self.stderr.push('\n');
                }
                Err(e) => panic!("{e}: no {what:?} in its stderr:\n{}", self.stderr),
            }
        }
    }

    /// Waits for it to exit; its JSON outcome.
    fn finish(mut self) -> Value {
        let out = self.child.wait_with_output().unwrap();
        // The reader thread ends when the pipe closes.
        self.stderr.extend(self.lines.iter().map(|l| l + "\n"));
        outcome(&Output {
            stderr: self.stderr.into_bytes(),
            ..out
        })
    }
}

/// Two ensures of one key on a node, the second started while the first is installing: it waits
/// on the node lock, then reuses what the first made; pip runs once.
fn concurrent_ensures_of_one_key_install_once(f: &Fixture) {
    let (lock, _) = small_venv(f);
    let counter = f.path("runs");
    let hold = f.path("hold");
    let install = held_install(&lock, &counter, &hold);
    let six = "import six; print(six.__version__)";

    // One target: the second finds the environment in place.
    let target = f.path("venv");
    std::fs::write(&hold, "").unwrap();
    let first = Running::start(f.ensure_cmd(&target, &lock, &[], &strs(&install)));
    wait_until("the first install starts", || runs(&counter) == 1);
    let mut second = Running::start(f.ensure_cmd(&target, &lock, &[], &strs(&install)));
    second.wait_for("waiting for another ensure on this node");
    std::fs::remove_file(&hold).unwrap();
    let (a, b) = (first.finish(), second.finish());
    assert_eq!(
        (&a["action"], &b["action"]),
        (&"installed".into(), &"present".into())
    );
    assert_eq!(runs(&counter), 1, "pip ran once");
    assert_eq!(run_python(&target, six), "1.17.0");

    // A relocatable key at two targets: the second waits on the key, then restores the snapshot
    // the first published.
    let reloc = ["--relocatable"];
    let (t1, t2) = (f.path("r1/venv"), f.path("r2/venv"));
    std::fs::write(&hold, "").unwrap();
    let first = Running::start(f.ensure_cmd(&t1, &lock, &reloc, &strs(&install)));
    wait_until("the first install starts", || runs(&counter) == 2);
    let mut second = Running::start(f.ensure_cmd(&t2, &lock, &reloc, &strs(&install)));
    second.wait_for("waiting for another ensure on this node");
    std::fs::remove_file(&hold).unwrap();
    let (a, b) = (first.finish(), second.finish());
    assert_eq!(
        (&a["action"], &b["action"]),
        (&"installed".into(), &"restored".into())
    );
    assert_eq!(a["key"], b["key"]);
    assert_eq!(
        runs(&counter),
        2,
        "pip ran once more, for the relocatable key"
    );
    for t in [&t1, &t2] {
        assert_eq!(run_python(t, six), "1.17.0");
    }
}

/// Two nodes (separate caches, so no shared node lock) miss one key at once and both install:
/// exactly one snapshot is committed, the loser's tree is removed, and a third node restores.
fn nodes_racing_to_publish_one_key_leave_one_snapshot(f: &Fixture) {
    let (lock, _) = small_venv(f);
    let counter = f.path("runs");
    let hold = f.path("hold");
    let install = held_install(&lock, &counter, &hold);
    let reloc = ["--relocatable"];
    std::fs::write(&hold, "").unwrap();
    let nodes: Vec<Running> = (0..2)
        .map(|i| {
            let mut cmd = f.ensure_cmd(
                &f.path(&format!("node-{i}/venv")),
                &lock,
                &reloc,
                &strs(&install),
            );
            cmd.env("HOTSTART_CACHE_DIR", f.path(&format!("node-{i}/cache")));
            Running::start(cmd)
        })
        .collect();
    wait_until("both nodes missed and started installing", || {
        runs(&counter) == 2
    });
    std::fs::remove_file(&hold).unwrap();
    let outcomes: Vec<Value> = nodes.into_iter().map(Running::finish).collect();
    for o in &outcomes {
        assert_eq!(o["action"], "installed", "{o}");
        assert!(
            o.get("publish_error").is_none(),
            "losing is not an error: {o}"
        );
    }
    let won = outcomes.iter().filter(|o| o["published"] == true).count();
    assert_eq!(
        won, 1,
        "exactly one node's snapshot is committed: {outcomes:?}"
    );

    // One record, one tree and one pack for the key: the loser removed its tree and pack.
    let key = outcomes[0]["key"].as_str().unwrap();
    let mut names: Vec<String> = f
        .stored_objects()
        .into_iter()
        .filter_map(|k| {
            Some(
                k.strip_prefix(&format!("envs/snapshots/{key}/"))?
                    .to_string(),
            )
        })
        .collect();
    names.sort();
    assert_eq!(names.len(), 3, "{names:?}");
    assert!(names[0].starts_with("pack-"), "{names:?}");
    assert_eq!(names[1], "snapshot.json", "{names:?}");
    assert!(names[2].starts_with("tree-"), "{names:?}");

    // A third node restores the committed snapshot; pip does not run again.
    let target = f.path("node-3/venv");
    let third = f
        .ensure_cmd(&target, &lock, &reloc, &strs(&install))
        .env("HOTSTART_CACHE_DIR", f.path("node-3/cache"))
        .output()
        .unwrap();
    assert_eq!(outcome(&third)["action"], "restored");
    assert_eq!(runs(&counter), 2);
    assert_eq!(
        run_python(&target, "import six; print(six.__version__)"),
        "1.17.0"
    );
}

#[test]
fn a_killed_install_is_redone_and_foreign_directories_are_left_alone() {
    let f = Fixture::local();
    let lock = lock_file(f.work.path(), "requirements.txt", "app==3\n");
    let target = f.path("venv");
    let hold = f.path("hold");
    std::fs::write(&hold, "").unwrap();
    let script = format!(
        "mkdir -p \"$HOTSTART_ENV_TARGET\" && echo half > \"$HOTSTART_ENV_TARGET/half\" && \
         while [ -e '{hold}' ]; do sleep 0.1; done && echo done > \"$HOTSTART_ENV_TARGET/done\"",
        hold = hold.display()
    );
    let install = ["sh", "-c", script.as_str()];
    let mut child = f
        .ensure_cmd(&target, &lock, &[], &install)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .process_group(0)
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    while !target.join("half").exists() {
        assert!(Instant::now() < deadline, "the installer never started");
        std::thread::sleep(Duration::from_millis(20));
    }
    // kill -9 the whole process group: ensure and its installer.
    // SAFETY: kill(2) with a process group id we created; no memory is involved.
    let rc = unsafe { libc::kill(-(child.id() as i32), libc::SIGKILL) };
    assert_eq!(rc, 0);
    child.wait().unwrap();
    assert!(target.join("half").exists() && !target.join("done").exists());

    // The next ensure knows the half-installed directory is its own, removes it, installs again.
    std::fs::remove_file(&hold).unwrap();
    let ok = f.ensure(&target, &lock, &[], &install);
    assert_eq!(ok["action"], "installed", "{ok}");
    assert!(target.join("done").exists());

    // A directory this node did not make is never touched.
    let foreign = f.path("foreign");
    std::fs::create_dir(&foreign).unwrap();
    std::fs::write(foreign.join("mine"), "precious").unwrap();
    let out = f
        .ensure_cmd(&foreign, &lock, &[], &install)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("was not created by `hotstart env ensure`"),
        "{err}"
    );
    assert_eq!(
        std::fs::read_to_string(foreign.join("mine")).unwrap(),
        "precious"
    );
}

#[test]
fn restores_copy_across_file_systems_and_replace_an_outdated_environment() {
    let f = Fixture::local();
    let (lock, install) = small_venv(&f);
    let here = f.path("venv");
    let first = f.ensure(&here, &lock, &["--relocatable"], &strs(&install));
    assert_eq!(first["action"], "installed");
    let here_str = here.display().to_string();
    let original = listing(&here, &here_str);

    // tmpfs is another file system than the chunk cache: every file is written, none linked.
    let shm = tempfile::tempdir_in("/dev/shm").unwrap();
    let there = shm.path().join("venv");
    let restored = f.ensure(&there, &lock, &["--relocatable"], &strs(&install));
    assert_eq!(restored["action"], "restored");
    assert_eq!(restored["linked"], 0, "{restored}");
    assert!(restored["files"].as_u64().unwrap() > 10);
    let out = run_python(&there, "import six; print(six.__version__)");
    assert_eq!(out, "1.17.0");
    for (path, node) in listing(&there, &here_str) {
        if let Node::File { .. } = node {
            let m = std::fs::metadata(there.join(&path)).unwrap();
            assert_eq!(m.nlink(), 1, "{path} is a copy");
        }
    }

    // The requirements change: the environment this node made is replaced, in one step.
    std::fs::write(&lock, "six==1.17.0\nidna==3.20\n").unwrap();
    // Held open so that its inode number cannot be reused by the replacement.
    let old_dir = std::fs::File::open(&here).unwrap();
    let inode_before = old_dir.metadata().unwrap().ino();
    let updated = f.ensure(&here, &lock, &["--relocatable"], &strs(&install));
    assert_eq!(updated["action"], "installed", "{updated}");
    assert_ne!(updated["key"], first["key"]);
    assert_eq!(
        run_python(&here, "import idna, six; print(idna.__version__)"),
        "3.20"
    );
    assert_ne!(std::fs::metadata(&here).unwrap().ino(), inode_before);
    // Back to the first requirements: a hit, swapped in over the newer environment.
    std::fs::write(&lock, "six==1.17.0\n").unwrap();
    let back = f.ensure(&here, &lock, &["--relocatable"], &strs(&install));
    assert_eq!(back["action"], "restored", "{back}");
    assert_identical(&original, &listing(&here, &here_str));
    assert!(leftovers(&here).is_empty(), "{:?}", leftovers(&here));
}

#[test]
fn ls_and_gc_through_the_command_line() {
    let f = Fixture::local();
    let lock = lock_file(f.work.path(), "requirements.txt", "app==4\n");
    let counter = f.path("runs");
    let install = counting_install(&counter);
    let one = f.ensure(&f.path("one"), &lock, &[], &strs(&install));
    let two = f.ensure(&f.path("two"), &lock, &[], &strs(&install));
    let (k1, k2) = (one["key"].as_str().unwrap(), two["key"].as_str().unwrap());

    let ls = f
        .hotstart()
        .args(["env", "ls", "--store", &f.store])
        .output()
        .unwrap();
    let table = String::from_utf8_lossy(&ls.stdout);
    assert!(ls.status.success(), "{ls:?}");
    assert!(
        table.contains(&k1[..16]) && table.contains(&k2[..16]),
        "{table}"
    );
    assert!(
        table.contains(&f.path("one").display().to_string()),
        "{table}"
    );
    assert!(
        String::from_utf8_lossy(&ls.stderr).contains("2 snapshots"),
        "{ls:?}"
    );

    let gc = f
        .hotstart()
        .args([
            "env", "gc", "--store", &f.store, "--grace", "0s", "--key", k1,
        ])
        .output()
        .unwrap();
    let report = String::from_utf8_lossy(&gc.stdout);
    assert!(gc.status.success(), "{gc:?}");
    assert!(
        report.contains(&format!("deleted snapshot {k1}")),
        "{report}"
    );
    assert!(report.contains("kept 1 snapshots"), "{report}");
    let ls = f
        .hotstart()
        .args(["env", "ls", "--json", "--store", &f.store])
        .output()
        .unwrap();
    let lines: Vec<Value> = String::from_utf8_lossy(&ls.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 1);
    assert_eq!(lines[0]["key"], k2);

    let bad = f
        .hotstart()
        .args(["env", "gc", "--store", &f.store, "--key", "xyz"])
        .output()
        .unwrap();
    assert!(!bad.status.success());
    assert!(String::from_utf8_lossy(&bad.stderr).contains("not a snapshot key"));

    // A well-formed key that no snapshot has (here: the one just deleted) is an error too.
    let gone = f
        .hotstart()
        .args(["env", "gc", "--store", &f.store, "--key", k1])
        .output()
        .unwrap();
    assert_eq!(gone.status.code(), Some(1), "{gone:?}");
    let err = String::from_utf8_lossy(&gone.stderr);
    assert!(
        err.contains(&format!("no snapshot has the key {k1}")),
        "{err}"
    );
}

/// Whether `path` is a mountpoint right now.
fn is_mounted(path: &Path) -> bool {
    let want = path.display().to_string();
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .any(|l| l.split(' ').nth(4) == Some(want.as_str()))
}

/// A running `hotstart env ensure --lazy --json`. Dropped without [`LazyRun::stop`] (a failed
/// assertion), it is stopped with SIGTERM and its mount removed, so nothing stays mounted.
struct LazyRun {
    run: Option<Running>,
    target: PathBuf,
}

impl LazyRun {
    /// Starts `ensure --lazy` with the node cache `cache` and waits until it serves the mount.
    fn start(
        f: &Fixture,
        target: &Path,
        lock: &Path,
        extra: &[&str],
        install: &[String],
        cache: &str,
    ) -> LazyRun {
        let mut args = vec!["--lazy"];
        args.extend_from_slice(extra);
        let mut cmd = f.ensure_cmd(target, lock, &args, &strs(install));
        cmd.env("HOTSTART_CACHE_DIR", f.path(cache));
        let mut run = LazyRun {
            run: Some(Running::start(cmd)),
            target: target.to_path_buf(),
        };
        run.wait_for("Ctrl-C or SIGTERM unmounts");
        assert!(
            is_mounted(target),
            "{} is not a mountpoint",
            target.display()
        );
        run
    }

    fn wait_for(&mut self, what: &str) {
        self.run.as_mut().unwrap().wait_for(what);
    }

    /// Waits until the profile was prefetched (or found empty).
    fn wait_prefetched(&mut self) -> bool {
        let run = self.run.as_mut().unwrap();
        let deadline = Instant::now() + Duration::from_secs(300);
        loop {
            if run.stderr.contains("prefetched the profile") {
                return true;
            }
            if run.stderr.contains("no profile yet") {
                return false;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            match run.lines.recv_timeout(left) {
                Ok(line) => run.stderr.push_str(&(line + "\n")),
                Err(e) => panic!("{e}: never prefetched:\n{}", run.stderr),
            }
        }
    }

    /// SIGTERM, as a job's end would send it; the JSON outcome printed after unmounting.
    fn stop(mut self) -> Value {
        let run = self.run.take().unwrap();
        // SAFETY: kill(2) on our own child's pid; no memory is involved.
        unsafe { libc::kill(run.child.id() as i32, libc::SIGTERM) };
        let out = run.finish();
        assert!(!is_mounted(&self.target), "still mounted after SIGTERM");
        out
    }
}

impl Drop for LazyRun {
    fn drop(&mut self) {
        if let Some(mut run) = self.run.take() {
            // SAFETY: as in `stop`.
            unsafe { libc::kill(run.child.id() as i32, libc::SIGTERM) };
            let _ = run.child.wait();
        }
        if is_mounted(&self.target) {
            let _ = Command::new("fusermount3")
                .arg("-uz")
                .arg(&self.target)
                .status();
        }
    }
}

/// A numpy venv published by one node and mounted lazily at its path by two others: numpy
/// imports from the mount, the second start prefetches exactly the chunks the first read, and
/// the mount shows every file as it was installed.
fn a_lazy_mount_serves_a_numpy_venv_and_replays_its_profile(f: &Fixture) {
    let (lock, install) = numpy_venv(f);
    let venv = f.path("venv");
    let venv_str = venv.display().to_string();
    let first = f.ensure(&venv, &lock, &[], &strs(&install));
    assert_eq!(first["published"], true, "{first}");
    let original = listing(&venv, &venv_str);
    std::fs::remove_dir_all(&venv).unwrap();

    // Another node, no profile yet: numpy imports from the mount; the reads become the profile.
    let mut one = LazyRun::start(f, &venv, &lock, &[], &install, "node-b");
    assert!(!one.wait_prefetched(), "no profile before the first start");
    let out = run_python(&venv, IMPORT_NUMPY);
    assert!(
        out.starts_with(&format!("{venv_str}\n{venv_str}/lib/")),
        "{out}"
    );
    assert!(out.ends_with("\n45"), "{out}");
    let r1 = one.stop();
    assert_eq!(r1["action"], "mounted", "{r1}");
    assert_eq!(r1["key"], first["key"]);
    assert!(
        !venv.exists(),
        "the mountpoint ensure made is removed again"
    );
    let read1 = r1["mount"]["chunks_read"].as_u64().unwrap();
    assert!(read1 > 0, "{r1}");
    assert_eq!(r1["mount"]["planned_chunks"], 0, "{r1}");
    assert!(
        r1["mount"]["chunk_bytes_read"].as_u64().unwrap() < r1["bytes"].as_u64().unwrap(),
        "importing numpy reads part of the environment: {r1}"
    );

    // A third node: the profile in the store is replayed, exactly the chunks the first start
    // read, and the same import finds them local.
    let mut two = LazyRun::start(f, &venv, &lock, &[], &install, "node-c");
    assert!(two.wait_prefetched(), "the second start prefetches");
    assert_eq!(run_python(&venv, IMPORT_NUMPY), out);
    let r2 = two.stop();
    let m = &r2["mount"];
    assert_eq!(m["planned_chunks"].as_u64().unwrap(), read1, "{r2}");
    assert_eq!(m["prefetched_chunks"], m["planned_chunks"], "{r2}");
    assert!(m["hit_rate"].as_f64().unwrap() >= 0.9, "{r2}");
    // Prefetched pages went into the page cache ahead of the import, and the files it used
    // still count as read: the profile does not shrink because their reads never reached
    // the mount.
    assert!(m["warmed_files"].as_u64().unwrap() > 0, "{r2}");
    let read2 = m["chunks_read"].as_u64().unwrap();
    assert!(
        read2 * 10 >= read1 * 9,
        "{read2} chunks read, {read1} before: {r2}"
    );
    // From a remote store the planned chunks come from the snapshot's pack, several to a GET
    // (the pack holds every chunk; the node's cache holds none); a local directory is read
    // chunk by chunk.
    let packed = r2["packed_chunks"].as_u64().unwrap();
    if f.client.is_empty() {
        assert_eq!(packed, 0, "{r2}");
    } else {
        assert_eq!(packed, read1, "{r2}");
        let gets = r2["pack_requests"].as_u64().unwrap();
        assert!(
            gets > 1 && gets < read1 / 2,
            "{gets} GETs for {read1} chunks: {r2}"
        );
    }

    // The mount is the environment, file for file: bytes, modes, mtimes, symlinks.
    let three = LazyRun::start(f, &venv, &lock, &[], &install, "node-c");
    assert_identical(&original, &listing(&venv, &venv_str));
    three.stop();
}

/// A damaged chunk of a lazily mounted snapshot: reading its file fails with EIO (never wrong
/// bytes), and the rest of the environment reads fine.
fn a_corrupt_chunk_reads_as_eio_from_a_lazy_mount(f: &Fixture) {
    let (lock, install) = small_venv(f);
    let venv = f.path("venv");
    let first = f.ensure(&venv, &lock, &[], &strs(&install));
    assert_eq!(first["published"], true, "{first}");
    let cfg = std::fs::read(venv.join("pyvenv.cfg")).unwrap();
    let six_py = walk_files(&venv)
        .into_iter()
        .find(|p| p.ends_with("site-packages/six.py"))
        .unwrap();
    damage_six_py(f, &venv);
    std::fs::remove_dir_all(&venv).unwrap();

    let run = LazyRun::start(f, &venv, &lock, &[], &install, "node-b");
    assert_eq!(std::fs::read(venv.join("pyvenv.cfg")).unwrap(), cfg);
    let err = std::fs::read(&six_py).expect_err("a corrupt chunk must not read");
    assert_eq!(err.raw_os_error(), Some(libc::EIO), "{err}");
    // Again, from the cache of the failed fetch, if any: still an error.
    let err = std::fs::read(&six_py).expect_err("a corrupt chunk must not read");
    assert_eq!(err.raw_os_error(), Some(libc::EIO), "{err}");
    let r = run.stop();
    assert_eq!(r["action"], "mounted", "{r}");
}

/// What `--lazy` accepts as its target and what it refuses, with clear errors.
#[test]
fn lazy_targets_are_checked_like_eager_ones() {
    let f = Fixture::local();
    let (lock, install) = small_venv(&f);
    let six = "import six; print(six.__version__)";

    // A miss installs a real directory and exits; a second --lazy finds it in place.
    let venv = f.path("venv");
    let out = f
        .ensure_cmd(&venv, &lock, &["--lazy"], &strs(&install))
        .output()
        .unwrap();
    assert_eq!(outcome(&out)["action"], "installed");
    assert!(String::from_utf8_lossy(&out.stderr).contains("nothing is mounted"));
    assert!(!is_mounted(&venv));
    let again = f.ensure(&venv, &lock, &["--lazy"], &strs(&install));
    assert_eq!(again["action"], "present", "{again}");

    // An environment of other inputs that this node made is replaced by the mount, as an eager
    // restore replaces it; a second --lazy of the mounted target is refused, and leaves the
    // mount alone.
    let other = lock_file(f.work.path(), "other.txt", "six==1.17.0\n# another lock\n");
    let replaced = f.ensure(&venv, &other, &[], &strs(&venv_install(&other)));
    assert_eq!(replaced["action"], "installed", "{replaced}");
    let run = LazyRun::start(&f, &venv, &lock, &[], &install, "node-a");
    assert_eq!(run_python(&venv, six), "1.17.0");
    let out = f
        .ensure_cmd(&venv, &lock, &["--lazy"], &strs(&install))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("was not created by `hotstart env ensure`"),
        "{err}"
    );
    assert_eq!(run_python(&venv, six), "1.17.0");
    run.stop();
    assert!(!venv.exists());

    // An empty directory is mounted on and left in place.
    std::fs::create_dir(&venv).unwrap();
    let run = LazyRun::start(&f, &venv, &lock, &[], &install, "node-a");
    assert_eq!(run_python(&venv, six), "1.17.0");
    run.stop();
    assert!(std::fs::read_dir(&venv).unwrap().next().is_none());

    // A directory with something in it is not.
    std::fs::write(venv.join("mine"), "precious").unwrap();
    let out = f
        .ensure_cmd(&venv, &lock, &["--lazy"], &strs(&install))
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("was not created by"));
    assert_eq!(
        std::fs::read_to_string(venv.join("mine")).unwrap(),
        "precious"
    );

    // A relocatable venv names its path: mounted elsewhere it is refused, not served broken.
    let reloc = ["--relocatable"];
    let here = f.path("r1/venv");
    let installed = f.ensure(&here, &lock, &reloc, &strs(&install));
    assert_eq!(installed["published"], true, "{installed}");
    let there = f.path("r2/venv");
    let out = f
        .ensure_cmd(&there, &lock, &["--lazy", "--relocatable"], &strs(&install))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("a lazy mount cannot rewrite them") && err.contains("r1/venv"),
        "{err}"
    );
    assert!(!there.exists(), "nothing is left at the refused target");
    // At the path it was captured at, it mounts.
    std::fs::remove_dir_all(&here).unwrap();
    let run = LazyRun::start(&f, &here, &lock, &reloc, &install, "node-b");
    assert_eq!(run_python(&here, six), "1.17.0");
    run.stop();
}

/// Runs each scenario against both stores: a local directory, and S3 on a real SeaweedFS server
/// (which fails rather than skips when CI is set).
macro_rules! on_both_stores {
    ($($scenario:ident),* $(,)?) => {
        mod local_directory {
            $(
                #[test]
                fn $scenario() {
                    super::$scenario(&super::Fixture::local());
                }
            )*
        }
        mod seaweedfs {
            $(
                #[test]
                fn $scenario() {
                    let bucket = stringify!($scenario).replace('_', "-");
                    let Some(f) = super::Fixture::seaweedfs(&bucket) else {
                        return;
                    };
                    super::$scenario(&f);
                }
            )*
        }
    };
}

on_both_stores!(
    a_numpy_venv_round_trips_at_the_same_and_another_path,
    a_corrupt_chunk_fails_the_restore_and_leaves_no_directory,
    a_failing_install_publishes_nothing_and_returns_its_exit_code,
    concurrent_ensures_of_one_key_install_once,
    nodes_racing_to_publish_one_key_leave_one_snapshot,
    a_lazy_mount_serves_a_numpy_venv_and_replays_its_profile,
    a_corrupt_chunk_reads_as_eio_from_a_lazy_mount,
);
