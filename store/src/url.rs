//! Store URLs and the [`Store`] handle.
//!
//! A [`StoreUrl`] names where objects live; [`Store`] is that backend opened, with the URL's
//! prefix applied, so keys used through it are relative (`job/step-3/rank-0.manifest.json`).
//!
//! | URL | backend |
//! |---|---|
//! | `/abs/path`, `rel/path`, `file:///abs/path` | a local directory (created if missing): the embedded default |
//! | `memory://` | an in-process map, for unit tests |
//! | `s3://bucket[/prefix]` | S3 or any S3-compatible server; endpoint, region, credentials and `AWS_ALLOW_HTTP` from the standard `AWS_*` variables |
//! | `gs://bucket[/prefix]` | Google Cloud Storage (feature `gcp`), `GOOGLE_*` variables |
//! | `az://container[/prefix]` | Azure Blob Storage (feature `azure`), `AZURE_*` variables |

use std::fmt;
use std::sync::Arc;

use bytes::Bytes;
use futures::TryStreamExt;
use object_store::path::Path as ObjectPath;
use object_store::prefix::PrefixStore;
use object_store::{ObjectStore, ObjectStoreExt, PutPayload};

use crate::error::{Error, Result};

/// A parsed store URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum StoreUrl {
    /// A local directory.
    Local { root: std::path::PathBuf },
    /// The in-process memory store.
    Memory { prefix: String },
    /// An S3-compatible bucket.
    S3 { bucket: String, prefix: String },
    /// A Google Cloud Storage bucket.
    Gcs { bucket: String, prefix: String },
    /// An Azure Blob Storage container.
    Azure { container: String, prefix: String },
}

impl StoreUrl {
    /// Parses a store URL; the error names the URL and says what is wrong with it.
    pub fn parse(url: &str) -> Result<StoreUrl> {
        let bad = |reason: &str| Error::InvalidUrl {
            url: url.to_string(),
            reason: reason.to_string(),
        };
        if url.is_empty() {
            return Err(bad(
                "empty; give a directory, file://, memory:// or s3:// URL",
            ));
        }
        let Some((scheme, rest)) = url.split_once("://") else {
            // A plain path: the embedded default.
            return Ok(StoreUrl::Local { root: url.into() });
        };
        let (bucket, prefix) = match rest.split_once('/') {
            Some((b, p)) => (b, p.trim_matches('/')),
            None => (rest, ""),
        };
        if prefix.split('/').any(|c| c == "." || c == "..") {
            return Err(bad("the prefix may not contain '.' or '..' components"));
        }
        let need_bucket = |what: &str| -> Result<String> {
            if bucket.is_empty() {
                return Err(bad(&format!("missing {what} name after {scheme}://")));
            }
            Ok(bucket.to_string())
        };
        match scheme {
            "file" => {
                if !rest.starts_with('/') {
                    return Err(bad(
                        "file:// URLs take an absolute path (file:///data/store)",
                    ));
                }
                Ok(StoreUrl::Local { root: rest.into() })
            }
            "memory" => Ok(StoreUrl::Memory {
                prefix: rest.trim_matches('/').to_string(),
            }),
            "s3" | "s3a" => Ok(StoreUrl::S3 {
                bucket: need_bucket("bucket")?,
                prefix: prefix.to_string(),
            }),
            "gs" => Ok(StoreUrl::Gcs {
                bucket: need_bucket("bucket")?,
                prefix: prefix.to_string(),
            }),
            "az" | "azure" => Ok(StoreUrl::Azure {
                container: need_bucket("container")?,
                prefix: prefix.to_string(),
            }),
            other => Err(bad(&format!(
                "unknown scheme {other:?}; expected a path, file://, memory://, s3://, gs:// or az://"
            ))),
        }
    }

    /// Opens the backend this URL names, configured from the environment.
    pub fn open(&self) -> Result<Store> {
        self.open_with(&[])
    }

