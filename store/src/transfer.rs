//! Copying whole files between the local file system and a store, striped both ways.
//!
//! Object locations are URLs whose path names the object: `s3://bucket/dir/file` is object
//! `dir/file` in `s3://bucket`, and `file:///data/store/x` is object `data/store/x` under `/`.
//! Downloads are written to a temporary file beside the destination, synced, then renamed, so an
//! interrupted copy never leaves a partial file under the destination's name.

use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use futures::StreamExt;

use crate::error::{Error, Result};
use crate::striped::{StripeConfig, StripedReader, StripedWriter};
use crate::url::{Store, StoreUrl};

/// An object named by a URL: the store holding it and its key there.
#[derive(Debug, Clone)]
pub struct ObjectUrl {
    pub store: Store,
    pub key: String,
    /// The URL of the store root, ending in `/`: `base + key` names the object.
    pub base: String,
}

/// Whether `s` is a URL (has a scheme) rather than a local path.
pub fn is_url(s: &str) -> bool {
    s.contains("://")
}

impl ObjectUrl {
    /// Splits a URL into store root and object key; the key may be empty (the whole store).
    pub fn parse(url: &str) -> Result<ObjectUrl> {
        let bad = |reason: &str| Error::InvalidUrl {
            url: url.to_string(),
            reason: reason.to_string(),
        };
        let (root, key) = match StoreUrl::parse(url)? {
            StoreUrl::Local { root } => {
                if !root.is_absolute() {
                    return Err(bad("give an absolute file:// URL"));
                }
                let key = root.to_string_lossy().trim_start_matches('/').to_string();
                (StoreUrl::Local { root: "/".into() }, key)
            }
            StoreUrl::Memory { .. } => {
                return Err(bad("memory:// stores live only inside one process"));
            }
            StoreUrl::S3 { bucket, prefix } => (
                StoreUrl::S3 {
                    bucket,
                    prefix: String::new(),
                },
                prefix,
            ),
            StoreUrl::Gcs { bucket, prefix } => (
                StoreUrl::Gcs {
                    bucket,
                    prefix: String::new(),
                },
                prefix,
            ),
            StoreUrl::Azure { container, prefix } => (
                StoreUrl::Azure {
                    container,
                    prefix: String::new(),
                },
                prefix,
            ),
        };
        let base = match &root {
            StoreUrl::Local { .. } => "file:///".to_string(),
            other => format!("{other}/"),
        };
        Ok(ObjectUrl {
            store: root.open()?,
            key,
            base,
        })
    }
}

/// Uploads the local file `src` to `key`, calling `progress` with the bytes sent so far.
pub async fn upload_file(
    src: &Path,
    store: &Store,
    key: &str,
    cfg: StripeConfig,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<u64> {
    let stripe = cfg.effective_stripe();
    let mut file = std::fs::File::open(src).map_err(|e| Error::io("open", src, e))?;
    if file.metadata().map(|m| m.is_dir()).unwrap_or(false) {
        return Err(Error::io(
            "upload",
            src,
            std::io::Error::new(
                std::io::ErrorKind::IsADirectory,
                "is a directory; this copies one file (a directory tree goes up as a lazy \
                 image: `hotstart image build`)",
            ),
        ));
    }
    let mut writer = StripedWriter::new(store, key, cfg)?;
    // Read the next stripe on the blocking pool while the writer uploads the previous ones.
    let (tx, mut rx) = tokio::sync::mpsc::channel::<std::io::Result<Vec<u8>>>(2);
    let reader = tokio::task::spawn_blocking(move || {
        loop {
            let mut buf = vec![0u8; stripe];
            let mut n = 0;
            while n < stripe {
                match file.read(&mut buf[n..]) {
                    Ok(0) => break,
                    Ok(k) => n += k,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                    Err(e) => {
                        let _ = tx.blocking_send(Err(e));
                        return;
                    }
                }
            }
            buf.truncate(n);
            if n == 0 || tx.blocking_send(Ok(buf)).is_err() || n < stripe {
                return;
            }
        }
    });
    while let Some(buf) = rx.recv().await {
        let buf = match buf {
            Ok(b) => b,
            Err(e) => {
                writer.abort().await?;
                return Err(Error::io("read", src, e));
            }
        };
        writer.write_bytes(bytes::Bytes::from(buf)).await?;
        progress(writer.written());
    }
    reader.await.map_err(|e| Error::task("file read", e))?;
    writer.finish().await
}

/// Downloads `key` to the local file `dst` (atomically), calling `progress` with bytes so far.
pub async fn download_file(
    store: &Store,
    key: &str,
    dst: &Path,
    cfg: StripeConfig,
    progress: &(dyn Fn(u64) + Sync),
) -> Result<u64> {
    let reader = StripedReader::open(store, key, cfg).await?;
    let tmp = temp_beside(dst);
    // Named after the destination: the temporary file beside it is not the user's concern.
    let file = std::fs::File::create(&tmp).map_err(|e| Error::io("create", dst, e))?;
    // Stripes are written on the blocking pool while the next ones download.
    let (tx, mut rx) = tokio::sync::mpsc::channel::<bytes::Bytes>(4);
    let tmp_w = tmp.clone();
    let writer = tokio::task::spawn_blocking(move || -> Result<()> {
        let mut file = file;
        while let Some(bytes) = rx.blocking_recv() {
            file.write_all(&bytes)
                .map_err(|e| Error::io("write", &tmp_w, e))?;
        }
        file.sync_data().map_err(|e| Error::io("sync", &tmp_w, e))
    });
    let fetched = async {
        let mut done = 0u64;
        let mut stripes = reader.stream(0..reader.size());
        while let Some(bytes) = stripes.next().await {
            let bytes = bytes?;
            done += bytes.len() as u64;
            if tx.send(bytes).await.is_err() {
                break; // the writer failed; its error is reported below
            }
            progress(done);
        }
        drop(tx);
        Ok::<_, Error>(done)
    }
    .await;
    let written = writer.await.map_err(|e| Error::task("file write", e));
    let res = match (fetched, written) {
        (Ok(done), Ok(Ok(()))) => std::fs::rename(&tmp, dst)
            .map(|()| done)
            .map_err(|e| Error::io("rename into place", dst, e)),
        (Err(e), _) | (_, Err(e)) | (_, Ok(Err(e))) => Err(e),
    };
    if res.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    res
}

fn temp_beside(dst: &Path) -> PathBuf {
    let name = dst
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    dst.with_file_name(format!(".{name}.hotstart-{}.tmp", std::process::id()))
}
