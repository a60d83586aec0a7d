//! Where images and their artifacts live in a store, and what an image may be called.
//!
//! ```text
//! chunks/<2 hex>/<64 hex>                    file contents: zstd chunks named by blake3,
//!                                            shared by every image and snapshot in the store
//! images/<name>/_tags/<tag>/tree             the image's Tree manifest (HSTREE encoding)
//! images/<name>/_tags/<tag>/image.json       the image record, written last: its presence is
//!                                            the image's commit
//! images/<name>/_tags/<tag>/profile          the merged hot-chunk profile (HSPROF encoding)
//! images/<name>/_tags/<tag>/traces/<run>     the trace of a mount still running (or crashed),
//!                                            rewritten periodically, merged and removed at the end
//! images/<name>/_tags/<tag>/runs/<run>.json  one report per finished mount
//! ```
//!
//! Names follow the OCI distribution grammar: `/`-separated components of lowercase letters and
//! digits joined by single `.`, `_` or `-` (or `__`), so no component can start with `_`, and
//! `_tags` can never be part of a name. A tag is up to 128 characters of `[A-Za-z0-9_.-]` not
//! starting with `.` or `-`; the default is `latest`.
//!
//! Everything below an image's `_tags/<tag>/` except `tree` and `image.json` is an
//! [`ArtifactDir`]: the same layout serves any other tree that is mounted lazily (an
//! environment snapshot keeps its profile under its own prefix).

use std::fmt;
use std::str::FromStr;

use crate::error::{Error, Result};

/// The tag an image gets when its name has none.
pub const DEFAULT_TAG: &str = "latest";
const MAX_NAME: usize = 255;
const MAX_TAG: usize = 128;

/// An image name and tag, `name[:tag]`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ImageRef {
    pub name: String,
    pub tag: String,
}

impl ImageRef {
    /// Parses `name[:tag]`, checking both.
    pub fn parse(s: &str) -> Result<ImageRef> {
        let invalid = |reason: &str| Error::InvalidName {
            name: s.to_string(),
            reason: reason.to_string(),
        };
        let (name, tag) = match s.rsplit_once(':') {
            // A colon inside a path component before a '/' would be a registry port; not ours.
            Some((n, t)) if !t.contains('/') => (n, t),
            Some(_) => return Err(invalid("':' may only separate the tag")),
            None => (s, DEFAULT_TAG),
        };
        if name.is_empty() || name.len() > MAX_NAME {
            return Err(invalid("the name must be 1 to 255 characters"));
        }
        for comp in name.split('/') {
            if !valid_component(comp) {
                return Err(invalid(
                    "each '/'-separated part must be lowercase letters and digits, joined by \
                     single '.', '_', '__' or '-'",
                ));
            }
        }
        let tag_ok = !tag.is_empty()
            && tag.len() <= MAX_TAG
            && !tag.starts_with(['.', '-'])
            && tag
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'));
        if !tag_ok {
            return Err(invalid(
                "the tag must be 1 to 128 of [A-Za-z0-9_.-], not starting with '.' or '-'",
            ));
        }
        Ok(ImageRef {
            name: name.to_string(),
            tag: tag.to_string(),
        })
    }

    /// `images/<name>/_tags/<tag>/`: where everything of this image lives.
    pub fn prefix(&self) -> String {
        format!("images/{}/_tags/{}/", self.name, self.tag)
    }

    /// The key of the image's tree manifest.
    pub fn tree_key(&self) -> String {
        format!("{}tree", self.prefix())
    }

    /// The key of the image record (the commit).
    pub fn record_key(&self) -> String {
        format!("{}image.json", self.prefix())
    }

    /// Where the image's profile, traces and run reports live.
    pub fn artifacts(&self) -> ArtifactDir {
        ArtifactDir::new(self.prefix())
    }

    /// The image whose record is at `key`, if `key` is an image record key.
    pub fn from_record_key(key: &str) -> Option<ImageRef> {
        let rest = key.strip_prefix("images/")?.strip_suffix("/image.json")?;
        let (name, tag) = rest.rsplit_once("/_tags/")?;
        ImageRef::parse(&format!("{name}:{tag}")).ok()
    }
}

fn valid_component(c: &str) -> bool {
    let b = c.as_bytes();
    if b.is_empty() || !b[0].is_ascii_alphanumeric() || !b[b.len() - 1].is_ascii_alphanumeric() {
        return false;
    }
    let mut i = 0;
    while i < b.len() {
        let ch = b[i];
        if ch.is_ascii_lowercase() || ch.is_ascii_digit() {
            i += 1;
            continue;
        }
        // A separator: '.', '-' (runs of '-' allowed), '_' or '__'.
        let run = b[i..].iter().take_while(|&&x| x == ch).count();
        let ok = match ch {
            b'.' => run == 1,
            b'_' => run <= 2,
            b'-' => true,
            _ => false,
        };
        if !ok {
            return false;
        }
        i += run;
    }
    true
}

impl fmt::Display for ImageRef {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.name, self.tag)
    }
}

impl FromStr for ImageRef {
    type Err = Error;
    fn from_str(s: &str) -> Result<ImageRef> {
        ImageRef::parse(s)
    }
}

/// The store prefix under which one mountable tree keeps its profile, in-progress traces and run
/// reports (`<prefix>profile`, `<prefix>traces/<run>`, `<prefix>runs/<run>.json`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ArtifactDir {
    prefix: String,
}

impl ArtifactDir {
    /// Artifacts under `prefix` (a trailing `/` is added if missing).
    pub fn new(prefix: impl Into<String>) -> ArtifactDir {
        let mut prefix = prefix.into();
        if !prefix.ends_with('/') {
            prefix.push('/');
        }
        ArtifactDir { prefix }
    }

    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    pub fn profile_key(&self) -> String {
        format!("{}profile", self.prefix)
    }

    pub fn traces_prefix(&self) -> String {
        format!("{}traces/", self.prefix)
    }

    pub fn trace_key(&self, run: &str) -> String {
        format!("{}traces/{run}", self.prefix)
    }

    pub fn runs_prefix(&self) -> String {
        format!("{}runs/", self.prefix)
    }

    pub fn run_key(&self, run: &str) -> String {
        format!("{}runs/{run}.json", self.prefix)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_tags() {
        let r = ImageRef::parse("ml/python-3.11").unwrap();
        assert_eq!(
            (r.name.as_str(), r.tag.as_str()),
            ("ml/python-3.11", "latest")
        );
        let r = ImageRef::parse("py:v1.2_rc").unwrap();
        assert_eq!(r.to_string(), "py:v1.2_rc");
        assert_eq!(r.record_key(), "images/py/_tags/v1.2_rc/image.json");
        assert_eq!(ImageRef::from_record_key(&r.record_key()), Some(r));
        assert_eq!(
            ImageRef::from_record_key("images/a/b/_tags/t/image.json"),
            Some(ImageRef::parse("a/b:t").unwrap())
        );
        assert_eq!(
            ImageRef::from_record_key("images/a/_tags/t/runs/x.json"),
            None
        );
        for bad in [
            "", "Upper", "a//b", "/a", "a/", "_a", "a..b", "a___b", "../x", "a/../b", "a:", "a:-x",
            "a:.x", "a:b/c", "a b", "a:t:u",
        ] {
            assert!(ImageRef::parse(bad).is_err(), "{bad:?} accepted");
        }
        for good in ["a", "a.b", "a__b", "a--b", "a-b/c_d", "0:0"] {
            ImageRef::parse(good).unwrap();
        }
    }
}