    /// Opens the backend with explicit options that override the environment: object_store
    /// configuration keys such as `aws_endpoint`, `aws_allow_http`, `aws_access_key_id`.
    pub fn open_with(&self, options: &[(String, String)]) -> Result<Store> {
        let label = self.to_string();
        let mut local = None;
        let (inner, prefix): (Arc<dyn ObjectStore>, &str) = match self {
            StoreUrl::Local { root } => {
                std::fs::create_dir_all(root)
                    .map_err(|e| Error::io("create store directory", root, e))?;
                let fs = object_store::local::LocalFileSystem::new_with_prefix(root)
                    .map_err(|e| Error::InvalidUrl {
                        url: label.clone(),
                        reason: e.to_string(),
                    })?
                    .with_automatic_cleanup(true);
                let fs = Arc::new(fs);
                local = Some(Local {
                    fs: fs.clone(),
                    prefix: String::new(),
                    dir: root.clone(),
                });
                (fs, "")
            }
            StoreUrl::Memory { prefix } => {
                (Arc::new(object_store::memory::InMemory::new()), prefix)
            }
            StoreUrl::S3 { bucket, prefix } => (open_s3(&label, bucket, options)?, prefix),
            StoreUrl::Gcs { bucket, prefix } => (open_gcs(&label, bucket)?, prefix),
            StoreUrl::Azure { container, prefix } => (open_azure(&label, container)?, prefix),
        };
        let inner: Arc<dyn ObjectStore> = if prefix.is_empty() {
            inner
        } else {
            Arc::new(PrefixStore::new(inner, prefix))
        };
        Ok(Store {
            inner,
            label: label.into(),
            prefix: "".into(),
            local,
        })
    }
}

impl fmt::Display for StoreUrl {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let join = |f: &mut fmt::Formatter<'_>, scheme: &str, b: &str, p: &str| {
            if p.is_empty() {
                write!(f, "{scheme}://{b}")
            } else {
                write!(f, "{scheme}://{b}/{p}")
            }
        };
        match self {
            StoreUrl::Local { root } => write!(f, "{}", root.display()),
            StoreUrl::Memory { prefix } => write!(f, "memory://{prefix}"),
            StoreUrl::S3 { bucket, prefix } => join(f, "s3", bucket, prefix),
            StoreUrl::Gcs { bucket, prefix } => join(f, "gs", bucket, prefix),
            StoreUrl::Azure { container, prefix } => join(f, "az", container, prefix),
        }
    }
}

#[cfg(feature = "aws")]
fn open_s3(url: &str, bucket: &str, options: &[(String, String)]) -> Result<Arc<dyn ObjectStore>> {
    use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
    let mut builder = AmazonS3Builder::from_env().with_bucket_name(bucket);
    let mut chosen = std::env::var_os("AWS_UNSIGNED_PAYLOAD").is_some();
    for (key, value) in options {
        let key: AmazonS3ConfigKey =
            key.to_ascii_lowercase()
                .parse()
                .map_err(|e| Error::InvalidUrl {
                    url: url.to_string(),
                    reason: format!("option {key:?}: {e}"),
                })?;
        chosen |= key == AmazonS3ConfigKey::UnsignedPayload;
        builder = builder.with_config(key, value);
    }
    let endpoint = builder.get_config_value(&AmazonS3ConfigKey::Endpoint);
    let allow_http = builder.get_config_value(&AmazonS3ConfigKey::Client(
        object_store::ClientConfigKey::AllowHttp,
    ));
    let refused = endpoint
        .as_deref()
        .filter(|e| !over_tls(Some(e)) && !allow_http.as_deref().is_some_and(truthy));
    if let Some(endpoint) = refused {
        // Refused here, not by each request later as an "HTTP error: builder error".
        return Err(Error::InvalidUrl {
            url: url.to_string(),
            reason: format!(
                "the endpoint {endpoint} is plain HTTP, which the S3 client refuses unless \
                 AWS_ALLOW_HTTP=true is set: set it (credentials and data then cross the \
                 network unencrypted), or use an https:// endpoint"
            ),
        });
    }
    if !chosen && over_tls(endpoint.as_deref()) {
        builder = builder.with_unsigned_payload(true);
    }
    built(url, builder.with_retry(remote_retry()).build())
}

