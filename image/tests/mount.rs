//! Real FUSE mounts of images, on a local-directory store and on SeaweedFS: every file's bytes,
//! mode, mtime, xattrs and link target equal the source; record → profile → the next mount
//! prefetches (asserted on counters); a profile still applies after a rebuild that changed one
//! file; a corrupted chunk fails only reads of its file, with EIO; concurrent readers fetch each
//! chunk once; the local cache stays within its bound.

mod common;

use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use common::*;
use futures::FutureExt;
use hotstart_image::{
    BuildConfig, ImageRef, Images, LazyConfig, MountReport, PlanHook, PrefetchConfig,
};
use hotstart_store::wrap::{Counter, Interceptor, Op, Throttle, ThrottleConfig};
use hotstart_store::{ChunkId, ChunkStore, ChunkStoreConfig, EntryKind, Store};
use hotstart_testkit::{SeaweedFs, pattern};

/// One backend: a runtime for the mounts, the store, and a scratch directory.
struct Env {
    rt: tokio::runtime::Runtime,
    store: Store,
    work: tempfile::TempDir,
}

impl Env {
    fn local() -> Env {
        let work = tempfile::tempdir().unwrap();
        let store = Store::open(work.path().join("store").to_str().unwrap()).unwrap();
        Env::new(store, work)
    }

    /// A fresh bucket of the shared SeaweedFS server, or `None` (printed) outside CI.
    fn seaweedfs(test: &str) -> Option<Env> {
        let weed = SeaweedFs::shared()?;
        let bucket = weed.fresh_bucket(test);
        let store = Store::open_with(&format!("{bucket}/images"), &weed.client_options()).unwrap();
        Some(Env::new(store, tempfile::tempdir().unwrap()))
    }

    fn new(store: Store, work: tempfile::TempDir) -> Env {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(4)
            .enable_all()
            .build()
            .unwrap();
        Env { rt, store, work }
    }

    fn path(&self, rel: &str) -> PathBuf {
        self.work.path().join(rel)
    }

    /// Images over `store`, with a fresh local chunk cache of `cache` bytes in `cache_dir`.
    fn images_over(&self, store: Store, cache_dir: &str, cache: u64) -> Images {
        let cfg = ChunkStoreConfig {
            cache_dir: Some(self.path(cache_dir)),
            cache_capacity: cache,
            ..ChunkStoreConfig::default()
        };
        Images::new(ChunkStore::new(store, cfg).unwrap())
    }

    fn images(&self, cache_dir: &str) -> Images {
        self.images_over(self.store.clone(), cache_dir, 1 << 30)
    }

    fn build(&self, images: &Images, src: &Path, name: &str, chunk_size: usize) {
        let cfg = BuildConfig {
            chunk_size,
            ..BuildConfig::default()
        };
        self.rt
            .block_on(images.build(src, &ImageRef::parse(name).unwrap(), &cfg))
            .unwrap();
    }

    /// Mounts `name`, runs `f` on the mount point (blocking file I/O on this thread), unmounts;
    /// returns the report.
    fn with_mount<T>(
        &self,
        images: &Images,
        name: &str,
        cfg: LazyConfig,
        wait_prefetch: bool,
        f: impl FnOnce(&Path) -> T,
    ) -> (T, MountReport) {
        let mp = tempfile::tempdir().unwrap();
        let image = ImageRef::parse(name).unwrap();
        let mut m = self
            .rt
            .block_on(images.mount(&image, mp.path(), cfg))
            .expect("mount (needs /dev/fuse, fusermount3 and root)");
        if wait_prefetch {
            self.rt.block_on(m.prefetch_done());
        }
        let out = f(mp.path());
        let report = self.rt.block_on(m.unmount()).unwrap();
        (out, report)
    }
}

