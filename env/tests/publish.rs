//! Publishing, deduplication and gc of snapshots, run against every backend: a local directory
//! and S3 on a real SeaweedFS server (and memory, the quickest).

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use hotstart_env::gc::{GcOptions, gc, list};
use hotstart_env::store_lock::{LockKind, LockTiming, StoreLock};
use hotstart_env::{
    EnvStore, Error, Key, KeyInputs, Platform, PythonInfo, RestoreOptions, capture, restore,
};
use hotstart_store::object_store::prefix::PrefixStore;
use hotstart_store::wrap::{Counter, Faults, Interceptor, Op};
use hotstart_store::{ChunkStoreConfig, Store};
use hotstart_testkit::{SeaweedFs, pattern};

fn inputs(tag: &str, target: &Path) -> KeyInputs {
    KeyInputs {
        locks: vec![hotstart_env::key::LockInput {
            name: "requirements.txt".into(),
            bytes: tag.len() as u64,
            blake3: blake3_hex(tag.as_bytes()),
        }],
        python: PythonInfo {
            implementation: "cpython".into(),
            version: "3.11.7".into(),
            soabi: "cpython-311-x86_64-linux-gnu".into(),
            abiflags: String::new(),
            base_prefix: "/usr".into(),
        },
        platform: Platform::current(),
        command: vec!["install".into()],
        target: Some(target.display().to_string()),
    }
}

fn blake3_hex(data: &[u8]) -> String {
    hotstart_store::ChunkId::of(data).to_hex()
}

/// An installed-looking directory: `shared` is the same in every call, `unique` is not.
fn env_dir(root: &Path, seed: u64) {
    std::fs::create_dir_all(root.join("lib/pkg")).unwrap();
    std::fs::create_dir_all(root.join("bin")).unwrap();
    std::fs::write(root.join("lib/pkg/shared.so"), pattern(3 << 20, 1)).unwrap();
    std::fs::write(root.join("lib/pkg/unique.py"), pattern(10_000, 100 + seed)).unwrap();
    std::fs::write(
        root.join("bin/tool"),
        format!("#!{}/bin/python\nimport pkg\n", root.display()),
    )
    .unwrap();
    std::os::unix::fs::symlink("python3", root.join("bin/python")).unwrap();
}

fn env_store(store: &Store) -> EnvStore {
    EnvStore::new(store, ChunkStoreConfig::default()).unwrap()
}

fn quick_locks() -> LockTiming {
    LockTiming {
        stale_after: Duration::from_secs(3600),
        capture_wait: Duration::from_millis(200),
        poll: Duration::from_millis(50),
    }
}

async fn keys_under(store: &Store, prefix: &str) -> Vec<String> {
    store
        .list(prefix)
        .await
        .unwrap()
        .into_iter()
        .map(|o| o.key)
        .collect()
}

/// A capture cut short at any request leaves no record, so nothing can restore it; the next
/// capture publishes it whole.
async fn a_capture_cut_short_is_never_used(store: Store) {
    let work = tempfile::tempdir().unwrap();
    let dir = work.path().join("venv");
    env_dir(&dir, 0);
    let inputs = inputs("cut", &dir);
    let key = inputs.key();

    // How many PUTs a whole capture makes, on a store of its own.
    let counter = Arc::new(Counter::default());
    let counted = Store::open("memory://")
        .unwrap()
        .wrap(|inner| counter.clone().wrap(inner));
    capture(&env_store(&counted), &key, &inputs, &dir, quick_locks())
        .await
        .unwrap();
    let puts = counter.get(Op::Put).requests;
    assert!(puts >= 7, "lock, chunks, pack, tree, record: {puts}");

    // Cut after the lock, in the middle of the chunks, at the tree, and at the record itself;
    // each on an empty part of the store, so every attempt makes the same requests.
    let mut env = None;
    for cut in [2, puts / 2, puts - 1, puts] {
        let faults = Arc::new(Faults::default());
        let faulty = store.wrap(|inner| {
            let part = Arc::new(PrefixStore::new(inner, format!("cut-{cut}")));
            faults.clone().wrap(part)
        });
        let e = env_store(&faulty);
        faults.fail_nth(Op::Put, cut);
        let err = capture(&e, &key, &inputs, &dir, quick_locks())
            .await
            .unwrap_err();
        assert!(matches!(err, Error::Store(_)), "cut at put {cut}: {err}");
        assert!(
            e.record(&key).await.unwrap().is_none(),
            "cut at put {cut}: a record exists"
        );
        assert!(keys_under(e.root(), "locks").await.is_empty());
        faults.heal();
        let done = capture(&e, &key, &inputs, &dir, quick_locks())
            .await
            .unwrap();
        assert!(done.won, "cut at put {cut}: the retry publishes");
        env = Some(e);
    }
    let env = env.unwrap();
    let record = env.record(&key).await.unwrap().expect("committed");
    let out = work.path().join("restored");
    restore(&env, &record, &out, false, &RestoreOptions::default())
        .await
        .unwrap();
    // Restored elsewhere, the script that named the capture path names the new one.
    assert_eq!(
        std::fs::read_to_string(out.join("bin/tool")).unwrap(),
        format!("#!{}/bin/python\nimport pkg\n", out.display())
    );
    for rel in ["lib/pkg/shared.so", "lib/pkg/unique.py"] {
        assert_eq!(
            std::fs::read(dir.join(rel)).unwrap(),
            std::fs::read(out.join(rel)).unwrap(),
            "{rel}"
        );
    }
}

