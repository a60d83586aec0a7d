//! Unit tests of [`StripedFs`] on a memory store: no FUSE involved.

use hotstart_store::wrap::{Counter, Interceptor, Op};

use super::*;
use crate::inode::ROOT;

fn fs_with(cfg: FsConfig) -> StripedFs {
    StripedFs::new(Store::open("memory://").unwrap(), cfg)
}

fn small() -> FsConfig {
    FsConfig {
        stripe_size: 64 << 10,
        max_in_flight: 4,
        initial_read_ahead: 16 << 10,
        max_read_ahead: 128 << 10,
        memory_budget: 4 << 20,
        ..FsConfig::default()
    }
}

/// A filesystem over a memory store whose requests are counted.
fn counted_fs() -> (Arc<Counter>, StripedFs) {
    let counter = Arc::new(Counter::default());
    let store = Store::open("memory://")
        .unwrap()
        .wrap(|inner| counter.clone().wrap(inner));
    (counter, StripedFs::new(store, small()))
}

async fn write_file(fs: &StripedFs, parent: u64, name: &str, data: &[u8]) -> u64 {
    let (attr, fh) = fs.create(parent, name, libc::O_WRONLY).await.unwrap();
    for (i, chunk) in data.chunks(10_000).enumerate() {
        fs.write(fh, (i * 10_000) as u64, chunk).await.unwrap();
    }
    fs.flush(fh).await.unwrap();
    fs.release(fh).await.unwrap();
    attr.ino
}

async fn read_file(fs: &StripedFs, ino: u64) -> Vec<u8> {
    let fh = fs.open(ino, libc::O_RDONLY).await.unwrap();
    let mut out = Vec::new();
    loop {
        let b = fs.read(fh, out.len() as u64, 7_000).await.unwrap();
        if b.is_empty() {
            break;
        }
        out.extend_from_slice(&b);
    }
    fs.release(fh).await.unwrap();
    out
}

fn data(len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i % 251) as u8 ^ (i / 4096) as u8)
        .collect()
}

#[tokio::test]
async fn write_then_read_back_and_list() {
    let fs = fs_with(small());
    let d = fs.mkdir(ROOT, "dir").await.unwrap();
    for (name, len) in [
        ("empty", 0),
        ("one", 1),
        ("big", 300_001),
        ("stripe", 64 << 10),
    ] {
        let body = data(len);
        let ino = write_file(&fs, d.ino, name, &body).await;
        assert_eq!(fs.getattr(ino).await.unwrap().size, len as u64);
        assert_eq!(read_file(&fs, ino).await, body, "{name}");
        let key = format!("dir/{name}");
        assert_eq!(
            fs.store().get(&key).await.unwrap(),
            body,
            "{name} in the store"
        );
    }
    let names: Vec<_> = fs
        .readdir(d.ino)
        .await
        .unwrap()
        .into_iter()
        .map(|e| e.name)
        .collect();
    assert_eq!(names, ["big", "empty", "one", "stripe"]);
    let root: Vec<_> = fs.readdir(ROOT).await.unwrap();
    assert_eq!(root.len(), 1);
    assert_eq!(
        (root[0].name.as_str(), root[0].kind),
        ("dir", FileKind::Dir)
    );
    assert_eq!(fs.budget().in_use(), 0);
}

#[tokio::test]
async fn objects_from_other_writers_appear() {
    let fs = fs_with(FsConfig {
        stat_ttl: std::time::Duration::ZERO,
        ..small()
    });
    fs.store()
        .put("a/b/c", Bytes::from_static(b"hello"))
        .await
        .unwrap();
    let a = fs.lookup(ROOT, "a").await.unwrap();
    assert_eq!(a.kind, FileKind::Dir);
    let b = fs.lookup(a.ino, "b").await.unwrap();
    let c = fs.lookup(b.ino, "c").await.unwrap();
    assert_eq!((c.kind, c.size), (FileKind::File, 5));
    fs.store()
        .put("a/b/c", Bytes::from_static(b"hello world"))
        .await
        .unwrap();
    assert_eq!(fs.getattr(c.ino).await.unwrap().size, 11);
    fs.store().delete("a/b/c").await.unwrap();
    assert_eq!(fs.getattr(c.ino).await.unwrap_err().errno(), libc::ENOENT);
}

