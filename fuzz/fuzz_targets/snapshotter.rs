//! The containerd snapshotter's requests, as containerd sends them over its socket: a sequence
//! of protobuf requests (prepare, view, mounts, commit, remove, stat, update, list, usage,
//! cleanup) applied to a fresh state in memory. Each input is a list of (operation byte,
//! 16-bit length, message); what is refused changes nothing, and the state reopens.
#![no_main]

use std::collections::BTreeMap;
use std::sync::OnceLock;

use hotstart_fuzz::{scratch, set_bound};
use hotstart_image::snapshotter::Snapshots;
use hotstart_image::snapshotter::api::services::snapshots::v1 as pb;
use libfuzzer_sys::fuzz_target;
use prost::Message;

fn labels(l: std::collections::HashMap<String, String>) -> BTreeMap<String, String> {
    l.into_iter().collect()
}

fn apply(s: &Snapshots, op: u8, msg: &[u8]) -> Option<()> {
    match op % 10 {
        0 => {
            let r = pb::PrepareSnapshotRequest::decode(msg).ok()?;
            s.prepare(&r.key, &r.parent, labels(r.labels)).ok()?;
        }
        1 => {
            let r = pb::ViewSnapshotRequest::decode(msg).ok()?;
            s.view(&r.key, &r.parent, labels(r.labels)).ok()?;
        }
        2 => {
            s.mounts(&pb::MountsRequest::decode(msg).ok()?.key).ok()?;
        }
        3 => {
            let r = pb::CommitSnapshotRequest::decode(msg).ok()?;
            s.commit(&r.name, &r.key, labels(r.labels)).ok()?;
        }
        4 => {
            s.remove(&pb::RemoveSnapshotRequest::decode(msg).ok()?.key)
                .ok()?;
        }
        5 => {
            s.stat(&pb::StatSnapshotRequest::decode(msg).ok()?.key)
                .ok()?;
        }
        6 => {
            let r = pb::UpdateSnapshotRequest::decode(msg).ok()?;
            let i = r.info?;
            let paths = r.update_mask.map(|m| m.paths).unwrap_or_default();
            s.update(&i.name, labels(i.labels), &paths).ok()?;
        }
        7 => {
            s.list(&pb::ListSnapshotsRequest::decode(msg).ok()?.filters)
                .ok()?;
        }
        8 => {
            s.usage(&pb::UsageRequest::decode(msg).ok()?.key).ok()?;
        }
        _ => {
            s.cleanup().ok()?;
        }
    }
    Some(())
}

fuzz_target!(init: set_bound(16 << 20), |data: &[u8]| {
    static ROOT: OnceLock<std::path::PathBuf> = OnceLock::new();
    let root = ROOT.get_or_init(|| scratch("snapshotter").join("state"));
    let _ = std::fs::remove_dir_all(root);
    let s = Snapshots::open(root).expect("open a fresh state");
    let mut rest = data;
    for _ in 0..16 {
        let [op, a, b, tail @ ..] = rest else { break };
        let len = usize::from(u16::from_le_bytes([*a, *b])).min(tail.len());
        let (msg, after) = tail.split_at(len);
        let before = s.list(&[]).expect("list").len();
        if apply(&s, *op, msg).is_none() && *op % 10 != 9 {
            assert_eq!(s.list(&[]).expect("list").len(), before, "a refused request changed the state");
        }
        rest = after;
    }
    let listed = s.list(&[]).expect("list").len();
    drop(s);
    let again = Snapshots::open(root).expect("the state reopens");
    assert_eq!(again.list(&[]).expect("list").len(), listed);
});