/// Every file of the sample, built from a directory and from a tarball (whiteouts and a FIFO
/// that must not appear), mounted and walked against the source.
fn images_mount_identical(env: &Env) {
    let src = env.path("src");
    sample_dir(&src);
    let images = env.images("cache");
    env.build(&images, &src, "sample:dir", 64 << 10);
    let raw = tar_with_markers(&src, "data/big", "deep");
    std::fs::write(env.path("layer.tar.zst"), zstd(&raw)).unwrap();
    env.build(&images, &env.path("layer.tar.zst"), "sample:tar", 64 << 10);

    for name in ["sample:dir", "sample:tar"] {
        let ((), report) = env.with_mount(&images, name, LazyConfig::default(), false, |mp| {
            assert_eq!(
                hotstart_fuse::bdi::read_ahead(&mp.canonicalize().unwrap()).unwrap(),
                hotstart_image::mount::KERNEL_READ_AHEAD,
                "the image mount sets its kernel read-ahead"
            );
            assert_trees_equal(&src, mp);
            // Read-only, and names that are not there are not there.
            let err = std::fs::write(mp.join("new"), b"x").unwrap_err();
            assert_eq!(err.raw_os_error(), Some(libc::EROFS), "{err}");
            let err = std::fs::read(mp.join("missing")).unwrap_err();
            assert_eq!(err.kind(), std::io::ErrorKind::NotFound);
            let err = std::fs::read(mp.join("data")).unwrap_err();
            assert_eq!(err.raw_os_error(), Some(libc::EISDIR), "{err}");
            // Opens are stateless (the kernel stops sending them): writing is still refused,
            // and `isatty` gets what any file that is not a terminal answers.
            let big = mp.join("data/big");
            let err = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .open(&big)
                .unwrap_err();
            assert_eq!(err.raw_os_error(), Some(libc::EROFS), "{err}");
            let f = std::fs::File::open(&big).unwrap();
            // SAFETY: `f` is open for the whole call.
            let tty = unsafe { libc::isatty(f.as_raw_fd()) };
            assert_eq!(tty, 0);
            let err = std::io::Error::last_os_error();
            assert_eq!(err.raw_os_error(), Some(libc::ENOTTY), "{err}");
        });
        // The walk read every byte of every distinct chunk.
        let (_, tree) = env
            .rt
            .block_on(images.open(&ImageRef::parse(name).unwrap()))
            .unwrap();
        assert_eq!(report.chunks_read, tree.chunk_ids().len() as u64, "{name}");
        assert!(report.bytes_read >= report.chunk_bytes_read, "{report:?}");
    }
}

#[test]
fn images_mount_identical_local_directory() {
    images_mount_identical(&Env::local());
}

#[test]
fn images_mount_identical_seaweedfs() {
    if let Some(env) = Env::seaweedfs("image-identical") {
        images_mount_identical(&env);
    }
}

/// The hot files read by the "job", and a cold one it never reads.
const HOT: [&str; 5] = [
    "lib/a.so",
    "lib/b.so",
    "app/main.py",
    "app/util.py",
    "conf/x.json",
];

fn job(mp: &Path) {
    for (i, f) in HOT.iter().enumerate() {
        let data = std::fs::read(mp.join(f)).unwrap();
        assert_eq!(data, pattern(200 << 10, i as u64 + 1), "{f}");
    }
}

fn write_job_tree(root: &Path) {
    for (i, f) in HOT.iter().enumerate() {
        let p = root.join(f);
        std::fs::create_dir_all(p.parent().unwrap()).unwrap();
        std::fs::write(&p, pattern(200 << 10, i as u64 + 1)).unwrap();
    }
    std::fs::write(root.join("cold.bin"), pattern(1 << 20, 99)).unwrap();
}

/// The job tree built as `job:v1` (64 KiB chunks), and the images of `env` with an empty cache.
fn job_image(env: &Env) -> Images {
    let src = env.path("job");
    write_job_tree(&src);
    let images = env.images("cache-0");
    env.build(&images, &src, "job:v1", 64 << 10);
    images
}