#[tokio::test]
async fn overwrite_needs_o_trunc() {
    let fs = fs_with(small());
    let ino = write_file(&fs, ROOT, "f", b"old").await;
    let err = fs.open(ino, libc::O_WRONLY).await.unwrap_err();
    assert_eq!(err.errno(), libc::EPERM, "{err}");
    let fh = fs.open(ino, libc::O_WRONLY | libc::O_TRUNC).await.unwrap();
    // Readers see the old version until the new one commits.
    assert_eq!(fs.store().get("f").await.unwrap(), &b"old"[..]);
    fs.write(fh, 0, b"new!").await.unwrap();
    fs.release(fh).await.unwrap();
    assert_eq!(read_file(&fs, ino).await, b"new!");
    // An empty file may be opened for writing without O_TRUNC (nothing is lost).
    let e = write_file(&fs, ROOT, "e", b"").await;
    let fh = fs.open(e, libc::O_WRONLY).await.unwrap();
    fs.write(fh, 0, b"x").await.unwrap();
    fs.release(fh).await.unwrap();
    assert_eq!(read_file(&fs, e).await, b"x");
}

#[tokio::test]
async fn seeking_writer_spills_and_commits_exact_bytes() {
    let fs = fs_with(small());
    let (attr, fh) = fs.create(ROOT, "z", libc::O_WRONLY).await.unwrap();
    let body = data(200_000);
    fs.write(fh, 0, &[0u8; 30]).await.unwrap();
    fs.write(fh, 30, &body[30..50_000]).await.unwrap();
    fs.write(fh, 0, &body[..30]).await.unwrap(); // seek back within the first stripe: spill
    fs.write(fh, 50_000, &body[50_000..]).await.unwrap();
    assert_eq!(
        &fs.read(fh, 0, 100).await.unwrap()[..],
        &body[..100],
        "read back while open"
    );
    assert_eq!(fs.getattr(attr.ino).await.unwrap().size, 200_000);
    assert!(fs.store().get("z").await.is_err(), "invisible until close");
    fs.flush(fh).await.unwrap();
    fs.release(fh).await.unwrap();
    assert_eq!(fs.store().get("z").await.unwrap(), body);
}

#[tokio::test]
async fn seek_back_after_three_stripes_restarts_from_the_local_copy() {
    let (counter, fs) = counted_fs();
    let stripe = 64 << 10;
    let mut body = data(3 * stripe + 5_000);
    let (attr, fh) = fs.create(ROOT, "zip", libc::O_WRONLY).await.unwrap();
    // A zip writer: a placeholder header, the member streamed past three stripes...
    fs.write(fh, 0, &[0u8; 30]).await.unwrap();
    for (i, chunk) in body[30..].chunks(10_000).enumerate() {
        fs.write(fh, 30 + (i * 10_000) as u64, chunk).await.unwrap();
    }
    assert_eq!(
        counter.get(Op::MultipartStart).requests,
        1,
        "the stripes were streamed as a multipart upload"
    );
    assert_eq!(
        &fs.read(fh, 100_000, 50).await.unwrap()[..],
        &body[100_000..100_050],
        "a streamed file reads back from its local copy"
    );
    // ...then it seeks back to patch the header and appends a directory at the end.
    fs.write(fh, 0, &body[..30]).await.unwrap();
    assert_eq!(counter.get(Op::MultipartAbort).requests, 1);
    let end = body.len() as u64;
    let tail = data(7_000);
    fs.write(fh, end, &tail).await.unwrap();
    body.extend_from_slice(&tail);
    assert_eq!(fs.getattr(attr.ino).await.unwrap().size, body.len() as u64);
    assert!(
        fs.store().get("zip").await.is_err(),
        "invisible until close"
    );
    fs.flush(fh).await.unwrap();
    fs.release(fh).await.unwrap();
    assert_eq!(fs.store().get("zip").await.unwrap(), body);
    assert_eq!(fs.spill_space().used(), 0, "spill files go at close");
    assert!(fs.spill_space().peak() >= body.len() as u64 - 7_000);
    assert_eq!(fs.budget().in_use(), 0);
}

