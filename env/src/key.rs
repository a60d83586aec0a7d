//! The snapshot key: which installed environment a set of inputs produces.
//!
//! The key is blake3 (in derive-key mode, so it can never collide with a chunk id) over, in this
//! order, each length-prefixed:
//!
//! 1. the bytes of every lock or requirements file, in the order given (their names and
//!    locations are not part of the key: the same file checked out anywhere gives the same key);
//! 2. the interpreter: implementation, full version (`3.11.7`, `3.13.0rc1`), ABI (`SOABI`, e.g.
//!    `cpython-311-x86_64-linux-gnu`, and `sys.abiflags`) and the real path of its installation
//!    (`sys.base_prefix`), because a venv points at its base interpreter by path;
//! 3. the platform: OS, CPU architecture, and the C library with its version (`glibc 2.36`), the
//!    things wheels are built against;
//! 4. the install command, argument by argument;
//! 5. the target directory as an absolute, lexically normalised path, unless the snapshot is
//!    *relocatable* (then a marker instead, and a restore elsewhere rewrites the old path; see
//!    [`crate::relocate`]).
//!
//! Same inputs give the same key on any machine; changing any byte of them gives another key.

use std::fmt;
use std::path::{Component, Path, PathBuf};
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// Domain separation for the key hash; bump the version when the encoding changes.
const KEY_CONTEXT: &str = "hotstart 2025 environment snapshot key v1";

/// A snapshot key: 32 bytes, written as 64 lowercase hex digits.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Key(pub [u8; 32]);

impl Key {
    /// 64 lowercase hex digits.
    pub fn to_hex(&self) -> String {
        blake3::Hash::from_bytes(self.0).to_hex().to_string()
    }

    /// The first 16 hex digits, for messages.
    pub fn short(&self) -> String {
        self.to_hex()[..16].to_string()
    }
}

impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.to_hex())
    }
}

impl fmt::Debug for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Key({})", self.short())
    }
}

impl FromStr for Key {
    type Err = Error;
    fn from_str(s: &str) -> Result<Key> {
        blake3::Hash::from_hex(s)
            .map(|h| Key(*h.as_bytes()))
            .map_err(|e| Error::config(format!("{s:?} is not a snapshot key: {e}")))
    }
}

/// What an interpreter says about itself.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PythonInfo {
    /// `sys.implementation.name`, e.g. `cpython`.
    pub implementation: String,
    /// `platform.python_version()`, e.g. `3.11.7`.
    pub version: String,
    /// `sysconfig.get_config_var("SOABI")`, e.g. `cpython-311-x86_64-linux-gnu`.
    pub soabi: String,
    /// `sys.abiflags` (`""`, or `"t"` for free-threaded builds).
    pub abiflags: String,
    /// The real path of `sys.base_prefix`.
    pub base_prefix: String,
}

/// Asked with `-I -S` (no site, so no `.pth` file runs) and without importing `platform`,
/// `sysconfig` or `json`, which took most of the probe's time: `platform.python_version()` is
/// the first word of `sys.version`, and CPython's first extension suffix is `.<SOABI>.so`.
/// `sysconfig` is asked only when that suffix does not look like one (`-S` leaves
/// `sys.base_prefix` as it is: a venv's base is found at startup, not by `site`). Answers are
/// separated by NUL, which no path can hold.
const PROBE: &str = "import os, sys
from importlib.machinery import EXTENSION_SUFFIXES as x
s = x[0] if x else ''
tag = sys.implementation.cache_tag or ''
soabi = s[1:-3] if tag and s.startswith('.' + tag + '-') and s.endswith('.so') else None
if soabi is None:
    import sysconfig
    soabi = sysconfig.get_config_var('SOABI') or ''
sys.stdout.write('\\0'.join([
    sys.implementation.name,
    sys.version.split()[0],
    soabi,
    getattr(sys, 'abiflags', ''),
    os.path.realpath(sys.base_prefix),
]))";

