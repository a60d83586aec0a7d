//! The memory budget: saving more than it holds evicts the oldest steps, never exceeds it
//! (peak read from `/metrics`), keeps the newest step, and an evicted step is still restored
//! from the next tier.

use std::time::Duration;

use hotstart_sidecar::{ClusterKey, Held, Identity, PeerClient};

use crate::cluster::{Cluster, TOKEN, restore};

pub fn budget_evicts_oldest_and_keeps_newest() {
    let mut cluster = Cluster::new(1);
    // Steps are 4 MiB and a bit: the budget holds three of them, not four.
    cluster.budget = "14MiB".into();
    cluster.args = vec!["--keep".into(), "0".into()];
    let nodes = cluster.start_all();
    let n = &nodes[0];
    let mut t = n.trainer(&[
        "save", "--job", "run", "--mib", "4", "--steps", "8", "--wait", "all",
    ]);
    let saved = t.until("done");
    assert_eq!(saved.len(), 8, "{saved:?}");
    let (status, _, err) = t.finish();
    assert!(status.success(), "{err}");

    let budget = n.metric("hotstart_memory_budget_bytes");
    assert_eq!(budget, 14.0 * 1048576.0);
    assert!(
        n.metric("hotstart_memory_peak_bytes") <= budget,
        "{}",
        n.metrics()
    );
    assert!(n.metric("hotstart_memory_used_bytes") <= budget);
    // Older steps left memory: evicted, or their segments staged into again.
    assert!(
        n.metric("hotstart_evictions_total") + n.metric("hotstart_memory_segments_recycled_total")
            >= 5.0,
        "{}",
        n.metrics()
    );
    let key = ClusterKey::new(TOKEN.as_bytes());
    let me = Identity {
        node: "tester".into(),
        domain: String::new(),
    };
    let mut c = PeerClient::connect(n.peer, None, &key, &me, None, Duration::from_secs(10))
        .expect("connect");
    let mut in_memory: Vec<u64> = c
        .inventory(Some("run"))
        .expect("inventory")
        .into_iter()
        .filter(|s| s.held == Held::Memory)
        .map(|s| s.step)
        .collect();
    in_memory.sort();
    assert!(
        in_memory.len() <= 3 && in_memory.last() == Some(&8),
        "{in_memory:?}"
    );

    // The newest step is served from memory, an evicted one from the disk tier.
    let args = ["restore", "--job", "run", "--mib", "4"];
    assert_eq!(restore(n, &args), (8, "memory".into()));
    let mut old = args.to_vec();
    old.extend(["--step", "1"]);
    assert_eq!(restore(n, &old), (1, "disk".into()));

    // A save larger than the whole budget is refused, not squeezed in.
    let (status, _, err) = n
        .trainer(&["save", "--job", "run", "--mib", "15", "--first", "9"])
        .finish();
    assert!(!status.success());
    assert!(
        err.contains("memory budget") && err.contains("larger than the whole budget"),
        "{err}"
    );
    assert!(n.metric("hotstart_memory_peak_bytes") <= budget);
}
