//! Wrappers over the `ObjectStore` trait, for tests and benchmarks.
//!
//! One adapter, [`Intercepted`], forwards every call to the wrapped store and lets an
//! [`Interceptor`] act at two points: **before** each request (to delay it, fail it or count it)
//! and on the **body** of each GET (to pace, count, truncate or corrupt the bytes as they stream).
//! The three interceptors:
//!
//! - [`Throttle`]: added latency per request, a bandwidth cap per request and one for the total.
//! - [`Faults`]: fail the Nth call of a kind (or every call from then on), truncate or corrupt
//!   the bytes GETs return.
//! - [`Counter`]: requests and bytes by kind.
//!
//! ```no_run
//! # use std::sync::Arc;
//! # use hotstart_store::{Store, wrap::{Faults, Interceptor, Op}};
//! let store = Store::open("memory://").unwrap();
//! let faults = Arc::new(Faults::default());
//! let store = store.wrap(|inner| faults.clone().wrap(inner));
//! faults.fail_nth(Op::PutPart, 3); // the third part upload from now on fails
//! ```

mod counter;
mod faults;
mod throttle;

use std::fmt;
use std::ops::Range;
use std::sync::Arc;

use async_trait::async_trait;
use bytes::Bytes;
use futures::future::BoxFuture;
use futures::stream::{self, BoxStream};
use futures::{FutureExt, StreamExt};
use object_store::path::Path;
use object_store::{
    CopyOptions, GetOptions, GetResult, GetResultPayload, ListResult, MultipartUpload, ObjectMeta,
    ObjectStore, PutMultipartOptions, PutOptions, PutPayload, PutResult, RenameOptions, UploadPart,
};

pub use counter::{Counter, OpCount};
pub use faults::Faults;
pub use throttle::{Throttle, ThrottleConfig};

/// The kinds of request an interceptor sees.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Op {
    /// A GET with a body (whole object or a range).
    Get,
    /// A GET without a body (HEAD).
    Head,
    /// A single-request PUT.
    Put,
    /// Starting a multipart upload.
    MultipartStart,
    /// Uploading one part.
    PutPart,
    /// Completing a multipart upload (the object becomes visible).
    MultipartComplete,
    /// Aborting a multipart upload.
    MultipartAbort,
    /// A listing.
    List,
    /// Deleting one object.
    Delete,
    /// Copying or renaming an object.
    Copy,
}

impl Op {
    /// Every kind, for reports.
    pub const ALL: [Op; 10] = [
        Op::Get,
        Op::Head,
        Op::Put,
        Op::MultipartStart,
        Op::PutPart,
        Op::MultipartComplete,
        Op::MultipartAbort,
        Op::List,
        Op::Delete,
        Op::Copy,
    ];

    fn index(self) -> usize {
        self as usize
    }
}

/// What a wrapper does around each request. Both hooks default to doing nothing.
pub trait Interceptor: Send + Sync + fmt::Debug + 'static {
    /// Runs before a request of kind `op` carrying `bytes` of payload (0 for reads); an error
    /// fails the request without sending it.
    fn before(
        self: Arc<Self>,
        op: Op,
        path: &Path,
        bytes: u64,
    ) -> BoxFuture<'static, object_store::Result<()>> {
        let _ = (op, path, bytes);
        async { Ok(()) }.boxed()
    }

    /// Transforms the body of a GET of `range` of `path` as it streams.
    fn get_body(
        self: Arc<Self>,
        path: &Path,
        range: Range<u64>,
        body: BoxStream<'static, object_store::Result<Bytes>>,
    ) -> BoxStream<'static, object_store::Result<Bytes>> {
        let _ = (path, range);
        body
    }

    /// Wraps `inner` so every request passes through this interceptor.
    fn wrap(self: Arc<Self>, inner: Arc<dyn ObjectStore>) -> Arc<dyn ObjectStore>
    where
        Self: Sized,
    {
        Arc::new(Intercepted { inner, hook: self })
    }
}

