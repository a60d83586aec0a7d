//! One conformance suite, run against every backend: memory, a local directory, and S3 on a real
//! SeaweedFS server started by the test harness.
//!
//! Each test is an `async fn(Store)`; the `conformance!` macro instantiates it once per backend.

mod common;

use std::sync::Arc;

use bytes::Bytes;
use futures::TryStreamExt;
use hotstart_store::chunk::ChunkStats;
use hotstart_store::wrap::{Counter, Faults, Interceptor, Op, Throttle, ThrottleConfig};
use hotstart_store::{
    ByteBudget, ChunkId, ChunkStore, ChunkStoreConfig, Error, Store, StripeConfig, StripedReader,
    StripedWriter, Tree,
};
use tokio::io::AsyncReadExt;

use common::{assert_trees_equal, pattern, sample_dir};

/// 5 MiB: the smallest part AWS S3 accepts, so every backend sees realistic multipart uploads.
const PART: usize = 5 << 20;

fn stripes(stripe_size: usize, max_in_flight: usize, budget: usize) -> StripeConfig {
    StripeConfig {
        stripe_size,
        max_in_flight,
        budget: ByteBudget::new(budget),
    }
}

async fn put_get_round_trip(store: Store) {
    for (i, size) in [0usize, 1, 1000, 1 << 20].into_iter().enumerate() {
        let key = format!("rt/obj-{i}");
        let data = pattern(size, i as u64);
        store.put(&key, data.clone()).await.unwrap();
        assert_eq!(store.get(&key).await.unwrap(), data, "size {size}");
        assert_eq!(store.size(&key).await.unwrap(), size as u64);
    }
    // Overwrite replaces the whole object.
    store
        .put("rt/obj-0", Bytes::from_static(b"new"))
        .await
        .unwrap();
    assert_eq!(
        store.get("rt/obj-0").await.unwrap(),
        Bytes::from_static(b"new")
    );
}

async fn ranges_and_missing_objects(store: Store) {
    let data = pattern(100_000, 7);
    store.put("range/obj", data.clone()).await.unwrap();
    let reader = StripedReader::open(&store, "range/obj", stripes(4096, 4, 1 << 20))
        .await
        .unwrap();
    assert_eq!(reader.size(), 100_000);
    for (off, len) in [
        (0u64, 1usize),
        (4095, 2),
        (50_000, 30_000),
        (99_999, 1),
        (100_000, 0),
    ] {
        let got = reader.read_at(off, len).await.unwrap();
        assert_eq!(
            got,
            data.slice(off as usize..off as usize + len),
            "{off}+{len}"
        );
    }
    assert!(matches!(
        reader.read_at(99_999, 2).await,
        Err(Error::OutOfRange { .. })
    ));
    let missing = StripedReader::open(&store, "range/none", StripeConfig::default()).await;
    assert!(
        matches!(missing, Err(Error::NotFound { .. })),
        "{missing:?}"
    );
    assert!(store.get("range/none").await.unwrap_err().is_not_found());
    assert!(!store.exists("range/none").await.unwrap());
}

async fn listed(store: &Store, prefix: &str) -> Vec<hotstart_store::ObjectInfo> {
    store.list(prefix).await.unwrap()
}

async fn put_if_absent_creates_once(store: Store) {
    let key = "commit/record";
    let racers: Vec<_> = (0..8u8)
        .map(|i| {
            let store = store.clone();
            tokio::spawn(async move {
                let won = store
                    .put_if_absent(key, Bytes::from(vec![i; 100]))
                    .await
                    .unwrap();
                (i, won)
            })
        })
        .collect();
    let mut winners = Vec::new();
    for r in racers {
        let (i, won) = r.await.unwrap();
        if won {
            winners.push(i);
        }
    }
    assert_eq!(winners.len(), 1, "exactly one writer creates the object");
    assert_eq!(
        store.get(key).await.unwrap(),
        Bytes::from(vec![winners[0]; 100]),
        "the object holds the winner's bytes"
    );
    assert!(
        !store
            .put_if_absent(key, Bytes::from_static(b"late"))
            .await
            .unwrap()
    );
    let listed = listed(&store, "commit").await;
    assert_eq!(listed.len(), 1);
    let age = std::time::SystemTime::now()
        .duration_since(listed[0].last_modified)
        .unwrap_or_default();
    assert!(age.as_secs() < 600, "last_modified is recent: {age:?}");
}