#[tokio::test]
async fn seek_back_without_a_local_copy_is_enospc_and_nothing_is_visible() {
    let fs = fs_with(FsConfig {
        max_spill: 100_000,
        ..small()
    });
    let (_, fh) = fs.create(ROOT, "s", libc::O_WRONLY).await.unwrap();
    // The local copy outgrows the spill limit: it is dropped and the upload goes on.
    fs.write(fh, 0, &data(200_000)).await.unwrap();
    fs.write(fh, 200_000, &data(1_000)).await.unwrap();
    let err = fs.write(fh, 0, b"x").await.unwrap_err();
    assert_eq!(err.errno(), libc::ENOSPC, "{err}");
    assert_eq!(fs.flush(fh).await.unwrap_err().errno(), libc::EIO);
    let _ = fs.release(fh).await;
    assert!(fs.store().get("s").await.is_err());
    assert_eq!(fs.spill_space().used(), 0);
    // Without a local copy, a write after a commit cannot be published with the rest: refused.
    let (_, fh) = fs.create(ROOT, "u", libc::O_WRONLY).await.unwrap();
    fs.write(fh, 0, &data(200_000)).await.unwrap();
    fs.flush(fh).await.unwrap();
    let err = fs.write(fh, 200_000, b"x").await.unwrap_err();
    assert_eq!(err.errno(), libc::ENOSPC, "{err}");
    assert_eq!(fs.flush(fh).await.unwrap_err().errno(), libc::EIO);
    let _ = fs.release(fh).await;
    assert!(fs.store().get("u").await.unwrap() == data(200_000));
    // Within the limit, a file written out of order works; past it, its writes are ENOSPC.
    let (_, fh) = fs.create(ROOT, "t", libc::O_WRONLY).await.unwrap();
    fs.write(fh, 10, b"later").await.unwrap();
    fs.write(fh, 0, b"first").await.unwrap();
    let err = fs.write(fh, 99_999, b"xx").await.unwrap_err();
    assert_eq!(err.errno(), libc::ENOSPC, "{err}");
    let _ = fs.release(fh).await;
    assert!(fs.store().get("t").await.is_err());
}

#[tokio::test]
async fn namespace_errors_are_precise() {
    let fs = fs_with(small());
    let d = fs.mkdir(ROOT, "d").await.unwrap();
    write_file(&fs, d.ino, "f", b"1").await;
    let errno = |r: FsResult<()>| r.unwrap_err().errno();
    assert_eq!(errno(fs.rmdir(ROOT, "d").await), libc::ENOTEMPTY);
    assert_eq!(errno(fs.unlink(ROOT, "d").await), libc::EISDIR);
    assert_eq!(errno(fs.rmdir(d.ino, "f").await), libc::ENOTDIR);
    assert_eq!(
        errno(fs.rename(ROOT, "d", ROOT, "e", false).await),
        libc::EXDEV
    );
    assert_eq!(fs.mkdir(ROOT, "d").await.unwrap_err().errno(), libc::EEXIST);
    assert_eq!(
        fs.lookup(d.ino, DIR_MARKER).await.unwrap_err().errno(),
        libc::ENOENT
    );
    fs.rename(d.ino, "f", ROOT, "g", false).await.unwrap();
    assert_eq!(fs.store().get("g").await.unwrap(), &b"1"[..]);
    fs.rmdir(ROOT, "d").await.unwrap();
    assert_eq!(
        fs.lookup(ROOT, "d").await.unwrap_err().errno(),
        libc::ENOENT
    );
    let g = fs.lookup(ROOT, "g").await.unwrap();
    assert_eq!(fs.setattr(g.ino, Some(0)).await.unwrap().size, 0);
    assert_eq!(fs.store().get("g").await.unwrap().len(), 0);
    let ro = fs_with(FsConfig {
        read_only: true,
        ..small()
    });
    assert_eq!(ro.mkdir(ROOT, "x").await.unwrap_err().errno(), libc::EROFS);
}

#[tokio::test]
async fn close_of_a_duplicate_before_any_write_does_not_commit() {
    let fs = fs_with(small());
    let (_, fh) = fs.create(ROOT, "redir", libc::O_WRONLY).await.unwrap();
    fs.flush(fh).await.unwrap(); // `exec 3>f; close(3)` after dup2: nothing written yet
    fs.write(fh, 0, b"hi\n").await.unwrap();
    fs.flush(fh).await.unwrap();
    fs.release(fh).await.unwrap();
    assert_eq!(fs.store().get("redir").await.unwrap(), &b"hi\n"[..]);
}

