//! Restarts after a fault: a training process killed with SIGKILL restores from its sidecar's
//! memory; a whole node lost (sidecar and training process killed) comes back from a peer
//! with the object store gone.

use std::time::{Duration, Instant};

use hotstart_testkit::SeaweedFs;

use crate::cluster::{Cluster, Node, Trainer, WATCHDOG, restore};

const MIB: &str = "8";
const STEPS: &str = "3";

/// Starts one saving trainer per node (rank = node, world = nodes), waits until every one
/// saved `STEPS` steps to every tier, and keeps them alive.
fn train(nodes: &[Node]) -> Vec<Trainer> {
    let world = nodes.len().to_string();
    let mut trainers: Vec<Trainer> = nodes
        .iter()
        .enumerate()
        .map(|(rank, n)| {
            let rank = rank.to_string();
            n.trainer(&[
                "save", "--job", "run", "--rank", &rank, "--world", &world, "--mib", MIB,
                "--steps", STEPS, "--wait", "all", "--hold",
            ])
        })
        .collect();
    for t in &mut trainers {
        assert_eq!(t.until("done"), ["saved 1", "saved 2", "saved 3"]);
    }
    trainers
}

fn restore_args(rank: usize, world: usize) -> Vec<String> {
    [
        "restore",
        "--job",
        "run",
        "--rank",
        &rank.to_string(),
        "--world",
        &world.to_string(),
        "--mib",
        MIB,
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

fn args(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

const GETS: &str = "hotstart_store_requests_total{op=\"get\"}";
const HEADS: &str = "hotstart_store_requests_total{op=\"head\"}";
const LISTS: &str = "hotstart_store_requests_total{op=\"list\"}";
const FROM_MEMORY: &str = "hotstart_restores_total{source=\"memory\"}";

/// kill -9 one trainer of three; its restart restores the newest step bit-exact from its
/// sidecar's memory, and the sidecar makes no read request to the store for it.
pub fn trainer_kill_restores_from_memory() {
    let Some(weed) = SeaweedFs::shared() else {
        return;
    };
    let mut cluster = Cluster::new(3);
    cluster.store = Some((
        format!("{}/ckpt", weed.fresh_bucket("sidecar-restart")),
        weed.env(),
    ));
    let nodes = cluster.start_all();
    let mut trainers = train(&nodes);

    trainers[1].kill9();
    // Retention of older steps follows every save and reads the store: let it finish first.
    nodes[1].wait_metric("hotstart_persist_running_shards", 0.0);
    let reads = |n: &Node| (n.metric(GETS), n.metric(HEADS), n.metric(LISTS));
    let before = reads(&nodes[1]);
    assert_eq!(nodes[1].metric(FROM_MEMORY), 0.0);

    let (step, source) = restore(&nodes[1], &args(&restore_args(1, 3)));
    assert_eq!((step, source.as_str()), (3, "memory"));
    assert_eq!(nodes[1].metric(FROM_MEMORY), 1.0);
    assert_eq!(reads(&nodes[1]), before, "the restore read from the store");
    // The other ranks' shards are where they should be too: rank 0 restores from its memory.
    let (step, source) = restore(&nodes[0], &args(&restore_args(0, 3)));
    assert_eq!((step, source.as_str()), (3, "memory"));
    uploads_without_a_gpu_are_refused_with_the_reason(&nodes[1]);
    // Every shard also reached the store and a peer.
    let shard = 8.0 * 1048576.0;
    let mut replicas = 0.0;
    for n in &nodes {
        assert!(n.metric("hotstart_persisted_bytes_total{tier=\"store\"}") >= 3.0 * shard);
        assert!(n.metric("hotstart_persisted_bytes_total{tier=\"peer\"}") >= 3.0 * shard);
        replicas += n.metric("hotstart_memory_shards{origin=\"replica\"}");
    }
    assert_eq!(replicas, 9.0, "one replica of each rank's three steps");
    drop(trainers);
    for mut n in nodes {
        let status = n.sigterm();
        assert!(status.success(), "{}", n.log());
    }
}

/// A sidecar with no GPU refuses to copy a restored step into device memory itself (the
/// process then copies it), saying why: before a step was handed over on the connection, and
/// after (no CUDA). Nothing it holds changes: the step restores again from its memory.
fn uploads_without_a_gpu_are_refused_with_the_reason(n: &Node) {
    use hotstart_proto::PROTOCOL_VERSION;
    use hotstart_proto::wire::{Conn, DeviceCopy, FdStream, LocalMsg, Side};
    let sock = std::os::unix::net::UnixStream::connect(&n.socket).unwrap();
    let mut c = Conn::new(FdStream::new(sock), "test", Side::Local);
    let ask = |c: &mut Conn<FdStream>, msg: LocalMsg| {
        c.send(&msg).unwrap();
        c.recv::<LocalMsg>().unwrap()
    };
    let attach = LocalMsg::Attach {
        version: PROTOCOL_VERSION,
        job: "run".into(),
        rank: 1,
        world_size: 3,
    };
    assert!(matches!(ask(&mut c, attach), LocalMsg::Attached { .. }));
    let upload = || LocalMsg::Upload {
        copies: vec![DeviceCopy::new(0, 4096, &[1; 16], &[7; 64], 0)],
    };
    match ask(&mut c, upload()) {
        LocalMsg::Failed { reason } => assert!(reason.contains("restore first"), "{reason}"),
        other => panic!("an upload before a restore: {other:?}"),
    }
    let restore = LocalMsg::Restore {
        step: Some(3),
        file: false,
        regions: None,
    };
    match ask(&mut c, restore) {
        LocalMsg::Restored { step, source, .. } => {
            assert_eq!((step, source.to_string().as_str()), (3, "memory"))
        }
        other => panic!("restore: {other:?}"),
    }
    c.take_fd().unwrap();
    match ask(&mut c, upload()) {
        LocalMsg::Failed { reason } => assert!(reason.contains("CUDA"), "{reason}"),
        other => panic!("an upload without a GPU: {other:?}"),
    }
    assert_eq!(
        n.metric("hotstart_gpu_uploads_total{result=\"refused\"}"),
        2.0
    );
    assert_eq!(
        n.metric("hotstart_gpu_uploads_total{result=\"copied\"}"),
        0.0
    );
    // Nothing was pinned, nor tried, nor waits to be.
    for name in [
        "hotstart_gpu_pins_total{result=\"pinned\"}",
        "hotstart_gpu_pins_total{result=\"failed\"}",
        "hotstart_gpu_pinned_bytes",
        "hotstart_gpu_pin_waiting_steps",
    ] {
        assert_eq!(n.metric(name), 0.0, "{name}");
    }
}

/// Node loss: kill -9 a sidecar and its trainer, stop SeaweedFS for good; a fresh sidecar with
/// the same node id (and an empty disk) pulls its shards back from a peer before it is ready,
/// and the restarted trainer restores bit-exact from it.
pub fn node_loss_recovers_from_a_peer_without_the_store() {
    let mut weed = match SeaweedFs::start() {
        Ok(w) => w,
        Err(e) if hotstart_testkit::ci() => panic!("SeaweedFS: {e}"),
        Err(e) => {
            eprintln!("skipping: no SeaweedFS ({e})");
            return;
        }
    };
    let mut cluster = Cluster::new(3);
    cluster.store = Some((
        format!("{}/ckpt", weed.fresh_bucket("sidecar-node-loss")),
        weed.env(),
    ));
    let mut nodes = cluster.start_all();
    let mut trainers = train(&nodes);

    trainers[2].kill9();
    nodes[2].kill9();
    weed.stop();

    let fresh = cluster.start(2, 1);
    assert!(
        fresh.metric("hotstart_recovered_shards_total") >= 1.0,
        "{}",
        fresh.log()
    );
    assert!(
        fresh.log().contains("recovered from a peer"),
        "{}",
        fresh.log()
    );
    assert_eq!(
        fresh.metric("hotstart_memory_shards{origin=\"local\"}"),
        1.0
    );
    let (step, source) = restore(&fresh, &args(&restore_args(2, 3)));
    assert_eq!((step, source.as_str()), (3, "memory"), "{}", fresh.log());
    assert_eq!(fresh.metric(FROM_MEMORY), 1.0);
    // The store is gone and was never needed.
    assert_eq!(fresh.metric(GETS), 0.0);
    drop(trainers);
}

/// kill -9 of a trainer at some moment of a save, three times, while the sidecar recycles its
/// segments: a new process restores the newest complete step whole and bit-exact (the
/// trainer's own check), never older than the one restored before, and the step before it,
/// wherever it is served from, is the step it says it is.
pub fn a_trainer_killed_mid_copy_never_leaves_a_torn_or_changed_step() {
    const RECYCLED: &str = "hotstart_memory_segments_recycled_total";
    let cluster = Cluster::new(1);
    let node = cluster.start(0, 0);
    let restore_step = |step: Option<u64>| {
        let mut a = vec!["restore", "--job", "killed", "--mib", "16"];
        let s = step.map(|s| s.to_string());
        if let Some(s) = &s {
            a.extend(["--step", s]);
        }
        restore(&node, &a)
    };
    let mut last = 0;
    for (round, delay_ms) in [7u64, 23, 61].into_iter().enumerate() {
        let mut trainer = node.trainer(&[
            "save", "--job", "killed", "--mib", "16", "--steps", "1000000",
        ]);
        // Let it recycle segments, then kill it at some moment of a save.
        let deadline = Instant::now() + WATCHDOG;
        while node.metric(RECYCLED) < 3.0 * (round + 1) as f64 {
            assert!(
                Instant::now() < deadline,
                "the trainer never recycled:\n{}",
                node.metrics()
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        std::thread::sleep(Duration::from_millis(delay_ms));
        trainer.kill9();
        let (step, source) = restore_step(None);
        assert!(step >= last, "step {step} after {last}");
        assert_eq!(source, "memory");
        if step > 1 {
            assert_eq!(restore_step(Some(step - 1)).0, step - 1);
        }
        last = step;
    }
}