/// A second snapshot sharing most bytes with the first uploads only what is new.
async fn snapshots_share_chunks(store: Store) {
    let work = tempfile::tempdir().unwrap();
    let env = env_store(&store);
    let (a, b) = (work.path().join("a"), work.path().join("b"));
    env_dir(&a, 1);
    env_dir(&b, 2);
    let first = capture(
        &env,
        &inputs("a", &a).key(),
        &inputs("a", &a),
        &a,
        quick_locks(),
    )
    .await
    .unwrap();
    assert!(first.won);

    let second = capture(
        &env,
        &inputs("b", &b).key(),
        &inputs("b", &b),
        &b,
        quick_locks(),
    )
    .await
    .unwrap();
    // shared.so's chunks are reused; unique.py and bin/tool are new.
    let shared = ((3 << 20) / hotstart_env::capture::CHUNK_SIZE) as u64;
    assert_eq!(second.deduplicated_chunks, shared, "{second:?}");
    assert_eq!(second.uploaded_chunks, 2, "{second:?}");
    // The record lists the files that name the capture path, for relocation.
    let refs: Vec<&str> = second
        .record
        .path_refs
        .iter()
        .map(|r| r.path.as_str())
        .collect();
    assert_eq!(refs, ["bin/tool"]);
    let listing = list(&env).await.unwrap();
    assert_eq!(listing.snapshots.len(), 2);
    assert!(listing.unreadable.is_empty());
}

/// gc deletes chosen snapshots, orphaned trees and chunks nothing uses, and nothing else.
async fn gc_keeps_what_snapshots_use(store: Store) {
    let work = tempfile::tempdir().unwrap();
    let env = env_store(&store);
    let (a, b) = (work.path().join("a"), work.path().join("b"));
    env_dir(&a, 1);
    env_dir(&b, 2);
    let (ka, kb) = (inputs("a", &a).key(), inputs("b", &b).key());
    capture(&env, &ka, &inputs("a", &a), &a, quick_locks())
        .await
        .unwrap();
    let rb = capture(&env, &kb, &inputs("b", &b), &b, quick_locks())
        .await
        .unwrap()
        .record;
    // An orphaned tree, as a capture that died before committing leaves it.
    let orphan = format!("snapshots/{}/tree-0123456789abcdef", Key([9; 32]));
    env.root()
        .put(&orphan, bytes::Bytes::from_static(b"HSTREE"))
        .await
        .unwrap();
    // Lazy mounts' artifacts beside each snapshot: a's go with it, b's stay.
    let (art_a, art_b) = (EnvStore::artifacts(&ka), EnvStore::artifacts(&kb));
    let artifact_keys = |dir: &hotstart_image::ArtifactDir| {
        [
            dir.profile_key(),
            dir.trace_key("run-1"),
            dir.run_key("run-0"),
        ]
    };
    for k in artifact_keys(&art_a).iter().chain(&artifact_keys(&art_b)) {
        env.root()
            .put(k, bytes::Bytes::from_static(b"artifact"))
            .await
            .unwrap();
    }
    let chunks_before = keys_under(env.root(), "chunks").await.len();
    let unique_a = hotstart_store::ChunkId::of(&pattern(10_000, 101)).key();
    assert!(
        env.chunks()
            .contains(&hotstart_store::ChunkId::of(&pattern(10_000, 101)))
            .await
            .unwrap()
    );

    // Nothing is collected while a capture holds its lock.
    let capturing = StoreLock::acquire(env.root(), LockKind::Capture, quick_locks())
        .await
        .unwrap();
    let opts = GcOptions {
        keys: vec![ka],
        grace: Duration::ZERO,
        lock_timing: quick_locks(),
        ..Default::default()
    };
    let err = gc(&env, &opts).await.unwrap_err();
    assert!(matches!(err, Error::Locked { .. }), "{err}");
    capturing.release().await;

    // A dry run reports and deletes nothing.
    let dry = gc(
        &env,
        &GcOptions {
            dry_run: true,
            ..opts.clone()
        },
    )
    .await
    .unwrap();
    assert_eq!(dry.snapshots, vec![ka.to_hex()]);
    assert_eq!(keys_under(env.root(), "chunks").await.len(), chunks_before);
    assert!(env.record(&ka).await.unwrap().is_some());

    let report = gc(&env, &opts).await.unwrap();
    assert_eq!(report.snapshots, vec![ka.to_hex()]);
    assert_eq!(report.kept, 1);
    assert_eq!(report.trees, 2, "a's tree and the orphan");
    assert_eq!(report.packs, 1, "a's pack");
    // a's unique.py and its bin/tool (which names a's path) are gone; shared.so stays.
    assert_eq!(report.chunks, 2, "{report:?}");
    assert!(env.record(&ka).await.unwrap().is_none());
    let chunks_left = keys_under(env.root(), "chunks").await;
    assert_eq!(chunks_left.len(), chunks_before - 2);
    assert!(!chunks_left.contains(&unique_a));
    let snapshots_left = keys_under(env.root(), "snapshots").await;
    assert!(!snapshots_left.contains(&orphan));
    assert_eq!(report.artifacts, 3, "{report:?}");
    for k in artifact_keys(&art_a) {
        assert!(!snapshots_left.contains(&k), "{k} outlived its snapshot");
    }
    for k in artifact_keys(&art_b) {
        assert!(
            snapshots_left.contains(&k),
            "{k} of a kept snapshot was deleted"
        );
    }

    // b still restores whole.
    let out = work.path().join("b-again");
    restore(&env, &rb, &out, false, &RestoreOptions::default())
        .await
        .unwrap();
    assert_eq!(
        std::fs::read(b.join("lib/pkg/shared.so")).unwrap(),
        std::fs::read(out.join("lib/pkg/shared.so")).unwrap()
    );

    // With the default grace period, fresh unreferenced objects are kept.
    env.root()
        .put(&orphan, bytes::Bytes::from_static(b"HSTREE"))
        .await
        .unwrap();
    let report = gc(
        &env,
        &GcOptions {
            lock_timing: quick_locks(),
            ..Default::default()
        },
    )
    .await
    .unwrap();
    assert_eq!((report.trees, report.chunks), (0, 0), "{report:?}");
}