impl PythonInfo {
    /// Runs `python` (a command on `PATH` or a path) in isolated mode and reads its answers.
    pub fn probe(python: &str) -> Result<PythonInfo> {
        let fail = |reason: String| Error::Python {
            python: python.to_string(),
            reason,
        };
        let out = std::process::Command::new(python)
            .args(["-I", "-S", "-c", PROBE])
            .stdin(std::process::Stdio::null())
            .output()
            .map_err(|e| fail(e.to_string()))?;
        if !out.status.success() {
            return Err(fail(format!(
                "exited with {}: {}",
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            )));
        }
        let answer =
            String::from_utf8(out.stdout).map_err(|e| fail(format!("answer is not UTF-8: {e}")))?;
        let fields: Vec<&str> = answer.split('\0').collect();
        let [implementation, version, soabi, abiflags, base_prefix] = fields[..] else {
            return Err(fail(format!("unexpected answer {answer:?}")));
        };
        if implementation.is_empty() || version.is_empty() || base_prefix.is_empty() {
            return Err(fail(format!("unexpected answer {answer:?}")));
        }
        Ok(PythonInfo {
            implementation: implementation.to_string(),
            version: version.to_string(),
            soabi: soabi.to_string(),
            abiflags: abiflags.to_string(),
            base_prefix: base_prefix.to_string(),
        })
    }
}

/// The machine an environment is installed for.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Platform {
    /// `linux`.
    pub os: String,
    /// `x86_64`, `aarch64`, ...
    pub arch: String,
    /// The C library and its version: `glibc 2.36`, or `musl`.
    pub libc: String,
}

impl Platform {
    /// The machine this process runs on.
    pub fn current() -> Platform {
        Platform {
            os: std::env::consts::OS.to_string(),
            arch: std::env::consts::ARCH.to_string(),
            libc: libc_version(),
        }
    }
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn libc_version() -> String {
    // SAFETY: gnu_get_libc_version returns a pointer to a static NUL-terminated string.
    let v = unsafe { std::ffi::CStr::from_ptr(libc::gnu_get_libc_version()) };
    format!("glibc {}", v.to_string_lossy())
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn libc_version() -> String {
    if cfg!(target_env = "musl") {
        "musl".to_string()
    } else {
        std::env::consts::OS.to_string()
    }
}

/// One lock or requirements file as it enters the key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LockInput {
    /// The file's name, for people (not part of the key).
    pub name: String,
    /// Its size in bytes.
    pub bytes: u64,
    /// blake3 of its bytes, hex.
    pub blake3: String,
}

impl LockInput {
    /// Reads a lock file.
    pub fn read(path: &Path) -> Result<LockInput> {
        let data = std::fs::read(path).map_err(|e| Error::io("read lock file", path, e))?;
        Ok(LockInput {
            name: path
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default(),
            bytes: data.len() as u64,
            blake3: blake3::hash(&data).to_hex().to_string(),
        })
    }
}

/// Everything the key is computed from, as recorded in a snapshot (and printed by
/// `hotstart env key --explain`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeyInputs {
    pub locks: Vec<LockInput>,
    pub python: PythonInfo,
    pub platform: Platform,
    pub command: Vec<String>,
    /// The absolute target path, or `None` for a relocatable snapshot.
    pub target: Option<String>,
}

/// What a key is asked for: the files, interpreter, command and target as a user names them.
#[derive(Debug, Clone, Default)]
pub struct KeySpec {
    /// Lock or requirements files; at least one.
    pub locks: Vec<PathBuf>,
    /// The interpreter the environment is for (`python3`, `/usr/bin/python3.12`, ...).
    pub python: String,
    /// The install command.
    pub command: Vec<String>,
    /// The target directory; `None` leaves it out of the key (a relocatable snapshot).
    pub target: Option<PathBuf>,
}