/// A remote store's client retries a request that failed on the way (a refused or dropped
/// connection, a 5xx, 429 or 408 answer, a read that timed out) at most this many times...
pub const REMOTE_RETRIES: usize = 10;
/// ... with jittered backoff that starts at 100 ms and grows to at most this...
pub const REMOTE_MAX_BACKOFF: std::time::Duration = std::time::Duration::from_secs(2);
/// ... and not once this long has passed since its first attempt. What outlasts that reaches
/// the caller, which does not retry it again ([`Error::is_transient`]): a store that refuses
/// connections is reported in a few seconds, one that answers errors in at most this plus the
/// last request's time, never minutes.
pub const REMOTE_RETRY_FOR: std::time::Duration = std::time::Duration::from_secs(10);

/// A remote store's client as built, or why it could not be.
#[cfg(any(feature = "aws", feature = "gcp", feature = "azure"))]
fn built<S: ObjectStore>(
    url: &str,
    client: object_store::Result<S>,
) -> Result<Arc<dyn ObjectStore>> {
    let client = client.map_err(|e| Error::InvalidUrl {
        url: url.to_string(),
        reason: e.to_string(),
    })?;
    Ok(Arc::new(client))
}

#[cfg(any(feature = "aws", feature = "gcp", feature = "azure"))]
fn remote_retry() -> object_store::RetryConfig {
    object_store::RetryConfig {
        backoff: object_store::BackoffConfig {
            max_backoff: REMOTE_MAX_BACKOFF,
            ..Default::default()
        },
        max_retries: REMOTE_RETRIES,
        retry_timeout: REMOTE_RETRY_FOR,
    }
}

/// Whether requests to this S3 endpoint go over TLS (no endpoint: AWS itself, over https).
///
/// There, request bodies are sent unsigned (`UNSIGNED-PAYLOAD`) unless `aws_unsigned_payload`
/// says otherwise: TLS already protects every byte in transit, and a signed body costs a SHA-256
/// pass over every uploaded byte in this process and another in the server (on a 2-core machine
/// with the server alongside, writes through the S3 gateway ran 8–35% faster unsigned). Over
/// plain HTTP the signature's hash is the only check the server makes of a body, so it stays.
#[cfg_attr(not(feature = "aws"), allow(dead_code))]
fn over_tls(endpoint: Option<&str>) -> bool {
    endpoint.is_none_or(|e| e.trim().to_ascii_lowercase().starts_with("https://"))
}

/// A true value of an object_store boolean option, as it parses them.
#[cfg(feature = "aws")]
fn truthy(v: &str) -> bool {
    matches!(
        v.trim().to_ascii_lowercase().as_str(),
        "1" | "true" | "on" | "yes" | "y"
    )
}

#[cfg(not(feature = "aws"))]
fn open_s3(
    url: &str,
    _bucket: &str,
    _options: &[(String, String)],
) -> Result<Arc<dyn ObjectStore>> {
    Err(not_built(url, "aws"))
}

#[cfg(feature = "gcp")]
fn open_gcs(url: &str, bucket: &str) -> Result<Arc<dyn ObjectStore>> {
    let gcs = object_store::gcp::GoogleCloudStorageBuilder::from_env()
        .with_bucket_name(bucket)
        .with_retry(remote_retry())
        .build();
    built(url, gcs)
}

#[cfg(not(feature = "gcp"))]
fn open_gcs(url: &str, _bucket: &str) -> Result<Arc<dyn ObjectStore>> {
    Err(not_built(url, "gcp"))
}

#[cfg(feature = "azure")]
fn open_azure(url: &str, container: &str) -> Result<Arc<dyn ObjectStore>> {
    let az = object_store::azure::MicrosoftAzureBuilder::from_env()
        .with_container_name(container)
        .with_retry(remote_retry())
        .build();
    built(url, az)
}