/// Record on the first mount, prefetch on the second: demand fetches and stall drop to zero and
/// every chunk read is a hit; after a rebuild that changes one hot file, only that file's chunks
/// are fetched on demand.
fn record_then_prefetch(env: &Env) {
    // Every request waits 10 ms, so the first run's stall cannot be zero.
    let slow = env.store.wrap(|inner| {
        Arc::new(Throttle::new(ThrottleConfig {
            latency: Duration::from_millis(10),
            ..ThrottleConfig::default()
        }))
        .wrap(inner)
    });
    let src = env.path("job");
    write_job_tree(&src);
    let chunk = 64 << 10;
    let images = env.images_over(slow.clone(), "cache-0", 1 << 30);
    env.build(&images, &src, "job:v1", chunk);
    // 200 KiB files in 64 KiB chunks: four chunks each, none shared.
    let hot_chunks = (HOT.len() * (200usize << 10).div_ceil(chunk)) as u64;

    let ((), first) = env.with_mount(&images, "job:v1", LazyConfig::default(), true, job);
    assert_eq!(first.chunks_read, hot_chunks, "{first:?}");
    assert_eq!(first.demand_fetches, hot_chunks, "{first:?}");
    assert_eq!(
        (first.hits, first.prefetched_chunks, first.planned_chunks),
        (0, 0, 0)
    );
    assert!(first.stall_seconds > 0.0, "{first:?}");

    // A fresh cache, as on another machine: only the profile can help.
    let images = env.images_over(slow.clone(), "cache-1", 1 << 30);
    let ((), second) = env.with_mount(&images, "job:v1", LazyConfig::default(), true, job);
    assert_eq!(second.planned_chunks, hot_chunks, "{second:?}");
    assert_eq!(second.prefetched_chunks, hot_chunks, "{second:?}");
    assert_eq!(second.demand_fetches, 0, "{second:?}");
    assert_eq!(second.hits, second.chunks_read, "{second:?}");
    assert_eq!(second.stall_seconds, 0.0, "{second:?}");
    assert_eq!(second.wasted_bytes, 0, "{second:?}");
    // The warmer had stored every hot file in the page cache before the job ran: no read
    // reached the mount, and the job's lookups still counted every chunk as read.
    assert_eq!(second.warmed_files, HOT.len() as u64, "{second:?}");
    assert_eq!(
        second.warmed_bytes,
        HOT.len() as u64 * (200 << 10),
        "{second:?}"
    );
    assert_eq!(second.reads, 0, "{second:?}");

    // Rebuild with lib/b.so changed: its old chunks leave the plan, its new ones are demand
    // fetched; everything else still comes from the profile.
    let v2 = env.path("job-v2");
    write_job_tree(&v2);
    let b_new = {
        let mut d = pattern(200 << 10, 2);
        d[0] ^= 0xff;
        d
    };
    std::fs::write(v2.join("lib/b.so"), &b_new).unwrap();
    env.build(&images, &v2, "job:v1", chunk);
    let job_v2 = |mp: &Path| {
        for (i, f) in HOT.iter().enumerate() {
            let want = if *f == "lib/b.so" {
                b_new.clone()
            } else {
                pattern(200 << 10, i as u64 + 1)
            };
            assert_eq!(std::fs::read(mp.join(f)).unwrap(), want, "{f}");
        }
    };
    let images = env.images_over(slow.clone(), "cache-2", 1 << 30);
    let ((), third) = env.with_mount(&images, "job:v1", LazyConfig::default(), true, job_v2);
    // Only the first chunk of b.so changed (the byte flipped is in it).
    assert_eq!(third.planned_chunks, hot_chunks - 1, "{third:?}");
    assert_eq!(third.demand_fetches, 1, "{third:?}");
    assert_eq!(third.hits, hot_chunks - 1, "{third:?}");
    assert_eq!(third.wasted_bytes, 0, "{third:?}");

    let (profile, runs) = env
        .rt
        .block_on(images.stats(&ImageRef::parse("job:v1").unwrap()))
        .unwrap();
    assert_eq!(profile.runs, 3);
    assert_eq!(runs.len(), 3);
    assert_eq!(runs[1], second);

    // A fresh cache, and the plan handed to a hook that announces it and holds the frames (as
    // a snapshot's pack does): the replay takes each planned chunk from memory, the store sends
    // none of them, and nothing stays held.
    let chunks = ChunkStore::new(
        slow,
        ChunkStoreConfig {
            cache_dir: Some(env.path("cache-3")),
            cache_capacity: 1 << 30,
            ..ChunkStoreConfig::default()
        },
    )
    .unwrap();
    let planned = Arc::new(std::sync::Mutex::new(Vec::new()));
    let hook = {
        let (chunks, store, planned) = (chunks.clone(), env.store.clone(), planned.clone());
        PlanHook(Arc::new(move |plan: Vec<ChunkId>| {
            let (chunks, store) = (chunks.clone(), store.clone());
            chunks.expect(plan.iter().copied());
            *planned.lock().unwrap() = plan.clone();
            async move {
                tokio::spawn(async move {
                    for id in plan.into_iter().rev() {
                        let frame = store.get(&id.key()).await.unwrap();
                        chunks.hold([(id, frame)]);
                    }
                });
            }
            .boxed()
        }))
    };
    let cfg = LazyConfig {
        on_plan: Some(hook),
        ..LazyConfig::default()
    };
    let ((), fourth) = env.with_mount(&Images::new(chunks.clone()), "job:v1", cfg, true, job_v2);
    let planned = planned.lock().unwrap().clone();
    assert_eq!(planned.len() as u64, fourth.planned_chunks, "{fourth:?}");
    assert_eq!(
        fourth.prefetched_chunks, fourth.planned_chunks,
        "{fourth:?}"
    );
    assert_eq!(fourth.hits, fourth.chunks_read, "{fourth:?}");
    let stats = chunks.stats();
    assert_eq!(stats.held_hits, fourth.planned_chunks, "{stats:?}");
    assert_eq!(stats.fetched, 0, "{stats:?}");
    assert!(planned.iter().all(|id| !chunks.is_held(id)));
}