/// An `ObjectStore` that passes every request through an [`Interceptor`].
#[derive(Debug)]
pub struct Intercepted<I> {
    inner: Arc<dyn ObjectStore>,
    hook: Arc<I>,
}

impl<I> fmt::Display for Intercepted<I> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Intercepted({})", self.inner)
    }
}

/// A generic error as object_store reports it, for injected failures.
pub(crate) fn injected(what: String) -> object_store::Error {
    object_store::Error::Generic {
        store: "fault-injection",
        source: what.into(),
    }
}

#[async_trait]
impl<I: Interceptor> ObjectStore for Intercepted<I> {
    async fn put_opts(
        &self,
        location: &Path,
        payload: PutPayload,
        opts: PutOptions,
    ) -> object_store::Result<PutResult> {
        self.hook
            .clone()
            .before(Op::Put, location, payload.content_length() as u64)
            .await?;
        self.inner.put_opts(location, payload, opts).await
    }

    async fn put_multipart_opts(
        &self,
        location: &Path,
        opts: PutMultipartOptions,
    ) -> object_store::Result<Box<dyn MultipartUpload>> {
        self.hook
            .clone()
            .before(Op::MultipartStart, location, 0)
            .await?;
        let upload = self.inner.put_multipart_opts(location, opts).await?;
        Ok(Box::new(InterceptedUpload {
            upload,
            hook: self.hook.clone(),
            path: location.clone(),
        }))
    }

    async fn get_opts(
        &self,
        location: &Path,
        options: GetOptions,
    ) -> object_store::Result<GetResult> {
        let op = if options.head { Op::Head } else { Op::Get };
        self.hook.clone().before(op, location, 0).await?;
        let res = self.inner.get_opts(location, options).await?;
        if op == Op::Head {
            return Ok(res);
        }
        let (meta, range) = (res.meta.clone(), res.range.clone());
        let (attributes, extensions) = (res.attributes.clone(), res.extensions.clone());
        let body = body_stream(res);
        Ok(GetResult {
            payload: GetResultPayload::Stream(self.hook.clone().get_body(
                location,
                range.clone(),
                body,
            )),
            meta,
            range,
            attributes,
            extensions,
        })
    }

    fn delete_stream(
        &self,
        locations: BoxStream<'static, object_store::Result<Path>>,
    ) -> BoxStream<'static, object_store::Result<Path>> {
        let hook = self.hook.clone();
        let checked = locations
            .then(move |p| {
                let hook = hook.clone();
                async move {
                    let p = p?;
                    hook.clone().before(Op::Delete, &p, 0).await?;
                    Ok(p)
                }
            })
            .boxed();
        self.inner.delete_stream(checked)
    }

    fn list(&self, prefix: Option<&Path>) -> BoxStream<'static, object_store::Result<ObjectMeta>> {
        let before = self
            .hook
            .clone()
            .before(Op::List, prefix.unwrap_or(&Path::default()), 0);
        let listing = self.inner.list(prefix);
        stream::once(async move {
            match before.await {
                Ok(()) => listing,
                Err(e) => stream::once(async move { Err(e) }).boxed(),
            }
        })
        .flatten()
        .boxed()
    }

    async fn list_with_delimiter(&self, prefix: Option<&Path>) -> object_store::Result<ListResult> {
        self.hook
            .clone()
            .before(Op::List, prefix.unwrap_or(&Path::default()), 0)
            .await?;
        self.inner.list_with_delimiter(prefix).await
    }

    async fn copy_opts(
        &self,
        from: &Path,
        to: &Path,
        options: CopyOptions,
    ) -> object_store::Result<()> {
        self.hook.clone().before(Op::Copy, to, 0).await?;
        self.inner.copy_opts(from, to, options).await
    }

    async fn rename_opts(
        &self,
        from: &Path,
        to: &Path,
        options: RenameOptions,
    ) -> object_store::Result<()> {
        self.hook.clone().before(Op::Copy, to, 0).await?;
        self.inner.rename_opts(from, to, options).await
    }
}

#[derive(Debug)]
struct InterceptedUpload<I> {
    upload: Box<dyn MultipartUpload>,
    hook: Arc<I>,
    path: Path,
}

