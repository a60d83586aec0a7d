//! Reference-model property test of `StripedFs` (no FUSE): random sequences of create/write/
//! read/rename/unlink/mkdir/rmdir/readdir on a memory store, checked against an in-memory model
//! of the documented semantics (errno for errno, byte for byte).

mod common;

use std::collections::BTreeMap;

use hotstart_fuse::{FileKind, StripedFs};
use hotstart_store::Store;
use proptest::prelude::*;

const ROOT: u64 = 1;
const NAMES: [&str; 4] = ["a", "b", "c", "d"];

#[derive(Debug, Clone)]
enum Op {
    Write {
        dir: usize,
        name: usize,
        len: usize,
        seed: u8,
        chunk: usize,
        /// Commit (as another descriptor's close does) after every this many chunks; 0: never.
        flush_every: usize,
    },
    Read {
        dir: usize,
        name: usize,
    },
    Mkdir {
        dir: usize,
        name: usize,
    },
    Rmdir {
        dir: usize,
        name: usize,
    },
    Unlink {
        dir: usize,
        name: usize,
    },
    Rename {
        dir: usize,
        name: usize,
        to_dir: usize,
        to_name: usize,
    },
    Readdir {
        dir: usize,
    },
}

fn op() -> impl Strategy<Value = Op> {
    let d = 0..3usize; // "", "a", "b" as parents
    let n = 0..NAMES.len();
    prop_oneof![
        (
            d.clone(),
            n.clone(),
            0..300_000usize,
            any::<u8>(),
            1..100_000usize,
            prop_oneof![Just(0usize), 1..4usize],
        )
            .prop_map(|(dir, name, len, seed, chunk, flush_every)| Op::Write {
                dir,
                name,
                len,
                seed,
                chunk,
                flush_every,
            }),
        (d.clone(), n.clone()).prop_map(|(dir, name)| Op::Read { dir, name }),
        (d.clone(), n.clone()).prop_map(|(dir, name)| Op::Mkdir { dir, name }),
        (d.clone(), n.clone()).prop_map(|(dir, name)| Op::Rmdir { dir, name }),
        (d.clone(), n.clone()).prop_map(|(dir, name)| Op::Unlink { dir, name }),
        (d.clone(), n.clone(), d.clone(), n.clone()).prop_map(|(dir, name, to_dir, to_name)| {
            Op::Rename {
                dir,
                name,
                to_dir,
                to_name,
            }
        }),
        d.prop_map(|dir| Op::Readdir { dir }),
    ]
}

#[derive(Debug, Clone, PartialEq)]
enum Node {
    File(Vec<u8>),
    Dir,
}

#[derive(Default)]
struct Model {
    nodes: BTreeMap<String, Node>,
}

fn dir_path(d: usize) -> &'static str {
    ["", "a", "b"][d]
}

fn join(d: &str, n: &str) -> String {
    if d.is_empty() {
        n.to_string()
    } else {
        format!("{d}/{n}")
    }
}

impl Model {
    fn is_dir(&self, p: &str) -> bool {
        p.is_empty() || self.nodes.get(p) == Some(&Node::Dir)
    }
    /// The errno of using `p` as a parent directory, if it is not one.
    fn dir_err(&self, p: &str) -> Option<i32> {
        match self.nodes.get(p) {
            _ if p.is_empty() => None,
            Some(Node::Dir) => None,
            Some(Node::File(_)) => Some(libc::ENOTDIR),
            None => Some(libc::ENOENT),
        }
    }
    fn children(&self, p: &str) -> Vec<(String, FileKind)> {
        let prefix = if p.is_empty() {
            String::new()
        } else {
            format!("{p}/")
        };
        self.nodes
            .iter()
            .filter(|(k, _)| k.starts_with(&prefix) && !k[prefix.len()..].contains('/'))
            .map(|(k, v)| {
                let kind = if *v == Node::Dir {
                    FileKind::Dir
                } else {
                    FileKind::File
                };
                (k[prefix.len()..].to_string(), kind)
            })
            .collect()
    }
}