/// Every regular file under `root` and its bytes, by relative path.
fn files_of(root: &Path) -> std::collections::BTreeMap<String, Vec<u8>> {
    let mut out = std::collections::BTreeMap::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let meta = std::fs::symlink_metadata(&path).unwrap();
            if meta.is_dir() {
                stack.push(path);
            } else if meta.is_file() {
                let rel = path.strip_prefix(root).unwrap().display().to_string();
                out.insert(rel, std::fs::read(&path).unwrap());
            }
        }
    }
    out
}

/// A remote store's restore takes the chunks from the snapshot's pack in a few requests; a pack
/// that is corrupt, cut short or gone is not trusted, and the restore fetches what it lacks
/// chunk by chunk, always ending with the captured bytes.
async fn chunks_come_from_the_pack_and_a_bad_pack_is_not_trusted(store: Store) {
    let work = tempfile::tempdir().unwrap();
    let dir = work.path().join("venv");
    env_dir(&dir, 3);
    // Forty small modules, two of them identical (one chunk in the pack).
    for i in 0..40u64 {
        let j = i.min(38);
        let body = pattern(500 + 97 * j as usize, 1000 + j);
        std::fs::write(dir.join(format!("lib/pkg/m{i}.py")), body).unwrap();
    }
    let inputs = inputs("pack", &dir);
    let key = inputs.key();
    let env = env_store(&store);
    let record = capture(&env, &key, &inputs, &dir, quick_locks())
        .await
        .unwrap()
        .record;
    // unique.py, bin/tool, 39 distinct modules and shared.so's 256 KiB chunks.
    let pack = record.pack.clone().expect("the snapshot has chunks");
    let large = ((3 << 20) / hotstart_env::capture::CHUNK_SIZE) as u64;
    assert_eq!(record.chunks, 41 + large);
    assert_eq!(pack.chunks, record.chunks, "{pack:?}");
    let want = files_of(&dir);

    // Each restore on a node of its own: an empty chunk cache, its requests counted.
    let remote = !store.is_local();
    let packed =
        hotstart_store::ChunkId::of(&std::fs::read(dir.join("lib/pkg/unique.py")).unwrap());
    let run = |name: &'static str| {
        let (store, record, work, want) = (
            store.clone(),
            record.clone(),
            work.path().to_path_buf(),
            &want,
        );
        async move {
            let counter = Arc::new(Counter::default());
            // (A wrapped store is not a local directory any more: only remote ones are wrapped.)
            let counted = if store.is_local() {
                store.clone()
            } else {
                store.wrap(|inner| counter.clone().wrap(inner))
            };
            let env = EnvStore::new(
                &counted,
                ChunkStoreConfig {
                    cache_dir: Some(work.join(format!("cache-{name}"))),
                    ..Default::default()
                },
            )
            .unwrap();
            let out = work.join(name);
            let report = restore(&env, &record, &out, false, &RestoreOptions::default())
                .await
                .unwrap();
            // bin/tool names the new path (relocated); every other file is byte for byte the same.
            let mut got = files_of(&out);
            got.remove("bin/tool");
            let mut expected = want.clone();
            expected.remove("bin/tool");
            assert_eq!(got, expected, "{name}");
            assert!(
                !env.chunks().is_held(&packed),
                "{name}: released after the restore"
            );
            (report, counter.get(Op::Get).requests)
        }
    };

    let (whole, gets) = run("whole").await;
    if remote {
        assert_eq!(whole.packed_chunks, pack.chunks, "{whole:?}");
        assert_eq!(whole.fetched_chunks, 0, "none one by one");
        // The tree, then the pack's index and its ranges of frames of up to 4 MiB (the caller
        // read the record).
        assert_eq!(gets, 1 + whole.pack_requests, "{whole:?}");
        assert!(
            whole.pack_requests <= 2 + pack.size / (4 << 20),
            "{whole:?}"
        );
    } else {
        assert_eq!(whole.packed_chunks, 0, "a local directory needs no pack");
    }

    // A flipped byte in the last frame: that chunk alone is fetched on its own.
    let original = env.root().get(&pack.object).await.unwrap();
    let mut bad = original.to_vec();
    let at = bad.len() - 5;
    bad[at] ^= 0x40;
    env.root().put(&pack.object, bad.into()).await.unwrap();
    let (flipped, _) = run("flipped").await;
    if remote {
        // Every frame is held; the flipped one is found out when read, and fetched again.
        assert_eq!(flipped.packed_chunks, pack.chunks, "{flipped:?}");
        assert_eq!(flipped.fetched_chunks, 1, "{flipped:?}");
    }

    // Cut short, then gone: everything comes chunk by chunk.
    env.root()
        .put(&pack.object, original.slice(..original.len() / 2))
        .await
        .unwrap();
    // (Two files with one chunk may each fetch it: at least every distinct chunk is fetched.)
    let (cut, _) = run("cut").await;
    if remote {
        assert!(cut.packed_chunks < pack.chunks, "{cut:?}");
        assert!(cut.fetched_chunks > 0, "{cut:?}");
        assert!(
            cut.packed_chunks + cut.fetched_chunks >= pack.chunks,
            "{cut:?}"
        );
    } else {
        assert!(cut.fetched_chunks >= 41 + large, "{cut:?}");
    }
    env.root().delete(&pack.object).await.unwrap();
    let (gone, _) = run("gone").await;
    assert_eq!(gone.packed_chunks, 0, "{gone:?}");
    assert!(gone.fetched_chunks >= 41 + large, "{gone:?}");

    // A record that names a pack outside its own snapshot is refused.
    let mut hostile = record.clone();
    hostile.pack.as_mut().unwrap().object = format!("snapshots/{}/pack-0", Key([7; 32]));
    env.root()
        .put(
            &EnvStore::record_key(&key),
            serde_json::to_vec(&hostile).unwrap().into(),
        )
        .await
        .unwrap();
    let err = env.record(&key).await.unwrap_err();
    assert!(matches!(err, Error::BadSnapshot { .. }), "{err}");
}

macro_rules! backends {
    ($($name:ident),* $(,)?) => {
        mod memory {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(hotstart_store::Store::open("memory://").unwrap()).await;
                }
            )*
        }
        mod local_dir {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let dir = tempfile::tempdir().unwrap();
                    let url = format!("file://{}", dir.path().display());
                    super::$name(hotstart_store::Store::open(&url).unwrap()).await;
                }
            )*
        }
        mod s3_seaweedfs {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let Some(weed) = super::SeaweedFs::shared() else { return };
                    let bucket = weed.fresh_bucket(&stringify!($name).replace('_', "-"));
                    let store = hotstart_store::Store::open_with(
                        &format!("{bucket}/envs-test"),
                        &weed.client_options(),
                    )
                    .unwrap();
                    super::$name(store).await;
                }
            )*
        }
    };
}

backends!(
    a_capture_cut_short_is_never_used,
    snapshots_share_chunks,
    gc_keeps_what_snapshots_use,
    chunks_come_from_the_pack_and_a_bad_pack_is_not_trusted,
);
