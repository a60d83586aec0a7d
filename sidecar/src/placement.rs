//! Where replicas go: a deterministic ring.
//!
//! Every node sits on a ring of 64-bit positions at [`POINTS`] places (the hashes of
//! `<id>#0`, `<id>#1`, ...; many points per node spread the ranks evenly); a rank's shards
//! (key `<job>/<rank>`) start at the hash of the key and walk clockwise, taking each node the
//! first time the walk meets it. The walk skips this node; when this node has a failure-domain
//! label, peers with a *different* label (or none) come first and peers in the same domain only
//! after them, so replicas leave the domain whenever enough peers elsewhere exist. The first
//! `k` peers of the walk that accept a shard hold it.
//!
//! The same inputs give the same order on every node, every step of a rank goes to the same
//! peers, and adding or removing a node moves only the ranks whose walk passed it.

use crate::auth::Identity;

/// Ring positions per node.
pub const POINTS: u32 = 64;

fn position(s: &str) -> u64 {
    let h = blake3::hash(s.as_bytes());
    let mut b = [0u8; 8];
    b.copy_from_slice(&h.as_bytes()[..8]);
    u64::from_le_bytes(b)
}

/// The placement key of a rank of a job.
pub fn key(job: &str, rank: u32) -> String {
    format!("{job}/{rank}")
}

/// Every peer in the order replicas of `key` should try them (see the module docs).
pub fn order<'a>(key: &str, me: &Identity, peers: &'a [Identity]) -> Vec<&'a Identity> {
    let start = position(key);
    let mut ring: Vec<(u64, &Identity)> = peers
        .iter()
        .filter(|p| p.node != me.node)
        .flat_map(|p| {
            (0..POINTS).map(move |i| (position(&format!("{}#{i}", p.node)).wrapping_sub(start), p))
        })
        .collect();
    // Ties (equal hashes) are broken by id, so the order is total.
    ring.sort_by(|a, b| a.0.cmp(&b.0).then_with(|| a.1.node.cmp(&b.1.node)));
    let mut walk: Vec<&Identity> = Vec::new();
    for (_, p) in ring {
        if !walk.iter().any(|q| q.node == p.node) {
            walk.push(p);
        }
    }
    let same_domain = |p: &Identity| !me.domain.is_empty() && p.domain == me.domain;
    let (away, near): (Vec<_>, Vec<_>) = walk.into_iter().partition(|p| !same_domain(p));
    away.into_iter().chain(near).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(id: &str, domain: &str) -> Identity {
        Identity {
            node: id.into(),
            domain: domain.into(),
        }
    }

    #[test]
    fn deterministic_skips_self_and_leaves_the_domain() {
        let me = node("n0", "rack-a");
        let peers: Vec<Identity> = (0..8)
            .map(|i| {
                node(
                    &format!("n{i}"),
                    if i % 2 == 0 { "rack-a" } else { "rack-b" },
                )
            })
            .collect();
        for rank in 0..50 {
            let k = key("job", rank);
            let o = order(&k, &me, &peers);
            assert_eq!(o.len(), 7, "every peer but me");
            assert!(o.iter().all(|p| p.node != "n0"));
            // The four peers of rack-b come before the three others of rack-a.
            assert!(o[..4].iter().all(|p| p.domain == "rack-b"), "{rank}");
            assert!(o[4..].iter().all(|p| p.domain == "rack-a"));
            // Same answer whatever order the peers are listed in.
            let mut shuffled = peers.clone();
            shuffled.reverse();
            let again: Vec<&str> = order(&k, &me, &shuffled)
                .iter()
                .map(|p| p.node.as_str())
                .collect();
            let first: Vec<&str> = o.iter().map(|p| p.node.as_str()).collect();
            assert_eq!(first, again);
        }
    }

    #[test]
    fn ranks_spread_over_peers_and_removal_moves_few() {
        let me = node("me", "");
        let peers: Vec<Identity> = (0..5).map(|i| node(&format!("p{i}"), "")).collect();
        let first = |peers: &[Identity], rank| order(&key("j", rank), &me, peers)[0].node.clone();
        let mut counts = std::collections::HashMap::new();
        for rank in 0..500 {
            *counts.entry(first(&peers, rank)).or_insert(0) += 1;
        }
        assert_eq!(counts.len(), 5, "every peer gets some ranks: {counts:?}");
        assert!(
            counts.values().all(|&c| (50..=150).contains(&c)),
            "{counts:?}"
        );
        // Without p2, only the ranks that went to p2 move.
        let fewer: Vec<Identity> = peers.iter().filter(|p| p.node != "p2").cloned().collect();
        for rank in 0..500 {
            let before = first(&peers, rank);
            if before != "p2" {
                assert_eq!(first(&fewer, rank), before);
            }
        }
    }
}