/// A close of another descriptor of the handle (a forked child's copy, closed when it execs or
/// exits) publishes what was written so far; the writer goes on, and its own close publishes the
/// whole file. A file kept in memory, streamed with a local copy, or spilled: each keeps its bytes.
#[tokio::test]
async fn writes_go_on_after_a_close_of_another_descriptor() {
    let (counter, fs) = counted_fs();
    let stripe = 64 << 10;
    for (name, len, seek_back) in [
        ("head", 1_000, false),
        ("stream", 3 * stripe + 5_000, false),
        ("spill", 3 * stripe + 5_000, true),
    ] {
        let body = data(len);
        let half = len / 2;
        let (attr, fh) = fs.create(ROOT, name, libc::O_WRONLY).await.unwrap();
        if seek_back {
            fs.write(fh, 0, &[0u8; 30]).await.unwrap();
        }
        for at in (if seek_back { 30 } else { 0 }..half).step_by(10_000) {
            let end = (at + 10_000).min(half);
            fs.write(fh, at as u64, &body[at..end]).await.unwrap();
        }
        if seek_back {
            fs.write(fh, 0, &body[..30]).await.unwrap();
        }
        fs.flush(fh).await.unwrap();
        assert!(
            fs.store().get(name).await.unwrap() == body[..half],
            "{name}: the other close published the first half"
        );
        counter.reset();
        fs.flush(fh).await.unwrap();
        for op in [Op::Put, Op::MultipartStart, Op::PutPart] {
            assert_eq!(
                counter.get(op).requests,
                0,
                "{name}: nothing new, nothing sent"
            );
        }
        for at in (half..len).step_by(10_000) {
            let end = (at + 10_000).min(len);
            fs.write(fh, at as u64, &body[at..end]).await.unwrap();
        }
        assert_eq!(fs.getattr(attr.ino).await.unwrap().size, len as u64);
        assert_eq!(
            &fs.read(fh, 0, 100).await.unwrap()[..],
            &body[..100],
            "{name}: read back while open"
        );
        fs.flush(fh).await.unwrap();
        fs.release(fh).await.unwrap();
        assert!(
            fs.store().get(name).await.unwrap() == body,
            "{name}: the writer's close published the whole file"
        );
        assert_eq!(fs.getattr(attr.ino).await.unwrap().size, len as u64);
    }
    assert_eq!(fs.spill_space().used(), 0, "spill files go at release");
    assert_eq!(fs.budget().in_use(), 0);
}

#[tokio::test]
async fn second_read_hits_the_stripe_cache_and_a_changed_object_is_not_stale() {
    let counter = Arc::new(Counter::default());
    let store = Store::open("memory://")
        .unwrap()
        .wrap(|inner| counter.clone().wrap(inner));
    let dir = tempfile::tempdir().unwrap();
    let fs = StripedFs::new(
        store,
        FsConfig {
            cache_dir: Some(dir.path().to_path_buf()),
            cache_bytes: 10 << 20,
            ..small()
        },
    );
    let body = data(300_001);
    fs.store()
        .put("c", Bytes::from(body.clone()))
        .await
        .unwrap();
    let ino = fs.lookup(ROOT, "c").await.unwrap().ino;
    assert_eq!(read_file(&fs, ino).await, body);
    assert!(counter.get(Op::Get).requests > 0);
    counter.reset();
    assert_eq!(
        read_file(&fs, ino).await,
        body,
        "second read, from the cache"
    );
    assert_eq!(
        counter.get(Op::Get).requests,
        0,
        "no GET on the second read"
    );
    let cache = fs.cache().unwrap();
    assert!(cache.hits() >= 5, "{} hits", cache.hits());
    // A random read inside a cached stripe is served from it as well.
    let fh = fs.open(ino, libc::O_RDONLY).await.unwrap();
    assert_eq!(
        &fs.read(fh, 200_000, 100).await.unwrap()[..],
        &body[200_000..200_100]
    );
    fs.release(fh).await.unwrap();
    assert_eq!(counter.get(Op::Get).requests, 0);
    // The same key and size with other bytes is another version: read afresh.
    let changed = data(300_001).iter().map(|b| b ^ 0x5a).collect::<Vec<_>>();
    fs.store()
        .put("c", Bytes::from(changed.clone()))
        .await
        .unwrap();
    assert_eq!(read_file(&fs, ino).await, changed);
    assert!(counter.get(Op::Get).requests > 0);
    assert!(cache.bytes() <= cache.capacity());
}

