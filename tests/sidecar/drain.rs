//! SIGTERM while a shard is still being persisted: with time enough, it is persisted before the
//! daemon exits 0; without, the daemon still exits 0 within the grace period and reports the
//! shard as not persisted, and nothing torn reaches the store.

use std::net::SocketAddr;

use hotstart_ckpt::{Destination, Engine, EngineConfig, StepSel};
use hotstart_store::Store;
use hotstart_testkit::SeaweedFs;

use crate::cluster::Cluster;
use crate::proxy::{self, Mode};
use crate::trainer::tensors;

/// `env` with the S3 endpoint moved to `endpoint`.
fn through(env: &[(String, String)], endpoint: SocketAddr) -> Vec<(String, String)> {
    env.iter()
        .map(|(k, v)| {
            let v = if k == "AWS_ENDPOINT_URL" {
                format!("http://{endpoint}")
            } else {
                v.clone()
            };
            (k.clone(), v)
        })
        .collect()
}

/// The environment of an S3 store at `endpoint` (plain HTTP, dummy credentials).
fn s3_at(endpoint: SocketAddr) -> Vec<(String, String)> {
    [
        ("AWS_ENDPOINT_URL", format!("http://{endpoint}")),
        ("AWS_ALLOW_HTTP", "true".into()),
        ("AWS_REGION", "us-east-1".into()),
        ("AWS_ACCESS_KEY_ID", "k".into()),
        ("AWS_SECRET_ACCESS_KEY", "s".into()),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v))
    .collect()
}

/// Saves one step of `mib` MiB on node 0 and kills the trainer once the sidecar holds it.
fn save_then_kill_trainer(node: &crate::cluster::Node, mib: &str) {
    let mut t = node.trainer(&["save", "--job", "run", "--mib", mib, "--hold"]);
    assert_eq!(t.until("done"), ["saved 1"]);
    t.kill9();
}

pub fn sigterm_drains_persistence() {
    let Some(weed) = SeaweedFs::shared() else {
        return;
    };
    // 16 MiB through 8 MiB/s: two seconds of upload after the commit.
    let slow = proxy::start(Mode::Throttle {
        upstream: weed.addr(),
        bytes_per_sec: 8 << 20,
    });
    let url = format!("{}/ckpt", weed.fresh_bucket("sidecar-drain"));
    let mut cluster = Cluster::new(1);
    cluster.store = Some((url.clone(), through(&weed.env(), slow)));
    cluster.args = vec!["--grace".into(), "90s".into()];
    let mut node = cluster.start(0, 0);
    save_then_kill_trainer(&node, "16");
    let status = node.sigterm();
    let log = node.log();
    assert!(status.success(), "{log}");
    assert!(
        log.contains("draining: waiting for in-flight persistence"),
        "{log}"
    );
    assert!(
        log.contains("drained: everything committed is persisted"),
        "{log}"
    );
    assert!(!log.contains("NOT PERSISTED"), "{log}");

    // The store has the whole step, bit-exact.
    let store = Store::open_with(&url, &weed.client_options()).expect("store");
    let engine = Engine::new(EngineConfig::new("run", 0, 1).store(store)).expect("engine");
    let loaded = engine
        .load(StepSel::Latest, Destination::Owned)
        .expect("load from the store");
    assert_eq!(loaded.step, 1);
    let want = tensors(1, 0, 16);
    assert_eq!(loaded.tensors.len(), want.len());
    for ((name, _, _, bytes), t) in want.iter().zip(&loaded.tensors) {
        assert_eq!(&t.name, name);
        assert!(t.data[..] == bytes[..], "{name}");
    }
}

/// One node whose store is S3 at `endpoint`: a step of 4 MiB saved, its trainer killed, then
/// SIGTERM with `grace`; the node's log, once it exited 0.
fn drained_with_store_at(endpoint: SocketAddr, grace: &str) -> String {
    let mut cluster = Cluster::new(1);
    cluster.store = Some(("s3://nowhere/ckpt".into(), s3_at(endpoint)));
    cluster.args = vec!["--grace".into(), grace.into()];
    let mut node = cluster.start(0, 0);
    save_then_kill_trainer(&node, "4");
    let status = node.sigterm();
    let log = node.log();
    assert!(status.success(), "{log}");
    log
}

pub fn sigterm_reports_what_was_not_persisted() {
    let log = drained_with_store_at(proxy::start(Mode::BlackHole), "2s");
    assert!(log.contains("not persisted before exit"), "{log}");
    assert!(
        log.contains("NOT PERSISTED run step 1 rank 0 (tiers: store; the grace period ran out)"),
        "{log}"
    );
}

/// SIGTERM after a tier failed a step (a store that refuses connections: its client gives up
/// within seconds, well inside the grace period): the step is reported as not persisted, naming
/// the tier, never as "everything persisted".
pub fn sigterm_reports_a_step_a_tier_failed() {
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let endpoint = closed.local_addr().unwrap();
    drop(closed);
    let log = drained_with_store_at(endpoint, "120s");
    assert!(
        log.contains("NOT PERSISTED run step 1 rank 0 (tiers: store; they failed it"),
        "{log}"
    );
    assert!(!log.contains("everything committed is persisted"), "{log}");
    assert!(!log.contains("shard(s) persisted"), "{log}");
}

/// SIGTERM while a node still looks for its peers (none of them runs, and the recovery timeout
/// is 20 s): the recovery ends at once, and the sidecar exits 0.
pub fn sigterm_while_recovering_ends_the_recovery() {
    let cluster = Cluster::new(3);
    let mut node = cluster.start_unready(0, 0);
    node.wait_for_log("to=recovering");
    let status = node.sigterm();
    let log = node.log();
    assert!(status.success(), "{log}");
    assert!(
        log.contains("recovery stopped: the sidecar is shutting down"),
        "{log}"
    );
    assert!(!log.contains("recovery timed out"), "{log}");
}
