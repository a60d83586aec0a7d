//! Where replicas go: the node's successors on a ring of nodes.
//!
//! Every node sits at one 64-bit position on a ring (the hash of its id). The replicas of every
//! shard a node holds as origin walk clockwise from that node's own position and take each peer
//! in the order met: the first replica goes to the node's successor. Successors on a ring are a
//! one-to-one map, so with one replica each node holds the replicas of exactly one other node
//! (its predecessor): memory and replication traffic are even whenever nodes run the same
//! number of ranks, where placing each rank by its own hash gives some node two ranks' replicas
//! and another none in a small cluster. When this node has a failure-domain label, peers with a
//! *different* label (or none) come first and peers in the same domain only after them, so
//! replicas leave the domain whenever enough peers elsewhere exist. The first `k` peers of the
//! walk that accept a shard hold it.
//!
//! The same inputs give the same order on every node, every step of a node's ranks goes to the
//! same peers, and adding or removing a node changes only its predecessor's first choice.

use crate::auth::Identity;

fn position(s: &str) -> u64 {
    let h = blake3::hash(s.as_bytes());
    let mut b = [0u8; 8];
    b.copy_from_slice(&h.as_bytes()[..8]);
    u64::from_le_bytes(b)
}

/// Every peer in the order replicas of `me`'s shards should try them (see the module docs).
pub fn order<'a>(me: &Identity, peers: &'a [Identity]) -> Vec<&'a Identity> {
    let start = position(&me.node);
    let mut walk: Vec<&Identity> = peers.iter().filter(|p| p.node != me.node).collect();
    // Clockwise distance from this node; ties (equal hashes) are broken by id, so the order is
    // total. A peer listed twice is taken once.
    walk.sort_by(|a, b| {
        let d = |p: &Identity| position(&p.node).wrapping_sub(start);
        d(a).cmp(&d(b)).then_with(|| a.node.cmp(&b.node))
    });
    walk.dedup_by(|a, b| a.node == b.node);
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
        let o = order(&me, &peers);
        assert_eq!(o.len(), 7, "every peer but me");
        assert!(o.iter().all(|p| p.node != "n0"));
        // The four peers of rack-b come before the three others of rack-a.
        assert!(o[..4].iter().all(|p| p.domain == "rack-b"), "{o:?}");
        assert!(o[4..].iter().all(|p| p.domain == "rack-a"));
        // Same answer whatever order the peers are listed in.
        let mut shuffled = peers.clone();
        shuffled.reverse();
        let again: Vec<&str> = order(&me, &shuffled)
            .iter()
            .map(|p| p.node.as_str())
            .collect();
        let first: Vec<&str> = o.iter().map(|p| p.node.as_str()).collect();
        assert_eq!(first, again);
    }

    /// Each node's first choice is a different peer, so with one replica every node holds the
    /// replicas of exactly one other; a node removed changes only its predecessor's choice.
    #[test]
    fn every_node_holds_one_nodes_replicas_and_removal_moves_one() {
        for n in [2, 3, 5, 16] {
            let nodes: Vec<Identity> = (0..n).map(|i| node(&format!("node-{i}"), "")).collect();
            let first = |me: &Identity, all: &[Identity]| order(me, all)[0].node.clone();
            let chosen: std::collections::BTreeSet<String> =
                nodes.iter().map(|me| first(me, &nodes)).collect();
            assert_eq!(chosen.len(), n, "{n} nodes: {chosen:?}");
            if n < 3 {
                continue;
            }
            let gone = &nodes[1].node;
            let fewer: Vec<Identity> = nodes.iter().filter(|p| &p.node != gone).cloned().collect();
            let moved: Vec<&Identity> = fewer
                .iter()
                .filter(|me| first(me, &nodes) != first(me, &fewer))
                .collect();
            assert_eq!(moved.len(), 1, "{n} nodes: {moved:?}");
            assert_eq!(&first(moved[0], &nodes), gone);
        }
    }
}
