//! The messages sidecars exchange over their peer links, in the frames of
//! [`hotstart_proto::wire`] (`docs/PROTOCOL.md`).

use hotstart_ckpt::format::Region;
use serde::{Deserialize, Serialize};

/// Where a shard is held, as an inventory reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Held {
    Memory,
    Disk,
}

/// One shard (a rank's file of one step) as listed, pushed or fetched.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardInfo {
    pub job: String,
    pub rank: u32,
    pub step: u64,
    pub world_size: u32,
    /// File length in bytes.
    pub len: u64,
    /// The node whose training process staged it.
    pub origin: String,
    pub held: Held,
}

/// Messages between peer sidecars.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum PeerMsg {
    /// Client → server, first: who is calling, and a fresh nonce (hex).
    Hello {
        version: u32,
        node: String,
        domain: String,
        nonce: String,
    },
    /// Server → client: who answers, its nonce, and its proof that it knows the token.
    Challenge {
        node: String,
        domain: String,
        nonce: String,
        proof: String,
    },
    /// Client → server: the client's proof.
    Proof { proof: String },
    /// Server → client: authenticated; requests may follow.
    Welcome,
    /// The request or the connection is refused; the connection is closed after it.
    Refused { reason: String },
    /// Which shards do you hold (of one job, or all)?
    Inventory { job: Option<String> },
    /// The answer to `Inventory`.
    Held { shards: Vec<ShardInfo> },
    /// Hold this replica; its data follows once the server says `Ready`.
    Push { shard: ShardInfo, manifest: String },
    /// Room is reserved: send the data.
    Ready,
    /// The pushed shard arrived whole and matches its checksums.
    Stored,
    /// Send me this shard from your memory; with `regions`, only the chunks that hold those
    /// byte ranges of its tensors and the file's header, and with `parts` too, of those chunks
    /// only the parts that hold them ([`hotstart_ckpt::parts`]).
    Fetch {
        job: String,
        rank: u32,
        step: u64,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        regions: Option<Vec<Region>>,
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        parts: bool,
    },
    /// The fetched shard; its data follows (none after `Describe`): every chunk, or with
    /// `chunks` (ascending) those only. With `parts`, a chunk of which the regions need only
    /// some parts ([`hotstart_ckpt::format::Manifest::parts_for`]) comes as every part's
    /// chaining value, then those parts.
    Shard {
        shard: ShardInfo,
        manifest: String,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        chunks: Option<Vec<usize>>,
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        parts: bool,
    },
    /// Describe this shard of your memory: answered with `Shard` and no data, or `NotFound`.
    Describe { job: String, rank: u32, step: u64 },
    /// Send me this shared piece (`super::share`): as its owner, from your cache or read from
    /// the store; with `cached_only`, only if your cache holds it (else `NotFound`). With
    /// `redirect`, a node busy sending it may answer `Redirect` to a node it sent it to. With
    /// `values_only` (a range of a chunk), only the chaining values of its parts, not its bytes.
    Piece {
        piece: hotstart_proto::share::Piece,
        #[serde(default)]
        cached_only: bool,
        #[serde(default)]
        redirect: bool,
        #[serde(default, skip_serializing_if = "std::ops::Not::not")]
        values_only: bool,
    },
    /// The piece: `len` bytes in data frames follow, every frame checked against its id.
    PieceIs { len: u64 },
    /// Ask `node` for the piece instead (with `cached_only`): it holds it.
    Redirect { node: String },
    /// Not held.
    NotFound,
    /// The request failed; the connection stays usable.
    Failed { reason: String },
}