/// Warmed pages are answered by the kernel, and only the files the job uses count as read:
/// the warmer's own listings do not, a file the job opens counts its warmed chunks, and a
/// warmed file the job leaves alone is wasted, as an unread prefetch is. Without warming, the
/// same reads reach the mount.
fn warming_serves_from_the_page_cache_and_records_only_what_the_job_opens(env: &Env) {
    let src = env.path("job");
    write_job_tree(&src);
    let chunk = 64 << 10;
    let images = env.images("cache-0");
    env.build(&images, &src, "job:v1", chunk);
    env.with_mount(&images, "job:v1", LazyConfig::default(), true, job);
    let per_file = (200u64 << 10).div_ceil(chunk as u64);
    let image = ImageRef::parse("job:v1").unwrap();

    for (i, warm) in [true, false].into_iter().enumerate() {
        let images = env.images(&format!("cache-{}", i + 1));
        let mp = tempfile::tempdir().unwrap();
        let cfg = LazyConfig {
            warm_page_cache: warm,
            ..LazyConfig::default()
        };
        let mut m = env
            .rt
            .block_on(images.mount(&image, mp.path(), cfg))
            .unwrap();
        env.rt.block_on(m.prefetch_done());
        let before = m.report();
        assert_eq!(before.chunks_read, 0, "warm {warm}: {before:?}");
        let want_warmed = if warm { HOT.len() as u64 } else { 0 };
        assert_eq!(before.warmed_files, want_warmed, "{before:?}");
        // The job opens two of the hot files and reads them whole.
        for (i, f) in HOT.iter().enumerate().take(2) {
            let data = std::fs::read(mp.path().join(f)).unwrap();
            assert_eq!(data, pattern(200 << 10, i as u64 + 1), "{f}");
        }
        let after = env.rt.block_on(m.unmount()).unwrap();
        assert_eq!(after.chunks_read, 2 * per_file, "warm {warm}: {after:?}");
        assert_eq!(after.hits, after.chunks_read, "warm {warm}: {after:?}");
        assert_eq!(
            after.wasted_chunks,
            (HOT.len() as u64 - 2) * per_file,
            "warm {warm}: {after:?}"
        );
        if warm {
            assert_eq!(after.reads, 0, "{after:?}");
        } else {
            assert!(after.reads >= 2, "{after:?}");
        }
    }
}

#[test]
fn warming_serves_from_the_page_cache_and_records_only_what_the_job_opens_local_directory() {
    warming_serves_from_the_page_cache_and_records_only_what_the_job_opens(&Env::local());
}

#[test]
fn record_then_prefetch_local_directory() {
    record_then_prefetch(&Env::local());
}