async fn list_and_delete(store: Store) {
    for key in ["ls/a/1", "ls/a/2", "ls/b/c/3", "other/4"] {
        store
            .put(key, Bytes::from(key.as_bytes().to_vec()))
            .await
            .unwrap();
    }
    let keys: Vec<String> = listed(&store, "ls")
        .await
        .into_iter()
        .map(|o| o.key)
        .collect();
    assert_eq!(keys, ["ls/a/1", "ls/a/2", "ls/b/c/3"]);
    let sizes: Vec<u64> = listed(&store, "ls/a")
        .await
        .into_iter()
        .map(|o| o.size)
        .collect();
    assert_eq!(sizes, [6, 6]);
    store.delete("ls/a/1").await.unwrap();
    store.delete("ls/a/1").await.unwrap(); // deleting twice is fine
    let keys: Vec<String> = listed(&store, "ls")
        .await
        .into_iter()
        .map(|o| o.key)
        .collect();
    assert_eq!(keys, ["ls/a/2", "ls/b/c/3"]);
}

async fn striped_write_then_read(store: Store) {
    let cfg = stripes(PART, 4, 64 << 20);
    for (i, size) in [0, 1, PART - 1, PART, PART + 1, PART * 3 + PART / 2]
        .into_iter()
        .enumerate()
    {
        let key = format!("striped/{i}");
        let data = pattern(size, 100 + i as u64);
        let mut w = StripedWriter::new(&store, &key, cfg.clone()).unwrap();
        // Uneven writes cross part boundaries.
        for piece in data.chunks(3 << 20) {
            w.write(piece).await.unwrap();
        }
        assert_eq!(w.finish().await.unwrap(), size as u64);
        // A plain GET sees exactly what was written.
        assert_eq!(store.get(&key).await.unwrap(), data, "size {size}");

        let r = StripedReader::open(&store, &key, stripes(1 << 20, 8, 4 << 20))
            .await
            .unwrap();
        let streamed: Vec<Bytes> = r.stream(0..size as u64).try_collect().await.unwrap();
        assert_eq!(Bytes::from(streamed.concat()), data);
        let mut via_async_read = Vec::new();
        r.clone()
            .into_async_read()
            .read_to_end(&mut via_async_read)
            .await
            .unwrap();
        assert_eq!(via_async_read, data);
        let mut buf = vec![0u8; size];
        r.read_into(0, &mut buf).await.unwrap();
        assert_eq!(buf, data);
    }
}

async fn striped_reads_hold_the_budget(store: Store) {
    let data = pattern(3 << 20, 3);
    store.put("budget/obj", data.clone()).await.unwrap();
    let budget = ByteBudget::new(256 << 10);
    let cfg = StripeConfig {
        stripe_size: 64 << 10,
        max_in_flight: 16,
        budget: budget.clone(),
    };
    // Several readers at once share one budget.
    let readers: Vec<_> = (0..4)
        .map(|_| {
            let store = store.clone();
            let cfg = cfg.clone();
            tokio::spawn(async move {
                let r = StripedReader::open(&store, "budget/obj", cfg)
                    .await
                    .unwrap();
                let parts: Vec<Bytes> = r.stream(0..r.size()).try_collect().await.unwrap();
                parts.concat()
            })
        })
        .collect();
    for r in readers {
        assert_eq!(r.await.unwrap(), data);
    }
    assert!(
        budget.peak() <= budget.capacity(),
        "{} > {}",
        budget.peak(),
        budget.capacity()
    );
    assert!(
        budget.peak() >= 128 << 10,
        "stripes ran in parallel: peak {}",
        budget.peak()
    );
    assert_eq!(budget.in_use(), 0);
}