#[cfg(not(feature = "azure"))]
fn open_azure(url: &str, _container: &str) -> Result<Arc<dyn ObjectStore>> {
    Err(not_built(url, "azure"))
}

#[allow(dead_code)]
fn not_built(url: &str, feature: &str) -> Error {
    Error::InvalidUrl {
        url: url.to_string(),
        reason: format!(
            "this build of hotstart has no {feature} support (cargo feature `{feature}`)"
        ),
    }
}

/// The longest file name a local-directory store takes: the file system's 255 bytes, less room
/// for the `#` and number its writer adds while an object is being written.
const LOCAL_NAME_MAX: usize = 250;

/// One object as listed: its key relative to the store's prefix, its size and when it was last
/// written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ObjectInfo {
    pub key: String,
    pub size: u64,
    pub last_modified: std::time::SystemTime,
}

/// An opened store: an `ObjectStore` with the URL's prefix applied, cheap to clone.
#[derive(Clone)]
pub struct Store {
    inner: Arc<dyn ObjectStore>,
    label: Arc<str>,
    /// The key prefix applied since opening ([`Store::prefixed`]), ending in `/` unless empty.
    prefix: Arc<str>,
    /// The backend when it is a local directory opened from its URL; `None` for remote stores
    /// and wrapped ones (a wrapper sees every read and write).
    local: Option<Local>,
}

/// A local directory store, seen directly.
#[derive(Clone)]
struct Local {
    fs: Arc<object_store::local::LocalFileSystem>,
    /// The key prefix applied since opening ([`Store::prefixed`]), ending in `/` unless empty.
    prefix: String,
    /// The directory that holds the keys under that prefix.
    dir: std::path::PathBuf,
}

impl fmt::Debug for Store {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Store").field("url", &self.label).finish()
    }
}

impl Store {
    /// Parses and opens a store URL, configured from the environment.
    pub fn open(url: &str) -> Result<Store> {
        StoreUrl::parse(url)?.open()
    }

    /// Parses and opens a store URL with options that override the environment
    /// (see [`StoreUrl::open_with`]).
    pub fn open_with(url: &str, options: &[(String, String)]) -> Result<Store> {
        StoreUrl::parse(url)?.open_with(options)
    }

    /// Wraps an existing `ObjectStore` (for example one of the [`crate::wrap`] wrappers).
    pub fn from_object_store(inner: Arc<dyn ObjectStore>, label: impl Into<String>) -> Store {
        Store {
            inner,
            label: label.into().into(),
            prefix: "".into(),
            local: None,
        }
    }

    /// The same store seen through a wrapper built from the inner `ObjectStore`.
    pub fn wrap(&self, f: impl FnOnce(Arc<dyn ObjectStore>) -> Arc<dyn ObjectStore>) -> Store {
        Store {
            inner: f(self.inner.clone()),
            label: self.label.clone(),
            prefix: self.prefix.clone(),
            local: None,
        }
    }

    /// The same store with every key under `prefix`.
    pub fn prefixed(&self, prefix: &str) -> Store {
        let prefix = prefix.trim_matches('/');
        Store {
            inner: Arc::new(PrefixStore::new(self.inner.clone(), prefix)),
            label: self.label.clone(),
            prefix: format!("{}{prefix}/", self.prefix).into(),
            local: self.local.as_ref().map(|l| Local {
                fs: l.fs.clone(),
                prefix: format!("{}{prefix}/", l.prefix),
                dir: l.dir.join(prefix),
            }),
        }
    }

    /// The backend, with the prefix applied.
    pub fn object_store(&self) -> &Arc<dyn ObjectStore> {
        &self.inner
    }

    /// The URL (or label) this store was opened from.
    pub fn url(&self) -> &str {
        &self.label
    }

    /// The key that `key` of this store has in the store its URL opens: the prefixes applied
    /// since opening ([`Store::prefixed`]) put before it. What another process (a node's
    /// sidecar fetching for it) opens [`Store::url`] and reads.
    pub fn opened_key(&self, key: &str) -> String {
        format!("{}{key}", self.prefix)
    }