#[test]
fn record_then_prefetch_seaweedfs() {
    if let Some(env) = Env::seaweedfs("image-profile") {
        record_then_prefetch(&env);
    }
}

/// A damaged profile costs a mount its prefetch, never the mount, and that mount's unmount
/// replaces it with one made from its own trace, which the next mount replays.
#[test]
fn a_damaged_profile_costs_only_the_prefetch() {
    let env = Env::local();
    let images = job_image(&env);
    let image = ImageRef::parse("job:v1").unwrap();
    let key = image.artifacts().profile_key();
    env.rt
        .block_on(
            env.store
                .put(&key, Bytes::from_static(b"HSPROF\x01\x00not zstd")),
        )
        .unwrap();
    let ((), first) = env.with_mount(&images, "job:v1", LazyConfig::default(), true, job);
    assert_eq!((first.planned_chunks, first.hits), (0, 0), "{first:?}");
    assert_eq!(first.demand_fetches, first.chunks_read, "{first:?}");
    let images = env.images("cache-1");
    let ((), second) = env.with_mount(&images, "job:v1", LazyConfig::default(), true, job);
    assert_eq!(second.prefetched_chunks, first.chunks_read, "{second:?}");
    assert_eq!(second.demand_fetches, 0, "{second:?}");
    let (profile, runs) = env.rt.block_on(images.stats(&image)).unwrap();
    assert_eq!((profile.runs, runs.len()), (2, 2));
}

/// Without a profile, `fetch_all_without_profile` prefetches every chunk of the tree (behind
/// the job's reads): the first mount's job finds what it reads already fetched, the bytes are
/// the tree's, and only what the job read becomes the profile.
#[test]
fn a_first_mount_may_prefetch_the_whole_tree() {
    let env = Env::local();
    let images = job_image(&env);
    let image = ImageRef::parse("job:v1").unwrap();
    let (_, tree) = env.rt.block_on(images.open(&image)).unwrap();
    let cfg = LazyConfig {
        fetch_all_without_profile: true,
        ..LazyConfig::default()
    };
    let ((), first) = env.with_mount(&images, "job:v1", cfg.clone(), true, job);
    assert_eq!(
        first.planned_chunks,
        tree.chunk_ids().len() as u64,
        "{first:?}"
    );
    assert_eq!(
        first.prefetched_chunks + first.demand_fetches,
        first.planned_chunks,
        "{first:?}"
    );
    assert!(first.hits > 0, "{first:?}");
    // The profile holds what the job read, not the whole tree.
    let (profile, _) = env.rt.block_on(images.stats(&image)).unwrap();
    assert_eq!(profile.entries.len() as u64, first.chunks_read);
    assert!(first.chunks_read < first.planned_chunks, "{first:?}");
    // With a profile, the option changes nothing: the profile is replayed.
    let images = env.images("cache-1");
    let ((), second) = env.with_mount(&images, "job:v1", cfg, true, job);
    assert_eq!(
        second.planned_chunks,
        profile.entries.len() as u64,
        "{second:?}"
    );
}

/// A mount that reads nothing (its job never started) leaves the profile as it was, byte for
/// byte: it is not a run, and five of them do not decay the profile away.
#[test]
fn a_mount_that_reads_nothing_leaves_the_profile_alone() {
    let env = Env::local();
    let images = job_image(&env);
    let image = ImageRef::parse("job:v1").unwrap();
    let key = image.artifacts().profile_key();
    env.with_mount(&images, "job:v1", LazyConfig::default(), true, job);
    let recorded = env.rt.block_on(env.store.get(&key)).unwrap();
    for i in 0..5 {
        let images = env.images(&format!("cache-idle-{i}"));
        env.with_mount(&images, "job:v1", LazyConfig::default(), true, |_| {});
    }
    assert_eq!(env.rt.block_on(env.store.get(&key)).unwrap(), recorded);
    let (profile, runs) = env.rt.block_on(images.stats(&image)).unwrap();
    assert_eq!((profile.runs, runs.len()), (1, 6));
    assert!(!profile.entries.is_empty());
}

