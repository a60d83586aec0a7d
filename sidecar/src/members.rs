//! Who the peers are: the static list (`id=host:port`) and the nodes a DNS name resolves to
//! (a Kubernetes headless service), probed every `probe_interval`.
//!
//! A probe connects and authenticates: that tells whether the peer is up and, for DNS peers,
//! its node id and failure domain (static peers must answer with the id they are listed
//! under). Host names are resolved at every probe, so a peer that comes back at a new address
//! is found. With `--insecure`, DNS answers that are not loopback addresses are skipped.

use std::collections::BTreeMap;
use std::net::ToSocketAddrs;
use std::ops::Range;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use tracing::{info, warn};

use crate::Core;
use crate::auth::Identity;
use crate::error::{Error, Result};
use crate::memory::{PartValues, Shard, ShardKey};
use crate::metrics::Failure;
use crate::peer::{PeerClient, need_ranges};
use hotstart_ckpt::format::Region;
use hotstart_proto::shm::Segment;

/// A peer as last probed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    pub id: Identity,
    /// `host:port` to connect to.
    pub addr: String,
    /// Whether it answered the last probe.
    pub up: bool,
}

/// The peer table.
#[derive(Debug, Default)]
pub struct Members {
    table: Mutex<BTreeMap<String, Member>>,
    /// Why each address that failed its last probe failed.
    failing: Mutex<BTreeMap<String, String>>,
}

impl Members {
    /// Every known peer: static peers from the start (down until probed), DNS peers once found.
    pub fn new(core_cfg: &super::SidecarConfig) -> Members {
        let table = core_cfg
            .peers
            .iter()
            .map(|p| {
                let m = Member {
                    id: Identity {
                        node: p.id.clone(),
                        domain: String::new(),
                    },
                    addr: p.addr.clone(),
                    up: false,
                };
                (p.id.clone(), m)
            })
            .collect();
        Members {
            table: Mutex::new(table),
            failing: Mutex::default(),
        }
    }

    /// Notes why a probe of `addr` failed; true when that is news (the address answered last
    /// time, or failed for another reason), so that a peer that stays unreachable, or a
    /// misconfiguration (a wrong token or CA), is told once, not at every probe.
    fn probe_failed(&self, addr: &str, why: String) -> bool {
        let mut f = self.failing.lock().unwrap_or_else(PoisonError::into_inner);
        f.insert(addr.to_string(), why.clone()).as_ref() != Some(&why)
    }

    fn probe_answered(&self, addr: &str) {
        self.failing
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(addr);
    }

    /// Every known peer, up ones first.
    pub fn snapshot(&self) -> Vec<Member> {
        let mut v: Vec<Member> = self
            .table
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .values()
            .cloned()
            .collect();
        v.sort_by_key(|m| !m.up);
        v
    }

    /// The peers that answered the last probe.
    pub fn up(&self) -> Vec<Member> {
        self.table
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .values()
            .filter(|m| m.up)
            .cloned()
            .collect()
    }

    /// Peers up and down.
    pub fn counts(&self) -> (u64, u64) {
        let t = self.table.lock().unwrap_or_else(PoisonError::into_inner);
        let up = t.values().filter(|m| m.up).count() as u64;
        (up, t.len() as u64 - up)
    }

    fn update(&self, m: Member) {
        let mut t = self.table.lock().unwrap_or_else(PoisonError::into_inner);
        let was = t.get(&m.id.node).map(|o| o.up);
        if was != Some(m.up) {
            info!(peer = %m.id.node, addr = %m.addr, up = m.up, "peer state");
        }
        t.insert(m.id.node.clone(), m);
    }

    fn mark_down(&self, node: &str) {
        let mut t = self.table.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(m) = t.get_mut(node)
            && m.up
        {
            m.up = false;
            info!(peer = %node, addr = %m.addr, "peer state down");
        }
    }
}