    /// Converts a relative key into an object path, refusing empty, `.` and `..` components.
    pub fn path(key: &str) -> Result<ObjectPath> {
        ObjectPath::parse(key).map_err(|e| Error::Format {
            what: "object key",
            reason: format!("{key:?}: {e}"),
        })
    }

    /// [`Store::path`] of a key to write: refused, besides, when this store could not hold it.
    /// A local directory keeps an object that is being written under its name followed by `#`
    /// and a number, so it takes no file name whose part after its first `#` is all digits,
    /// and none within a few bytes of the file system's 255-byte limit.
    pub fn path_to_write(&self, key: &str) -> Result<ObjectPath> {
        let path = Self::path(key)?;
        if self.local.is_none() {
            return Ok(path);
        }
        let name = key.rsplit('/').next().unwrap_or(key);
        let reason = if name.len() > LOCAL_NAME_MAX {
            format!(
                "a local-directory store takes file names of at most {LOCAL_NAME_MAX} bytes \
                 (this one has {})",
                name.len()
            )
        } else if name
            .split_once('#')
            .is_some_and(|(_, n)| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
        {
            "a local-directory store takes no file name whose part after its first '#' is all \
             digits (it names unfinished writes that way)"
                .to_string()
        } else {
            return Ok(path);
        };
        Err(Error::Format {
            what: "object key",
            reason: format!("{key:?}: {reason}"),
        })
    }

    /// Writes a whole object in one request; it becomes visible atomically.
    pub async fn put(&self, key: &str, data: Bytes) -> Result<()> {
        let path = self.path_to_write(key)?;
        self.inner
            .put(&path, PutPayload::from_bytes(data))
            .await
            .map_err(|e| Error::store(key, e))?;
        Ok(())
    }

    /// Writes a whole object only if no object has that key: `Ok(true)` when this call created
    /// it, `Ok(false)` when one was already there (left untouched). Backed by the store's own
    /// conditional write (`If-None-Match: *` on S3, a no-replace link on local disk), so of many
    /// writers racing for one key across machines exactly one gets `true`.
    pub async fn put_if_absent(&self, key: &str, data: Bytes) -> Result<bool> {
        let path = self.path_to_write(key)?;
        let opts = object_store::PutOptions {
            mode: object_store::PutMode::Create,
            ..Default::default()
        };
        match self
            .inner
            .put_opts(&path, PutPayload::from_bytes(data), opts)
            .await
        {
            Ok(_) => Ok(true),
            Err(object_store::Error::AlreadyExists { .. }) => Ok(false),
            Err(e) => Err(Error::store(key, e)),
        }
    }

    /// Reads a whole object in one request.
    pub async fn get(&self, key: &str) -> Result<Bytes> {
        let path = Self::path(key)?;
        let res = self
            .inner
            .get(&path)
            .await
            .map_err(|e| Error::store(key, e))?;
        res.bytes().await.map_err(|e| Error::store(key, e))
    }

    /// Reads `len` bytes of an object from byte `offset` on, in one ranged request.
    pub async fn get_range(&self, key: &str, offset: u64, len: u64) -> Result<Bytes> {
        let path = Self::path(key)?;
        self.inner
            .get_range(&path, offset..offset + len)
            .await
            .map_err(|e| Error::store(key, e))
    }

    /// The directory holding this store's objects (its prefix applied) when it is a local
    /// directory opened from its URL and not wrapped: key `a/b` is the file `<dir>/a/b`. A
    /// writer that keeps that layout and makes each file appear whole (a temporary name, then a
    /// rename) may write there directly.
    pub fn local_dir(&self) -> Option<&std::path::Path> {
        self.local.as_ref().map(|l| l.dir.as_path())
    }

    /// Whether this store is a local directory read directly by [`Store::get_blocking`].
    pub fn is_local(&self) -> bool {
        self.local.is_some()
    }

    /// Reads a whole object on the calling thread, for callers already off the async runtime,
    /// when this store is a local directory: `None` for any other store (use [`Store::get`]).
    /// Saves the hand-off to a blocking thread that every async read of a local file costs,
    /// which is most of the cost of reading many small objects.
    pub fn get_blocking(&self, key: &str) -> Option<Result<Bytes>> {
        let Local {
            fs: local, prefix, ..
        } = self.local.as_ref()?;
        let read = || {
            let file = local
                .path_to_filesystem(&Self::path(&format!("{prefix}{key}"))?)
                .map_err(|e| Error::store(key, e))?;
            match std::fs::read(&file) {
                Ok(data) => Ok(Bytes::from(data)),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(Error::NotFound {
                    key: key.to_string(),
                }),
                Err(e) => Err(Error::io("read object", &file, e)),
            }
        };
        Some(read())
    }

    /// The size of an object.
    pub async fn size(&self, key: &str) -> Result<u64> {
        let path = Self::path(key)?;
        let meta = self
            .inner
            .head(&path)
            .await
            .map_err(|e| Error::store(key, e))?;
        Ok(meta.size)
    }

    /// Whether an object exists.
    pub async fn exists(&self, key: &str) -> Result<bool> {
        match self.size(key).await {
            Ok(_) => Ok(true),
            Err(Error::NotFound { .. }) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// Deletes an object; deleting one that does not exist is not an error.
    pub async fn delete(&self, key: &str) -> Result<()> {
        let path = Self::path(key)?;
        match self.inner.delete(&path).await {
            Ok(()) | Err(object_store::Error::NotFound { .. }) => Ok(()),
            Err(e) => Err(Error::store(key, e)),
        }
    }

    /// Every object under `prefix` (recursively), sorted by key.
    pub async fn list(&self, prefix: &str) -> Result<Vec<ObjectInfo>> {
        let prefix_path = if prefix.trim_matches('/').is_empty() {
            None
        } else {
            Some(Self::path(prefix.trim_matches('/'))?)
        };
        let mut out: Vec<ObjectInfo> = self
            .inner
            .list(prefix_path.as_ref())
            .map_ok(|m| ObjectInfo {
                key: m.location.to_string(),
                size: m.size,
                last_modified: m.last_modified.into(),
            })
            .try_collect()
            .await
            .map_err(|e| Error::store(prefix, e))?;
        out.sort_by(|a, b| a.key.cmp(&b.key));
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_directory_store_refuses_names_it_cannot_hold_before_writing() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path().to_str().unwrap())
            .unwrap()
            .prefixed("p");
        for key in ["run#1", "x/run#007", &format!("x/{}", "n".repeat(251))] {
            let e = store.put(key, Bytes::from_static(b"x")).await.unwrap_err();
            assert!(
                matches!(e, Error::Format { .. }) && e.to_string().contains("local-directory"),
                "{key}: {e}"
            );
            assert!(
                crate::StripedWriter::new(&store, key, Default::default()).is_err(),
                "{key}"
            );
        }
        for key in ["run#1x", "a#b#1", "dir#1/f", &"m".repeat(250)] {
            store.put(key, Bytes::from_static(b"x")).await.unwrap();
            assert_eq!(&store.get(key).await.unwrap()[..], b"x", "{key}");
        }
        // Other stores take any key.
        let memory = StoreUrl::parse("memory://t").unwrap().open().unwrap();
        memory.put("run#1", Bytes::from_static(b"x")).await.unwrap();
    }

    #[tokio::test]
    async fn get_blocking_reads_local_directories_and_nothing_else() {
        let dir = tempfile::tempdir().unwrap();
        let store = Store::open(dir.path().to_str().unwrap()).unwrap();
        store
            .put("envs/chunks/ab", Bytes::from_static(b"frame"))
            .await
            .unwrap();
        let read = |s: &Store, key: &str| s.get_blocking(key).map(|r| r.map(|b| b.to_vec()));
        assert!(store.is_local());
        assert_eq!(store.local_dir(), Some(dir.path()));
        assert_eq!(read(&store, "envs/chunks/ab").unwrap().unwrap(), b"frame");
        // A prefix keeps the direct path, and both paths agree on where a key lives.
        let envs = store.prefixed("envs");
        assert!(envs.is_local());
        assert_eq!(envs.local_dir(), Some(dir.path().join("envs").as_path()));
        assert!(std::fs::exists(envs.local_dir().unwrap().join("chunks/ab")).unwrap());
        assert_eq!(read(&envs, "chunks/ab").unwrap().unwrap(), b"frame");
        assert_eq!(&envs.get("chunks/ab").await.unwrap()[..], b"frame");
        let missing = read(&envs, "chunks/cd").unwrap().unwrap_err();
        assert!(missing.is_not_found(), "{missing}");
        assert!(read(&envs, "../escape").unwrap().is_err());
        // A wrapper must see every read, so a wrapped store has no direct path.
        let wrapped = store.wrap(|inner| inner);
        assert!(!wrapped.is_local() && read(&wrapped, "envs/chunks/ab").is_none());
        assert_eq!(wrapped.local_dir(), None);
        let memory = Store::open("memory://").unwrap();
        assert!(!memory.is_local() && read(&memory, "x").is_none());
    }

    #[test]
    fn parses_every_scheme() {
        assert_eq!(
            StoreUrl::parse("/data/store").unwrap(),
            StoreUrl::Local {
                root: "/data/store".into()
            }
        );
        assert_eq!(
            StoreUrl::parse("file:///data/store").unwrap(),
            StoreUrl::Local {
                root: "/data/store".into()
            }
        );
        assert_eq!(
            StoreUrl::parse("s3://bucket/a/b/").unwrap(),
            StoreUrl::S3 {
                bucket: "bucket".into(),
                prefix: "a/b".into()
            }
        );
        assert_eq!(
            StoreUrl::parse("memory://").unwrap(),
            StoreUrl::Memory {
                prefix: String::new()
            }
        );
        assert_eq!(StoreUrl::parse("s3://b/p").unwrap().to_string(), "s3://b/p");
    }

    #[test]
    fn bad_urls_name_the_url_and_the_problem() {
        for (url, needle) in [
            ("", "empty"),
            ("ftp://host/x", "unknown scheme"),
            ("s3://", "missing bucket"),
            ("s3:///prefix", "missing bucket"),
            ("file://relative", "absolute path"),
            ("s3://b/a/../c", "'..'"),
        ] {
            let err = StoreUrl::parse(url).unwrap_err().to_string();
            assert!(err.contains(&format!("{url:?}")), "{err}");
            assert!(err.contains(needle), "{url}: {err}");
        }
    }

    #[cfg(feature = "aws")]
    #[test]
    fn a_plain_http_endpoint_is_refused_at_open_unless_allowed() {
        let url = StoreUrl::parse("s3://bucket/run").unwrap();
        let with = |allow: &str| {
            url.open_with(&[
                ("aws_endpoint".into(), "http://127.0.0.1:9".into()),
                ("aws_allow_http".into(), allow.into()),
                ("aws_access_key_id".into(), "k".into()),
                ("aws_secret_access_key".into(), "s".into()),
                ("aws_region".into(), "us-east-1".into()),
            ])
        };
        let err = with("false").expect_err("refused").to_string();
        assert!(
            err.contains("AWS_ALLOW_HTTP=true") && err.contains("http://127.0.0.1:9"),
            "{err}"
        );
        with("true").expect("allowed");
        with("Yes").expect("allowed as object_store parses it");
    }

    #[test]
    fn bodies_go_unsigned_only_over_tls() {
        assert!(over_tls(None), "AWS itself is reached over https");
        assert!(over_tls(Some("https://s3.example.com")));
        assert!(over_tls(Some("HTTPS://s3.example.com")));
        assert!(!over_tls(Some("http://127.0.0.1:8333")));
    }
}