impl KeyInputs {
    /// Reads the lock files and asks the interpreter about itself.
    pub fn gather(spec: &KeySpec) -> Result<KeyInputs> {
        if spec.locks.is_empty() {
            return Err(Error::config("give at least one lock or requirements file"));
        }
        let locks = spec
            .locks
            .iter()
            .map(|p| LockInput::read(p))
            .collect::<Result<Vec<_>>>()?;
        let target = match &spec.target {
            Some(t) => Some(path_string(&absolute(t)?)?),
            None => None,
        };
        Ok(KeyInputs {
            locks,
            python: PythonInfo::probe(&spec.python)?,
            platform: Platform::current(),
            command: spec.command.clone(),
            target,
        })
    }

    /// The key of these inputs.
    pub fn key(&self) -> Key {
        let mut h = blake3::Hasher::new_derive_key(KEY_CONTEXT);
        let mut field = |tag: &str, value: &[u8]| {
            h.update(&(tag.len() as u64).to_le_bytes());
            h.update(tag.as_bytes());
            h.update(&(value.len() as u64).to_le_bytes());
            h.update(value);
        };
        field("locks", &(self.locks.len() as u64).to_le_bytes());
        for lock in &self.locks {
            field("lock", lock.blake3.as_bytes());
        }
        let py = &self.python;
        field("python.implementation", py.implementation.as_bytes());
        field("python.version", py.version.as_bytes());
        field("python.soabi", py.soabi.as_bytes());
        field("python.abiflags", py.abiflags.as_bytes());
        field("python.base_prefix", py.base_prefix.as_bytes());
        field("platform.os", self.platform.os.as_bytes());
        field("platform.arch", self.platform.arch.as_bytes());
        field("platform.libc", self.platform.libc.as_bytes());
        field("command", &(self.command.len() as u64).to_le_bytes());
        for arg in &self.command {
            field("arg", arg.as_bytes());
        }
        match &self.target {
            Some(t) => field("target", t.as_bytes()),
            None => field("relocatable", b""),
        }
        Key(*h.finalize().as_bytes())
    }
}

/// `path` made absolute against the current directory, with `.` and `..` resolved lexically
/// (symlinks are kept: installers write the path they were given).
pub fn absolute(path: &Path) -> Result<PathBuf> {
    let joined = if path.is_absolute() {
        path.to_path_buf()
    } else {
        std::env::current_dir()
            .map_err(|e| Error::io("read current directory", ".", e))?
            .join(path)
    };
    let mut out = PathBuf::from("/");
    for c in joined.components() {
        match c {
            Component::Normal(n) => out.push(n),
            Component::ParentDir => {
                out.pop();
            }
            Component::RootDir | Component::CurDir | Component::Prefix(_) => {}
        }
    }
    if out.parent().is_none() {
        return Err(Error::config(format!(
            "{} names the root directory, not a target",
            path.display()
        )));
    }
    Ok(out)
}