async fn resolve(fs: &StripedFs, dir: &str) -> Result<u64, i32> {
    if dir.is_empty() {
        return Ok(ROOT);
    }
    let a = fs.lookup(ROOT, dir).await.map_err(|e| e.errno())?;
    if a.kind != FileKind::Dir {
        return Err(libc::ENOTDIR);
    }
    Ok(a.ino)
}

async fn run(ops: Vec<Op>) {
    let fs = StripedFs::new(Store::open("memory://").unwrap(), common::small_config());
    let mut m = Model::default();
    for op in ops {
        match op {
            Op::Write {
                dir,
                name,
                len,
                seed,
                chunk,
                flush_every,
            } => {
                let (d, p) = (dir_path(dir), join(dir_path(dir), NAMES[name]));
                let data: Vec<u8> = (0..len)
                    .map(|i| (i as u8).wrapping_mul(31) ^ seed)
                    .collect();
                let expect = if let Some(e) = m.dir_err(d) {
                    Err(e)
                } else if m.nodes.get(&p) == Some(&Node::Dir) {
                    Err(libc::EISDIR)
                } else {
                    Ok(())
                };
                let got = async {
                    let parent = resolve(&fs, d).await?;
                    let fh = match fs.lookup(parent, NAMES[name]).await {
                        Ok(a) if a.kind == FileKind::Dir => return Err(libc::EISDIR),
                        Ok(a) => fs.open(a.ino, libc::O_WRONLY | libc::O_TRUNC).await,
                        Err(e) if e.errno() == libc::ENOENT => fs
                            .create(parent, NAMES[name], libc::O_WRONLY)
                            .await
                            .map(|x| x.1),
                        Err(e) => Err(e),
                    }
                    .map_err(|e| e.errno())?;
                    for (i, c) in data.chunks(chunk).enumerate() {
                        fs.write(fh, (i * chunk) as u64, c)
                            .await
                            .map_err(|e| e.errno())?;
                        if flush_every > 0 && (i + 1) % flush_every == 0 {
                            fs.flush(fh).await.map_err(|e| e.errno())?;
                        }
                    }
                    fs.release(fh).await.map_err(|e| e.errno())
                }
                .await;
                assert_eq!(got, expect, "write {p}");
                if got.is_ok() {
                    m.nodes.insert(p, Node::File(data));
                }
            }
            Op::Read { dir, name } => {
                let (d, p) = (dir_path(dir), join(dir_path(dir), NAMES[name]));
                let got = async {
                    let parent = resolve(&fs, d).await?;
                    let a = fs
                        .lookup(parent, NAMES[name])
                        .await
                        .map_err(|e| e.errno())?;
                    let fh = fs
                        .open(a.ino, libc::O_RDONLY)
                        .await
                        .map_err(|e| e.errno())?;
                    let mut out = Vec::new();
                    loop {
                        let b = fs
                            .read(fh, out.len() as u64, 50_000)
                            .await
                            .map_err(|e| e.errno())?;
                        if b.is_empty() {
                            break;
                        }
                        out.extend_from_slice(&b);
                    }
                    fs.release(fh).await.map_err(|e| e.errno())?;
                    Ok(out)
                }
                .await;
                match m.nodes.get(&p) {
                    Some(Node::File(data)) => assert!(got.as_ref() == Ok(data), "read {p}"),
                    Some(Node::Dir) => assert_eq!(got, Err(libc::EISDIR), "read dir {p}"),
                    None => assert_eq!(got, Err(m.dir_err(d).unwrap_or(libc::ENOENT)), "read {p}"),
                }
            }
            Op::Mkdir { dir, name } => {
                let (d, p) = (dir_path(dir), join(dir_path(dir), NAMES[name]));
                let got = async {
                    let parent = resolve(&fs, d).await?;
                    fs.mkdir(parent, NAMES[name])
                        .await
                        .map(|_| ())
                        .map_err(|e| e.errno())
                }
                .await;
                let expect = if let Some(e) = m.dir_err(d) {
                    Err(e)
                } else if m.nodes.contains_key(&p) {
                    Err(libc::EEXIST)
                } else {
                    Ok(())
                };
                assert_eq!(got, expect, "mkdir {p}");
                if got.is_ok() {
                    m.nodes.insert(p, Node::Dir);
                }
            }
            Op::Rmdir { dir, name } | Op::Unlink { dir, name } => {
                let rmdir = matches!(op, Op::Rmdir { .. });
                let (d, p) = (dir_path(dir), join(dir_path(dir), NAMES[name]));
                let got = async {
                    let parent = resolve(&fs, d).await?;
                    if rmdir {
                        fs.rmdir(parent, NAMES[name]).await
                    } else {
                        fs.unlink(parent, NAMES[name]).await
                    }
                    .map_err(|e| e.errno())
                }
                .await;
                let expect = match (m.is_dir(d), m.nodes.get(&p), rmdir) {
                    (false, _, _) => Err(m.dir_err(d).unwrap_or(libc::ENOENT)),
                    (true, None, _) => Err(libc::ENOENT),
                    (true, Some(Node::File(_)), true) => Err(libc::ENOTDIR),
                    (true, Some(Node::Dir), false) => Err(libc::EISDIR),
                    (true, Some(Node::Dir), true) if !m.children(&p).is_empty() => {
                        Err(libc::ENOTEMPTY)
                    }
                    _ => Ok(()),
                };
                assert_eq!(
                    got,
                    expect,
                    "{} {p}",
                    if rmdir { "rmdir" } else { "unlink" }
                );
                if got.is_ok() {
                    m.nodes.remove(&p);
                }
            }
            Op::Rename {
                dir,
                name,
                to_dir,
                to_name,
            } => {
                let (d, p) = (dir_path(dir), join(dir_path(dir), NAMES[name]));
                let (td, tp) = (dir_path(to_dir), join(dir_path(to_dir), NAMES[to_name]));
                let got = async {
                    let a = resolve(&fs, d).await?;
                    let b = resolve(&fs, td).await?;
                    fs.rename(a, NAMES[name], b, NAMES[to_name], false)
                        .await
                        .map_err(|e| e.errno())
                }
                .await;
                let src = m.nodes.get(&p).cloned();
                let dst = m.nodes.get(&tp).cloned();
                let expect = if let Some(e) = m.dir_err(d).or(m.dir_err(td)) {
                    Err(e)
                } else if tp.starts_with(&format!("{p}/")) {
                    Err(libc::EINVAL)
                } else {
                    match (&src, &dst) {
                        (None, _) => Err(libc::ENOENT),
                        _ if p == tp => Ok(()),
                        (Some(Node::File(_)), Some(Node::Dir)) => Err(libc::EISDIR),
                        (Some(Node::Dir), Some(Node::File(_))) => Err(libc::ENOTDIR),
                        (Some(Node::Dir), Some(Node::Dir)) if !m.children(&tp).is_empty() => {
                            Err(libc::ENOTEMPTY)
                        }
                        (Some(Node::Dir), _) if !m.children(&p).is_empty() => Err(libc::EXDEV),
                        _ => Ok(()),
                    }
                };
                assert_eq!(got, expect, "rename {p} -> {tp}");
                if got.is_ok() && p != tp {
                    let node = m.nodes.remove(&p).unwrap();
                    m.nodes.insert(tp, node);
                }
            }
            Op::Readdir { dir } => {
                let d = dir_path(dir);
                let got = async {
                    let ino = resolve(&fs, d).await?;
                    fs.readdir(ino).await.map_err(|e| e.errno())
                }
                .await;
                if m.is_dir(d) {
                    let got: Vec<(String, FileKind)> =
                        got.unwrap().into_iter().map(|e| (e.name, e.kind)).collect();
                    assert_eq!(got, m.children(d), "readdir {d:?}");
                } else {
                    assert_eq!(got.map(|_| ()), Err(m.dir_err(d).unwrap()), "readdir {d:?}");
                }
            }
        }
    }
    assert_eq!(fs.budget().in_use(), 0, "every handle gave its memory back");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]
    #[test]
    fn filesystem_matches_the_model(ops in proptest::collection::vec(op(), 1..40)) {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
        rt.block_on(run(ops));
    }
}