/// Two handles on one file with memory for one handle's read-ahead: a handle left idle with its
/// buffers (its reader is being served through the other handle, as readers sharing the
/// kernel's page cache are) must not stall the other, which once waited for it forever. Then the
/// first handle, whose buffers were taken back, reads on correctly.
#[tokio::test]
async fn an_idle_handles_read_ahead_is_taken_back() {
    let fs = fs_with(FsConfig {
        initial_read_ahead: 128 << 10,
        max_read_ahead: 128 << 10,
        memory_budget: 256 << 10,
        ..small()
    });
    let body = data(1 << 20);
    let ino = write_file(&fs, ROOT, "f", &body).await;
    let a = fs.open(ino, libc::O_RDONLY).await.unwrap();
    let b = fs.open(ino, libc::O_RDONLY).await.unwrap();
    assert_eq!(&fs.read(a, 0, 4096).await.unwrap()[..], &body[..4096]);
    assert_eq!(
        fs.budget().in_use(),
        fs.budget().capacity(),
        "a's window and read-ahead hold the whole budget"
    );
    let read_all = async {
        let mut off = 0;
        while off < body.len() {
            let got = fs.read(b, off as u64, 7_000).await.unwrap();
            assert!(got[..] == body[off..off + got.len()], "b at {off}");
            off += got.len();
        }
    };
    tokio::time::timeout(std::time::Duration::from_secs(10), read_all)
        .await
        .expect("b waited for memory that idle handle a holds");
    let mut off = 4096;
    while off < body.len() {
        let got = fs.read(a, off as u64, 50_000).await.unwrap();
        assert!(got[..] == body[off..off + got.len()], "a at {off}");
        off += got.len();
    }
    fs.release(a).await.unwrap();
    fs.release(b).await.unwrap();
    assert!(fs.budget().peak() <= fs.budget().capacity());
    assert_eq!(fs.budget().in_use(), 0);
}

/// Inodes live while the kernel references them: one reference per lookup, create and mkdir,
/// given back by forget. A forgotten number is ENOENT and its name gets a new number; a file
/// being written stays known however often it is forgotten; names seen only in listings are
/// dropped once their stat result is stale, so listing a large store does not grow the table.
#[tokio::test]
async fn forgotten_inodes_are_dropped() {
    let fs = fs_with(FsConfig {
        stat_ttl: std::time::Duration::ZERO,
        ..small()
    });
    let body = data(1000);
    let a = write_file(&fs, ROOT, "a", &body).await;
    assert_eq!(fs.lookup(ROOT, "a").await.unwrap().ino, a);
    fs.forget(a, 1);
    assert_eq!(
        fs.getattr(a).await.unwrap().size,
        1000,
        "one reference left"
    );
    fs.forget(a, 1);
    let err = fs.getattr(a).await.unwrap_err();
    assert_eq!(err.errno(), libc::ENOENT, "{err}");
    let again = fs.lookup(ROOT, "a").await.unwrap().ino;
    assert_ne!(again, a, "numbers are not reused");
    assert_eq!(read_file(&fs, again).await, body);

    let (w, fh) = fs.create(ROOT, "w", libc::O_WRONLY).await.unwrap();
    fs.write(fh, 0, b"xyz").await.unwrap();
    fs.forget(w.ino, 1);
    assert_eq!(
        fs.getattr(w.ino).await.unwrap().size,
        3,
        "known while written"
    );
    fs.flush(fh).await.unwrap();
    fs.release(fh).await.unwrap();
    assert_eq!(fs.store().get("w").await.unwrap().as_ref(), b"xyz");

    for i in 0..3000 {
        let key = format!("many/{i:04}");
        fs.store()
            .put(&key, Bytes::from_static(b"m"))
            .await
            .unwrap();
    }
    let many = fs.lookup(ROOT, "many").await.unwrap().ino;
    for _ in 0..2 {
        let listed = fs.readdir(many).await.unwrap();
        assert_eq!(listed.len(), 3000);
        assert_eq!(listed[1234].name, "1234");
    }
    let known = fs.inodes.lock().len();
    assert!(
        known <= crate::inode::MIN_SWEEP,
        "{known} inodes after listing 3000 names"
    );
    assert_eq!(fs.getattr(many).await.unwrap().kind, FileKind::Dir);
    assert_eq!(read_file(&fs, again).await, body, "referenced inodes stay");
}