async fn aborted_or_failed_uploads_leave_nothing(store: Store) {
    let cfg = stripes(PART, 2, 64 << 20);
    let data = pattern(PART * 3, 9);

    let mut w = StripedWriter::new(&store, "abort/explicit", cfg.clone()).unwrap();
    w.write(&data).await.unwrap();
    w.abort().await.unwrap();
    assert!(!store.exists("abort/explicit").await.unwrap());

    let faults = Arc::new(Faults::default());
    let faulty = store.wrap(|inner| faults.clone().wrap(inner));
    faults.fail_nth(Op::PutPart, 2);
    let mut w = StripedWriter::new(&faulty, "abort/failed-part", cfg.clone()).unwrap();
    let res = async {
        w.write(&data).await?;
        w.finish().await
    }
    .await;
    let err = res.unwrap_err();
    assert!(err.to_string().contains("injected failure"), "{err}");
    assert!(!store.exists("abort/failed-part").await.unwrap());

    faults.heal();
    faults.fail_nth(Op::MultipartComplete, 1);
    let mut w = StripedWriter::new(&faulty, "abort/failed-complete", cfg.clone()).unwrap();
    w.write(&data).await.unwrap();
    assert!(w.finish().await.is_err());
    assert!(!store.exists("abort/failed-complete").await.unwrap());

    // A failed single PUT (small object) leaves nothing either, and the store recovers.
    faults.heal();
    faults.fail_nth(Op::Put, 1);
    let mut w = StripedWriter::new(&faulty, "abort/small", cfg.clone()).unwrap();
    w.write(b"tiny").await.unwrap();
    assert!(w.finish().await.is_err());
    assert!(!store.exists("abort/small").await.unwrap());
    let mut w = StripedWriter::new(&faulty, "abort/small", cfg).unwrap();
    w.write(b"tiny").await.unwrap();
    w.finish().await.unwrap();
    assert_eq!(
        store.get("abort/small").await.unwrap(),
        Bytes::from_static(b"tiny")
    );
}

async fn truncated_and_corrupt_responses_are_errors(store: Store) {
    let data = pattern(1 << 20, 11);
    store.put("trunc/obj", data.clone()).await.unwrap();
    let faults = Arc::new(Faults::default());
    let faulty = store.wrap(|inner| faults.clone().wrap(inner));
    let r = StripedReader::open(&faulty, "trunc/obj", stripes(256 << 10, 4, 4 << 20))
        .await
        .unwrap();
    faults.truncate_gets(1);
    let err = r.read_at(0, 1 << 20).await.unwrap_err();
    assert!(matches!(err, Error::Truncated { .. }), "{err}");
    let err = r
        .stream(0..1 << 20)
        .try_collect::<Vec<_>>()
        .await
        .unwrap_err();
    assert!(matches!(err, Error::Truncated { .. }), "{err}");

    // Corrupted chunk bytes are detected, never handed out.
    faults.heal();
    let chunks = ChunkStore::new(store.clone(), ChunkStoreConfig::default()).unwrap();
    let id = chunks.put(pattern(300_000, 12)).await.unwrap();
    faults.corrupt_gets();
    let faulty_chunks = ChunkStore::new(faulty, ChunkStoreConfig::default()).unwrap();
    let err = faulty_chunks.get(&id).await.unwrap_err();
    assert!(err.is_corrupt(), "{err}");
    assert!(err.to_string().contains(&id.to_hex()), "{err}");
}

async fn chunks_dedup_verify_and_single_flight(store: Store) {
    let counter = Arc::new(Counter::default());
    let counted = store.wrap(|inner| counter.clone().wrap(inner));
    let chunks = ChunkStore::new(counted, ChunkStoreConfig::default()).unwrap();
    let data: Vec<Bytes> = (0..20)
        .map(|i| pattern(10_000 + i * 997, i as u64))
        .collect();
    let ids = chunks.put_many(data.clone()).await.unwrap();
    assert_eq!(ids, data.iter().map(|d| ChunkId::of(d)).collect::<Vec<_>>());
    assert_eq!(chunks.stats().uploaded, 20);
    // Stored under chunks/<2 hex>/<hex> as zstd frames.
    let key = ids[0].key();
    let frame = store.get(&key).await.unwrap();
    assert_eq!(&frame[..4], &[0x28, 0xb5, 0x2f, 0xfd], "zstd magic");

    // A second store on the same bucket sees the chunks as present and uploads nothing.
    let again = ChunkStore::new(store.clone(), ChunkStoreConfig::default()).unwrap();
    assert!(again.missing(&ids).await.unwrap().is_empty());
    again.put_many(data.clone()).await.unwrap();
    assert_eq!(
        again.stats(),
        ChunkStats {
            deduplicated: 20,
            ..Default::default()
        }
    );
    assert_eq!(again.get_many(&ids).await.unwrap(), data);

    // Sixteen concurrent readers of one chunk cause one GET (a slow link keeps them concurrent).
    let slow = Arc::new(Throttle::new(ThrottleConfig {
        latency: std::time::Duration::from_millis(300),
        ..Default::default()
    }));
    let fresh = ChunkStore::new(
        store.wrap(|inner| counter.clone().wrap(slow.wrap(inner))),
        ChunkStoreConfig::default(),
    )
    .unwrap();
    counter.reset();
    let readers: Vec<_> = (0..16)
        .map(|_| {
            let c = fresh.clone();
            let id = ids[5];
            tokio::spawn(async move { c.get(&id).await.unwrap() })
        })
        .collect();
    for r in readers {
        assert_eq!(r.await.unwrap(), data[5]);
    }
    assert_eq!(counter.get(Op::Get).requests, 1);

    // A chunk whose stored bytes were replaced is refused with the chunk's name.
    let other = zstd::bulk::compress(b"something else", 3).unwrap();
    store.put(&ids[7].key(), Bytes::from(other)).await.unwrap();
    let err = fresh.get(&ids[7]).await.unwrap_err();
    assert!(err.is_corrupt(), "{err}");
    assert!(err.to_string().contains(&ids[7].to_hex()));
    // A missing chunk is NotFound.
    let err = fresh.get(&ChunkId::of(b"never stored")).await.unwrap_err();
    assert!(err.is_not_found(), "{err}");
}