impl Core {
    /// Probes every peer once (in parallel): static peers by their address, and every address
    /// the DNS name resolves to. Returns the node ids that answered.
    pub(crate) fn probe(&self) -> Vec<String> {
        let mut targets: Vec<(String, Option<String>)> = self
            .cfg
            .peers
            .iter()
            .map(|p| (p.addr.clone(), Some(p.id.clone())))
            .collect();
        if let Some(name) = &self.cfg.peers_dns {
            match name.to_socket_addrs() {
                Ok(addrs) => {
                    for a in addrs {
                        if let Some(why) =
                            self.cfg.loopback_only().filter(|_| !a.ip().is_loopback())
                        {
                            warn!(%a, "{why}: skipping a peer address that is not loopback");
                            continue;
                        }
                        if a == self.cfg.listen || targets.iter().any(|(t, _)| *t == a.to_string())
                        {
                            continue;
                        }
                        targets.push((a.to_string(), None));
                    }
                }
                Err(e) => warn!(name, error = %e, "cannot resolve the peers' DNS name"),
            }
        }
        let answered = Mutex::new(Vec::new());
        std::thread::scope(|scope| {
            for (addr, expect) in &targets {
                let answered = &answered;
                scope.spawn(move || {
                    let res = PeerClient::connect_host(
                        addr,
                        self.tls.as_ref(),
                        &self.key,
                        &self.me,
                        expect.as_deref(),
                        self.cfg.peer_timeout,
                    );
                    match res {
                        Ok(c) if c.peer().node == self.me.node => {}
                        Ok(c) => {
                            self.members.probe_answered(addr);
                            let id = c.peer().clone();
                            answered
                                .lock()
                                .unwrap_or_else(PoisonError::into_inner)
                                .push(id.node.clone());
                            self.members.update(Member {
                                id,
                                addr: addr.clone(),
                                up: true,
                            });
                        }
                        Err(e) => {
                            self.metrics.failed(Failure::Peer);
                            if self.members.probe_failed(addr, e.to_string()) {
                                warn!(%addr, peer = expect.as_deref().unwrap_or("?"), error = %e,
                                    "peer unreachable (said again only when the reason changes)");
                            } else {
                                tracing::debug!(%addr, error = %e, "peer probe failed");
                            }
                            if let Some(id) = expect {
                                self.members.mark_down(id);
                            } else {
                                let node = self
                                    .members
                                    .snapshot()
                                    .into_iter()
                                    .find(|m| m.addr == *addr)
                                    .map(|m| m.id.node);
                                if let Some(node) = node {
                                    self.members.mark_down(&node);
                                }
                            }
                        }
                    }
                });
            }
        });
        answered
            .into_inner()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether every peer that should exist answered in `answered`: every static peer, and
    /// every DNS peer known.
    pub(crate) fn all_answered(&self, answered: &[String]) -> bool {
        self.members
            .snapshot()
            .iter()
            .all(|m| answered.contains(&m.id.node))
    }
}

/// Reaching members.
impl Core {
    /// Connects to a member.
    pub(crate) fn connect(&self, m: &Member) -> Result<PeerClient> {
        PeerClient::connect_host(
            &m.addr,
            self.tls.as_ref(),
            &self.key,
            &self.me,
            Some(&m.id.node),
            self.cfg.peer_timeout,
        )
    }
    /// Fetches `key` from the first member that holds it in memory, verified, into a new
    /// sealed segment (charged to the budget); the shard and who sent it. With `regions`, a
    /// member may send only the chunks that hold them and the header: those are returned too
    /// (`None`: the whole shard came), and the segment's other bytes are zero.
    pub(crate) fn fetch_from_peers(
        &self,
        key: &ShardKey,
        members: &[Member],
        regions: Option<&[Region]>,
    ) -> Option<(Arc<Shard>, String, Option<Vec<usize>>)> {
        for m in members {
            let res = self.connect(m).and_then(|mut c| {
                c.fetch(key, self.threads, regions, |info, manifest, needs| {
                    // Of a shard that comes in part, only the parts that come take memory.
                    let ranges: Vec<Range<usize>> = match needs {
                        Some(n) => need_ranges(manifest, n)
                            .into_iter()
                            .map(|r| r.start as usize..r.end as usize)
                            .collect(),
                        None => std::iter::once(0..info.len as usize).collect(),
                    };
                    let bytes = ranges.iter().map(|r| (r.end - r.start) as u64).sum();
                    let what = format!("{key} from {}", m.id.node);
                    let charge = self.memory.reserve(bytes, self.cfg.stage_timeout, &what)?;
                    let name = format!("hotstart-{}-{}-{}", key.job, key.step, key.rank);
                    let len = info.len as usize;
                    Segment::create_to_fill_ranges(&name, len, &ranges, Some(Box::new(charge)))
                        .map_err(|e| Error::io("create shared memory", &name, e))
                })
            });
            match res {
                Ok(Some(got)) => {
                    let sealed = match got.mem.seal() {
                        Ok(s) => s,
                        Err(e) => {
                            warn!(shard = %key, error = %e, "cannot seal a fetched shard");
                            continue;
                        }
                    };
                    let shard = Arc::new(Shard {
                        key: key.clone(),
                        world_size: got.info.world_size,
                        origin: got.info.origin,
                        manifest: got.manifest,
                        manifest_json: got.json,
                        seg: Arc::new(sealed.into()),
                        committed: Instant::now(),
                        // The values were made while the chunks were checked; a shard that
                        // came in part makes them when a peer first asks.
                        parts: match got.chunks {
                            None => PartValues::made(got.values),
                            Some(_) => Default::default(),
                        },
                    });
                    return Some((shard, m.id.node.clone(), got.chunks));
                }
                Ok(None) => {}
                Err(e) => {
                    if matches!(e, Error::Budget { .. }) {
                        self.metrics.failed(Failure::Budget);
                    } else {
                        self.metrics.failed(Failure::Peer);
                    }
                    warn!(shard = %key, peer = %m.id.node, error = %e, "fetch from a peer failed");
                }
            }
        }
        None
    }
}
