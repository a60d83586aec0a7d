//! The tiers a checkpoint is held in, as both sides name them.

use std::fmt;

/// Which tier, nearest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum TierKind {
    /// The sidecar's shared memory on this node (`hotstart serve`): survives a crash of the
    /// training process.
    Memory,
    /// Peer sidecars' memory on other nodes: survives the loss of this node.
    Peer,
    /// The local disk directory.
    Disk,
    /// The object store.
    Store,
}

impl TierKind {
    /// Every tier, nearest first.
    pub const ALL: [TierKind; 4] = [
        TierKind::Memory,
        TierKind::Peer,
        TierKind::Disk,
        TierKind::Store,
    ];

    /// The lower-case name used in logs, metrics labels and the sidecar protocol.
    pub fn as_str(self) -> &'static str {
        match self {
            TierKind::Memory => "memory",
            TierKind::Peer => "peer",
            TierKind::Disk => "disk",
            TierKind::Store => "store",
        }
    }
}

impl fmt::Display for TierKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl std::str::FromStr for TierKind {
    type Err = String;

    fn from_str(s: &str) -> Result<TierKind, String> {
        TierKind::ALL
            .into_iter()
            .find(|t| t.as_str() == s)
            .ok_or_else(|| format!("unknown tier {s:?}"))
    }
}

impl serde::Serialize for TierKind {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(self.as_str())
    }
}

impl<'de> serde::Deserialize<'de> for TierKind {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<TierKind, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}
