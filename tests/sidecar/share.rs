//! The replicas of a data-parallel job hold the same bytes: when every node's memory is gone
//! and the step must come back from the store, the sidecars share its chunks, so the store
//! sends each about once for the job instead of once per rank. Chunks larger than
//! `--share-piece` are shared in ranges, each part checked against a value sent with it and
//! the values against the chunk's id: a peer that sends a corrupt range, with or without values
//! made up to match, changes no restored byte and is counted and avoided.

use hotstart_sidecar::metrics;
use hotstart_testkit::SeaweedFs;

use crate::cluster::{Cluster, Node, restore};

const GET_BYTES: &str = "hotstart_store_bytes_total{op=\"get\"}";
const CKPT_FROM_PEERS: &str = "hotstart_share_bytes_total{artifact=\"ckpt\",source=\"peer\"}";
const FAILURES: &str = "hotstart_share_peer_failures_total";
const CORRUPT_SENT: &str = "HOTSTART_FAULT_CORRUPT_SHARED";
const KEPT: &str = "hotstart_share_ranges_kept_total";
const CACHE_BYTES: &str = "hotstart_share_cache_bytes";
const MEMORY_USED: &str = "hotstart_memory_used_bytes";
const MIB: usize = 8;
/// A quarter of the trainer's 1 MiB chunks: every chunk is shared in 4 ranges.
const RANGE: &str = "256KiB";
const RANGE_BYTES: f64 = (256 << 10) as f64;

pub fn replicas_restore_from_the_store_about_once_for_the_job() {
    let Some(weed) = SeaweedFs::shared() else {
        assert!(!hotstart_testkit::ci(), "CI needs SeaweedFS");
        eprintln!("skipping: no SeaweedFS");
        return;
    };
    let mut cluster = Cluster::new(3);
    cluster.args = vec!["--share-piece".into(), RANGE.into()];
    cluster.store = Some((
        format!("{}/ckpt", weed.fresh_bucket("sidecar-share")),
        weed.env(),
    ));
    let args = |verb: &str, rank: usize| -> Vec<String> {
        let mut a: Vec<String> = [verb, "--job", "dp", "--world", "3", "--replica"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        a.extend([
            "--rank".into(),
            rank.to_string(),
            "--mib".into(),
            MIB.to_string(),
        ]);
        a
    };
    let mut nodes = cluster.start_all();
    wait_peers(&nodes);
    for (i, n) in nodes.iter().enumerate() {
        let mut a = args("save", i);
        a.extend(["--steps".into(), "1".into(), "--wait".into(), "all".into()]);
        let (status, lines, err) = n.trainer(&strs(&a)).finish();
        assert!(
            status.success() && lines.contains(&"saved 1".to_string()),
            "{err}"
        );
    }
    // Every node loses its memory and its disk: the step is only in the store.
    for n in &mut nodes {
        n.sigterm();
    }
    drop(nodes);
    nodes = cluster.start_all_as(1);
    wait_peers(&nodes);
    let restore_all = |nodes: &[Node]| {
        std::thread::scope(|s| {
            for (i, n) in nodes.iter().enumerate() {
                let a = args("restore", i);
                s.spawn(move || {
                    // The trainer compares every restored byte with what it saved.
                    let (step, source) = restore(n, &strs(&a));
                    assert_eq!(step, 1, "rank {i} restored {source}");
                });
            }
        });
    };
    let before: f64 = nodes.iter().map(|n| n.metric(GET_BYTES)).sum();
    restore_all(&nodes);
    let read: f64 = nodes.iter().map(|n| n.metric(GET_BYTES)).sum::<f64>() - before;
    let from_peers: f64 = nodes.iter().map(|n| n.metric(CKPT_FROM_PEERS)).sum();
    let shard = (MIB << 20) as f64;
    eprintln!("3 ranks restored {shard} bytes each: the store sent {read}, peers {from_peers}");
    // Alone, each rank would read its whole shard from the store (3 × 8 MiB); shared, each
    // chunk once, but for the first: it holds the file's header, which names the rank.
    assert!(
        read < 1.5 * shard,
        "the store sent {read} bytes for 3 replicas of {shard}"
    );
    assert!(from_peers >= shard, "peers sent {from_peers} bytes");
    // Every range from a peer is kept, to be passed on: as it lands, once its chunk's values
    // (gathered from the ranges' owners while the ranges arrive) are verified against the
    // chunk's id, else once its whole chunk is in and checked.
    let (on_arrival, with_chunk) = (kept(&nodes, "on_arrival"), kept(&nodes, "with_chunk"));
    let mut kept_on_arrival = on_arrival;
    eprintln!("ranges from peers kept on arrival: {on_arrival}, with their chunk: {with_chunk}");
    // The file's last few hundred bytes are a chunk of their own, too small to be split.
    assert_eq!(
        on_arrival + with_chunk,
        (from_peers / RANGE_BYTES).floor(),
        "every range from a peer is kept once"
    );
    // The pieces kept to serve peers are charged to the memory budget.
    let held: Vec<(f64, f64)> = nodes
        .iter()
        .map(|n| (n.metric(CACHE_BYTES), n.metric(MEMORY_USED)))
        .collect();
    assert!(
        held.iter().any(|(c, _)| *c >= shard / 2.0) && held.iter().all(|(c, u)| c <= u),
        "(pieces kept, memory charged) per node: {held:?}"
    );

    // Again from the store alone, twice, node 2 corrupting every range it sends: first a
    // flipped byte (its part does not match the value sent with it: caught as it arrives),
    // then a flipped byte with values made up to match (caught when the chunk's values do not
    // make its id; the chunk is read from the store and node 2's range found against it).
    // Either way node 2 is counted and avoided, and every rank's bytes are right (the trainer
    // checks them).
    for (generation, fault) in [(2, "1"), (3, "forge")] {
        for n in &mut nodes {
            n.sigterm();
        }
        drop(nodes);
        cluster.node_env = vec![(2, CORRUPT_SENT.into(), fault.into())];
        nodes = cluster.start_all_as(generation);
        wait_peers(&nodes);
        restore_all(&nodes);
        let name = format!("{FAILURES}{{peer=\"{}\",kind=\"corrupt\"}}", Cluster::id(2));
        let caught: Vec<f64> = nodes[..2]
            .iter()
            .map(|n| metrics::sample(&n.metrics(), &name).unwrap_or(0.0))
            .collect();
        eprintln!("{fault}: corrupt ranges from node 2 counted by nodes 0 and 1: {caught:?}");
        assert!(
            caught.iter().sum::<f64>() >= 1.0,
            "{fault}: no node caught node 2's corrupt ranges: {caught:?}\n{}",
            nodes[0].log()
        );
        kept_on_arrival += kept(&nodes, "on_arrival");
    }
    // Whether a chunk's values are in before its ranges land depends on timing: over the three
    // rounds, some are.
    assert!(
        kept_on_arrival >= 1.0,
        "no range was kept on arrival in three rounds"
    );
}

/// Ranges from peers the nodes kept, `when` as the metric's label says.
fn kept(nodes: &[Node], when: &str) -> f64 {
    let name = format!("{KEPT}{{when=\"{when}\"}}");
    nodes
        .iter()
        .map(|n| metrics::sample(&n.metrics(), &name).unwrap_or(0.0))
        .sum()
}

fn strs(a: &[String]) -> Vec<&str> {
    a.iter().map(String::as_str).collect()
}

fn wait_peers(nodes: &[Node]) {
    for n in nodes {
        n.wait_metric("hotstart_peers{state=\"up\"}", (nodes.len() - 1) as f64);
    }
}