#[async_trait]
impl<I: Interceptor> MultipartUpload for InterceptedUpload<I> {
    fn put_part(&mut self, data: PutPayload) -> UploadPart {
        // The part is numbered now, in call order; the hook runs before it is sent.
        let before =
            self.hook
                .clone()
                .before(Op::PutPart, &self.path, data.content_length() as u64);
        let part = self.upload.put_part(data);
        async move {
            before.await?;
            part.await
        }
        .boxed()
    }

    async fn complete(&mut self) -> object_store::Result<PutResult> {
        self.hook
            .clone()
            .before(Op::MultipartComplete, &self.path, 0)
            .await?;
        self.upload.complete().await
    }

    async fn abort(&mut self) -> object_store::Result<()> {
        self.hook
            .clone()
            .before(Op::MultipartAbort, &self.path, 0)
            .await?;
        self.upload.abort().await
    }
}

/// How much of a local file one read of a streamed body takes (see [`body_stream`]).
const FILE_PIECE: u64 = 1 << 20;

/// The body of `res` as a stream of pieces for the interceptors. A local-directory store's
/// body (a file) is read [`FILE_PIECE`] at a time on the blocking pool: object_store's own
/// stream of it reads 8 KiB per hand-off to that pool, which on a small node cost more CPU than
/// the bytes themselves.
fn body_stream(res: GetResult) -> BoxStream<'static, object_store::Result<Bytes>> {
    let (file, path) = match res.payload {
        GetResultPayload::Stream(s) => return s,
        GetResultPayload::File(file, path) => (Arc::new(file), path),
    };
    let fail = |source: std::io::Error| object_store::Error::Generic {
        store: "LocalFileSystem",
        source: Box::new(source),
    };
    stream::try_unfold(res.range, move |at| {
        let (file, path) = (file.clone(), path.clone());
        async move {
            if at.start >= at.end {
                return Ok(None);
            }
            let n = (at.end - at.start).min(FILE_PIECE);
            let piece = tokio::task::spawn_blocking(move || {
                use std::os::unix::fs::FileExt;
                let mut buf = vec![0u8; n as usize];
                file.read_exact_at(&mut buf, at.start).map_err(|e| {
                    std::io::Error::new(e.kind(), format!("read {}: {e}", path.display()))
                })?;
                Ok::<_, std::io::Error>(buf)
            })
            .await
            .map_err(|e| fail(std::io::Error::other(e)))?
            .map_err(fail)?;
            Ok(Some((Bytes::from(piece), at.start + n..at.end)))
        }
    })
    .boxed()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Store;
    use object_store::ObjectStoreExt;

    #[tokio::test]
    async fn a_wrapped_local_directory_streams_bodies_in_pieces_with_every_byte() {
        let dir = tempfile::tempdir().unwrap();
        let counter = Arc::new(Counter::default());
        let store = Store::open(dir.path().to_str().unwrap())
            .unwrap()
            .wrap(|inner| Interceptor::wrap(counter.clone(), inner));
        // Two and a half pieces, and ranges across and inside piece boundaries.
        let data: Vec<u8> = (0..(FILE_PIECE * 5 / 2 + 7))
            .map(|i| (i * 31 % 251) as u8)
            .collect();
        store.put("o", Bytes::from(data.clone())).await.unwrap();
        assert_eq!(&store.get("o").await.unwrap()[..], &data[..]);
        let len = data.len() as u64;
        for r in [
            0..1,
            3..FILE_PIECE + 5,
            FILE_PIECE..2 * FILE_PIECE,
            len - 9..len,
        ] {
            let path = Path::from("o");
            let got = store
                .object_store()
                .get_range(&path, r.clone())
                .await
                .unwrap();
            assert_eq!(&got[..], &data[r.start as usize..r.end as usize], "{r:?}");
        }
        let gets = counter.get(Op::Get);
        assert_eq!(gets.requests, 5);
        assert_eq!(gets.bytes, len + 1 + (FILE_PIECE + 2) + FILE_PIECE + 9);
    }
}