/// An image without any xattr tells the kernel so (overlayfs then stops asking for its
/// markers on every lookup in the layer): a getxattr is "not supported", not "no such
/// attribute", and the files read as usual.
#[test]
fn an_image_without_xattrs_says_it_has_none() {
    let env = Env::local();
    let images = job_image(&env);
    env.with_mount(&images, "job:v1", LazyConfig::default(), true, |mp| {
        let path =
            std::ffi::CString::new(mp.join(HOT[0]).into_os_string().into_encoded_bytes()).unwrap();
        let mut value = [0u8; 64];
        for _ in 0..2 {
            // SAFETY: NUL-terminated strings and a buffer valid for its length.
            let n = unsafe {
                libc::lgetxattr(
                    path.as_ptr(),
                    c"trusted.overlay.opaque".as_ptr(),
                    value.as_mut_ptr().cast(),
                    value.len(),
                )
            };
            assert_eq!(n, -1);
            assert_eq!(
                std::io::Error::last_os_error().raw_os_error(),
                Some(libc::EOPNOTSUPP)
            );
        }
        job(mp);
    });
}

/// A chunk of `a` whose stored bytes were replaced: reading `a` is EIO, `b` reads fine.
fn corrupt_chunk_is_eio(env: &Env) {
    let src = env.path("src");
    std::fs::create_dir_all(&src).unwrap();
    std::fs::write(src.join("a"), pattern(300 << 10, 1)).unwrap();
    std::fs::write(src.join("b"), pattern(300 << 10, 2)).unwrap();
    let images = env.images("cache");
    env.build(&images, &src, "bad:1", 64 << 10);
    let (_, tree) = env
        .rt
        .block_on(images.open(&ImageRef::parse("bad:1").unwrap()))
        .unwrap();
    let EntryKind::File { chunks, .. } = &tree.entries[0].kind else {
        panic!("a is a file");
    };
    let victim = chunks[2].id;
    let other = zstd::bulk::compress(&pattern(64 << 10, 7), 3).unwrap();
    env.rt
        .block_on(env.store.put(&victim.key(), Bytes::from(other)))
        .unwrap();
    let ((), report) = env.with_mount(&images, "bad:1", LazyConfig::default(), false, |mp| {
        let err = std::fs::read(mp.join("a")).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EIO), "{err}");
        // The chunks before the bad one read fine.
        let mut f = std::fs::File::open(mp.join("a")).unwrap();
        let mut head = vec![0u8; 128 << 10];
        std::io::Read::read_exact(&mut f, &mut head).unwrap();
        assert_eq!(head, pattern(300 << 10, 1)[..128 << 10]);
        assert_eq!(std::fs::read(mp.join("b")).unwrap(), pattern(300 << 10, 2));
    });
    assert!(report.chunks_read >= 7, "{report:?}");
}

#[test]
fn a_corrupt_chunk_is_eio_for_its_file_only_local_directory() {
    corrupt_chunk_is_eio(&Env::local());
}

#[test]
fn a_corrupt_chunk_is_eio_for_its_file_only_seaweedfs() {
    if let Some(env) = Env::seaweedfs("image-corrupt") {
        corrupt_chunk_is_eio(&env);
    }
}

#[test]
fn concurrent_readers_fetch_each_chunk_once_and_the_cache_stays_bounded() {
    let env = Env::local();
    let counter = Arc::new(Counter::default());
    let slow = Arc::new(Throttle::new(ThrottleConfig {
        latency: Duration::from_millis(50),
        ..ThrottleConfig::default()
    }));
    let store = env
        .store
        .wrap(|inner| counter.clone().wrap(slow.clone().wrap(inner)));
    let src = env.path("src");
    std::fs::create_dir_all(&src).unwrap();
    let data = pattern(1 << 20, 3);
    std::fs::write(src.join("shared.bin"), &data).unwrap();
    let cap = 256 << 10;
    let images = env.images_over(store, "cache", cap);
    env.build(&images, &src, "shared:1", 64 << 10);
    let cfg = LazyConfig {
        memory_cache: 128 << 10,
        ..LazyConfig::default()
    };
    let ((), report) = env.with_mount(&images, "shared:1", cfg, false, |mp| {
        counter.reset();
        std::thread::scope(|s| {
            for _ in 0..8 {
                s.spawn(|| assert!(std::fs::read(mp.join("shared.bin")).unwrap() == data));
            }
        });
        assert_eq!(counter.get(Op::Get).requests, 16, "one GET per chunk");
    });
    assert_eq!(report.chunks_read, 16);
    let cache = images.chunks().cache().unwrap();
    assert!(cache.bytes() <= cap, "{} > {cap}", cache.bytes());
}

