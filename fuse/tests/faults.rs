//! Store failures seen through `StripedFs`: a failed upload is EIO at close/fsync with nothing
//! visible, a truncated response is EIO, never wrong bytes.

mod common;

use std::sync::Arc;

use hotstart_fuse::StripedFs;
use hotstart_store::Store;
use hotstart_store::wrap::{Faults, Interceptor, Op};

const ROOT: u64 = 1;

fn faulty() -> (StripedFs, Store, Arc<Faults>) {
    let plain = Store::open("memory://").unwrap();
    let faults = Arc::new(Faults::default());
    let store = plain.wrap(|inner| faults.clone().wrap(inner));
    (StripedFs::new(store, common::small_config()), plain, faults)
}

#[tokio::test]
async fn failed_part_upload_is_eio_at_close_and_nothing_is_visible() {
    for fsync in [false, true] {
        let (fs, plain, faults) = faulty();
        faults.fail_nth(Op::PutPart, 2);
        let (attr, fh) = fs.create(ROOT, "big", libc::O_WRONLY).await.unwrap();
        let data = hotstart_testkit::pattern(500_000, 1);
        let mut write_err = None;
        for (i, c) in data.chunks(50_000).enumerate() {
            if let Err(e) = fs.write(fh, (i * 50_000) as u64, c).await {
                write_err = Some(e.errno());
                break;
            }
        }
        let commit = if fsync {
            fs.fsync(fh).await
        } else {
            fs.flush(fh).await
        };
        let errno = commit.unwrap_err().errno();
        assert_eq!(errno, libc::EIO);
        assert!(write_err.is_none() || write_err == Some(libc::EIO));
        let _ = fs.release(fh).await;
        assert!(
            plain.get("big").await.unwrap_err().is_not_found(),
            "no partial object"
        );
        assert!(plain.list("").await.unwrap().is_empty());
        faults.heal();
        assert_eq!(
            fs.getattr(attr.ino).await.unwrap_err().errno(),
            libc::ENOENT
        );
    }
}

#[tokio::test]
async fn failed_small_put_is_eio_and_the_old_version_stays() {
    let (fs, plain, faults) = faulty();
    plain
        .put("f", bytes::Bytes::from_static(b"old"))
        .await
        .unwrap();
    let a = fs.lookup(ROOT, "f").await.unwrap();
    let fh = fs
        .open(a.ino, libc::O_WRONLY | libc::O_TRUNC)
        .await
        .unwrap();
    fs.write(fh, 0, b"new").await.unwrap();
    faults.fail_nth(Op::Put, 1);
    assert_eq!(fs.flush(fh).await.unwrap_err().errno(), libc::EIO);
    let _ = fs.release(fh).await;
    assert_eq!(plain.get("f").await.unwrap(), &b"old"[..]);
}

#[tokio::test]
async fn truncated_responses_are_eio_never_wrong_bytes() {
    let (fs, plain, faults) = faulty();
    let data = hotstart_testkit::pattern(300_000, 2);
    plain.put("f", data.clone().into()).await.unwrap();
    let a = fs.lookup(ROOT, "f").await.unwrap();
    faults.truncate_gets(7);
    // Sequential (read-ahead windows) and random (exact ranged GET) paths both fail cleanly.
    for offset in [0u64, 250_000] {
        let fh = fs.open(a.ino, libc::O_RDONLY).await.unwrap();
        let err = fs.read(fh, offset, 4096).await.unwrap_err();
        assert_eq!(err.errno(), libc::EIO, "{err}");
        fs.release(fh).await.unwrap();
    }
    faults.heal();
    let fh = fs.open(a.ino, libc::O_RDONLY).await.unwrap();
    let got = fs.read(fh, 0, 100_000).await.unwrap();
    assert_eq!(&got[..], &data[..100_000]);
    fs.release(fh).await.unwrap();
    assert_eq!(fs.budget().in_use(), 0);
}