/// A path as UTF-8, or a clear error.
pub(crate) fn path_string(path: &Path) -> Result<String> {
    path.to_str()
        .map(str::to_string)
        .ok_or_else(|| Error::config(format!("{} is not valid UTF-8", path.display())))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inputs() -> KeyInputs {
        KeyInputs {
            locks: vec![LockInput {
                name: "requirements.txt".into(),
                bytes: 12,
                blake3: blake3::hash(b"numpy==2.1.0").to_hex().to_string(),
            }],
            python: PythonInfo {
                implementation: "cpython".into(),
                version: "3.11.7".into(),
                soabi: "cpython-311-x86_64-linux-gnu".into(),
                abiflags: String::new(),
                base_prefix: "/usr".into(),
            },
            platform: Platform {
                os: "linux".into(),
                arch: "x86_64".into(),
                libc: "glibc 2.36".into(),
            },
            command: vec!["pip".into(), "install".into()],
            target: Some("/opt/venv".into()),
        }
    }

    #[test]
    fn every_input_changes_the_key_and_names_do_not() {
        let base = inputs();
        let k = base.key();
        assert_eq!(k, inputs().key(), "same inputs, same key");
        let mut renamed = inputs();
        renamed.locks[0].name = "other.txt".into();
        assert_eq!(
            renamed.key(),
            k,
            "the lock file's name is not part of the key"
        );

        type Change = Box<dyn Fn(&mut KeyInputs)>;
        let changes: Vec<(&str, Change)> = vec![
            (
                "lock bytes",
                Box::new(|i| {
                    i.locks[0].blake3 = blake3::hash(b"numpy==2.1.1").to_hex().to_string()
                }),
            ),
            (
                "second lock",
                Box::new(|i| i.locks.push(i.locks[0].clone())),
            ),
            ("version", Box::new(|i| i.python.version = "3.11.8".into())),
            ("abi", Box::new(|i| i.python.abiflags = "t".into())),
            (
                "base prefix",
                Box::new(|i| i.python.base_prefix = "/opt/py".into()),
            ),
            ("arch", Box::new(|i| i.platform.arch = "aarch64".into())),
            ("libc", Box::new(|i| i.platform.libc = "glibc 2.39".into())),
            ("command", Box::new(|i| i.command.push("-q".into()))),
            // Argument boundaries count: ["pip install"] is not ["pip", "install"].
            (
                "argv split",
                Box::new(|i| i.command = vec!["pip install".into()]),
            ),
            ("target", Box::new(|i| i.target = Some("/opt/venv2".into()))),
            ("relocatable", Box::new(|i| i.target = None)),
        ];
        let mut seen = std::collections::HashSet::from([k]);
        for (what, change) in changes {
            let mut i = inputs();
            change(&mut i);
            assert!(seen.insert(i.key()), "{what} did not change the key");
        }
    }

    /// What the probe used to ask, the slow way: `platform`, `sysconfig` and `json` after `site`.
    fn asked_the_slow_way(python: &Path) -> PythonInfo {
        let out = std::process::Command::new(python)
            .args([
                "-I",
                "-c",
                "import json, os, platform, sys, sysconfig; print(json.dumps({\
                 'implementation': sys.implementation.name, \
                 'version': platform.python_version(), \
                 'soabi': sysconfig.get_config_var('SOABI') or '', \
                 'abiflags': getattr(sys, 'abiflags', ''), \
                 'base_prefix': os.path.realpath(sys.base_prefix)}))",
            ])
            .output()
            .unwrap();
        assert!(out.status.success(), "{out:?}");
        serde_json::from_slice(&out.stdout).unwrap()
    }

    #[test]
    fn the_probe_answers_what_platform_and_sysconfig_say_for_a_venv_too() {
        let system = PythonInfo::probe("python3").unwrap();
        let base = PathBuf::from(&system.base_prefix);
        assert!(base.is_absolute(), "{system:?}");
        assert!(system.soabi.starts_with("cpython-"), "{system:?}");
        let dir = tempfile::tempdir().unwrap();
        let venv = dir.path().join("venv");
        let made = std::process::Command::new("python3")
            .args(["-m", "venv", "--without-pip"])
            .arg(&venv)
            .status()
            .unwrap();
        assert!(made.success());
        let python = venv.join("bin/python");
        let in_venv = PythonInfo::probe(python.to_str().unwrap()).unwrap();
        assert_eq!(in_venv, asked_the_slow_way(&python));
        // Without `site`, a venv still reports its base installation, as `python3` does.
        assert_eq!(in_venv, system);
        let err = PythonInfo::probe(dir.path().join("missing").to_str().unwrap()).unwrap_err();
        assert!(matches!(err, Error::Python { .. }), "{err}");
    }

    #[test]
    fn keys_print_and_parse() {
        let k = inputs().key();
        assert_eq!(k.to_hex().parse::<Key>().unwrap(), k);
        assert!("nope".parse::<Key>().is_err());
        assert_eq!(k.short().len(), 16);
    }

    #[test]
    fn targets_are_absolute_and_normalised() {
        assert_eq!(
            absolute(Path::new("/a/./b/../c/")).unwrap(),
            PathBuf::from("/a/c")
        );
        let cwd = std::env::current_dir().unwrap();
        assert_eq!(absolute(Path::new("venv")).unwrap(), cwd.join("venv"));
        assert!(absolute(Path::new("/")).is_err());
    }
}