async fn chunk_cache_serves_repeat_reads(store: Store) {
    let cache_dir = tempfile::tempdir().unwrap();
    let counter = Arc::new(Counter::default());
    let cfg = ChunkStoreConfig {
        cache_dir: Some(cache_dir.path().to_path_buf()),
        cache_capacity: 1 << 20,
        ..Default::default()
    };
    let chunks = ChunkStore::new(store.wrap(|inner| counter.clone().wrap(inner)), cfg).unwrap();
    let data = pattern(200_000, 5);
    let id = chunks.put(data.clone()).await.unwrap();
    counter.reset();
    assert_eq!(chunks.get(&id).await.unwrap(), data);
    assert_eq!(chunks.get(&id).await.unwrap(), data);
    assert_eq!(counter.get(Op::Get).requests, 1);
    assert_eq!(chunks.stats().cache_hits, 1);
    assert!(chunks.cache().unwrap().file(&id).is_some());
}

async fn tree_round_trip(store: Store) {
    let src = tempfile::tempdir().unwrap();
    sample_dir(src.path());
    let chunks = ChunkStore::new(store.clone(), ChunkStoreConfig::default()).unwrap();
    let tree = Tree::build(src.path(), &chunks, 64 << 10).await.unwrap();
    store
        .put("trees/sample", tree.encode().unwrap())
        .await
        .unwrap();

    let decoded = Tree::decode(&store.get("trees/sample").await.unwrap()).unwrap();
    assert_eq!(decoded, tree);
    let dest = tempfile::tempdir().unwrap();
    let out = dest.path().join("restored");
    let fresh = ChunkStore::new(store.clone(), ChunkStoreConfig::default()).unwrap();
    decoded.materialize(&out, &fresh).await.unwrap();
    assert_trees_equal(src.path(), &out);
}

macro_rules! conformance {
    ($($name:ident),* $(,)?) => {
        mod memory {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $name() {
                    super::$name(hotstart_store::Store::open("memory://").unwrap()).await;
                }
            )*
        }
        mod local_dir {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $name() {
                    let dir = tempfile::tempdir().unwrap();
                    let url = format!("file://{}", dir.path().display());
                    super::$name(hotstart_store::Store::open(&url).unwrap()).await;
                }
            )*
        }
        mod s3_seaweedfs {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $name() {
                    let Some(store) = super::common::s3_store(stringify!($name)) else { return };
                    super::$name(store).await;
                }
            )*
        }
    };
}

conformance!(
    put_get_round_trip,
    ranges_and_missing_objects,
    list_and_delete,
    put_if_absent_creates_once,
    striped_write_then_read,
    striped_reads_hold_the_budget,
    aborted_or_failed_uploads_leave_nothing,
    truncated_and_corrupt_responses_are_errors,
    chunks_dedup_verify_and_single_flight,
    chunk_cache_serves_repeat_reads,
    tree_round_trip,
);