/// Chunks fetched from a store elsewhere reach the node's disk cache (written in the background,
/// so they arrive shortly after the reads); a local-directory store's are not copied there.
#[test]
fn fetched_chunks_reach_the_disk_cache_unless_the_store_is_local() {
    let env = Env::local();
    let src = env.path("src");
    std::fs::create_dir_all(&src).unwrap();
    let data = pattern(1 << 20, 4);
    std::fs::write(src.join("lib.so"), &data).unwrap();
    // Any wrapper makes the store one the loader treats as remote.
    let remote = env
        .store
        .wrap(|inner| Arc::new(Counter::default()).wrap(inner));
    let images = env.images_over(remote, "cache-remote", 1 << 30);
    env.build(&images, &src, "lib:1", 64 << 10);
    let (_, tree) = env
        .rt
        .block_on(images.open(&ImageRef::parse("lib:1").unwrap()))
        .unwrap();
    let ids = tree.chunk_ids();
    assert_eq!(ids.len(), 16);
    let cache = images.chunks().cache().unwrap().clone();
    assert!(
        ids.iter().all(|id| !cache.contains(id)),
        "cached before any read"
    );
    let read = |images: &Images| {
        env.with_mount(images, "lib:1", LazyConfig::default(), false, |mp| {
            assert!(std::fs::read(mp.join("lib.so")).unwrap() == data);
        })
    };
    read(&images);
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !ids.iter().all(|id| cache.contains(id)) {
        assert!(
            std::time::Instant::now() < deadline,
            "fetched chunks never reached the cache"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // The cached copies are the verified bytes.
    for id in &ids {
        let bytes = cache.get_blocking(id).unwrap().unwrap();
        assert_eq!(hotstart_store::ChunkId::of(&bytes), *id);
    }

    let local = env.images("cache-local");
    read(&local);
    let cache = local.chunks().cache().unwrap();
    assert!(
        ids.iter().all(|id| !cache.contains(id)),
        "a local store's chunks were copied"
    );
}

/// A demand read of a chunk still queued for prefetch fetches it at once; the prefetcher finds
/// it settled when it gets there. (No FUSE: the loader and the replay directly.)
#[test]
fn a_demand_read_jumps_the_prefetch_queue() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let slow = Arc::new(Throttle::new(ThrottleConfig {
            latency: Duration::from_millis(100),
            ..ThrottleConfig::default()
        }));
        let store = Store::open("memory://").unwrap().wrap(|i| slow.wrap(i));
        let chunks = ChunkStore::new(store, ChunkStoreConfig::default()).unwrap();
        let data: Vec<Bytes> = (0..20).map(|i| Bytes::from(pattern(1000, i))).collect();
        let ids = chunks.put_many(data.clone()).await.unwrap();
        let loader = Arc::new(hotstart_image::Loader::new(chunks, 1 << 20));
        let plan: Vec<_> = ids.iter().map(|id| (*id, 1000)).collect();
        let one = PrefetchConfig {
            initial_window: 1,
            min_window: 1,
            max_window: 1,
            ..PrefetchConfig::default()
        };
        let (_stop, rx) = tokio::sync::watch::channel(false);
        let replay = tokio::spawn(hotstart_image::prefetch::replay(
            loader.clone(),
            plan,
            one,
            rx,
        ));
        // The last chunk of the plan, asked for while the prefetcher is on the first.
        let last = loader.demand(ids[19], 1000).await.unwrap();
        assert_eq!(last, data[19]);
        let stats = replay.await.unwrap();
        assert_eq!(
            stats.started, 19,
            "the prefetcher skipped the chunk read on demand"
        );
        let s = loader.stats();
        assert_eq!((s.demand_fetches, s.prefetched, s.wasted), (1, 19, 19));
    });
}
