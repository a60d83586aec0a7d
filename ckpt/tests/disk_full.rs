//! A full local disk: a real 8 MiB tmpfs as the disk tier (needs root to mount; skipped with a
//! message otherwise, and a failure in CI).

mod common;

use std::process::Command;

use common::*;
use hotstart_ckpt::{Destination, Error, StepSel, TierKind};

/// An 8 MiB tmpfs in a new temporary directory, unmounted when dropped; `None` (with a
/// message naming `test`) where it cannot be mounted.
struct Mount(tempfile::TempDir);

impl Mount {
    fn tmpfs(test: &str) -> Option<Mount> {
        let dir = tempfile::tempdir().unwrap();
        let ok = Command::new("mount")
            .args(["-t", "tmpfs", "-o", "size=8m", "tmpfs"])
            .arg(dir.path())
            .status()
            .is_ok_and(|s| s.success());
        if !ok {
            assert!(
                !hotstart_testkit::ci(),
                "CI must run {test}: cannot mount tmpfs"
            );
            eprintln!("skipping {test}: cannot mount tmpfs (not root?)");
            return None;
        }
        Some(Mount(dir))
    }

    fn path(&self) -> &std::path::Path {
        self.0.path()
    }
}

impl Drop for Mount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(self.0.path()).status();
    }
}

#[test]
fn disk_full_reports_error_and_keeps_earlier_steps() {
    let Some(dir) = Mount::tmpfs("disk_full_reports_error_and_keeps_earlier_steps") else {
        return;
    };
    let mut cfg = config("full").disk(dir.path());
    cfg.keep = 0; // keep everything, so the disk fills up
    let engine = engine(cfg);
    let set1 = sample_tensors(1, 3 << 20);
    engine
        .save(1, to_tensors(&set1), extras(1))
        .unwrap()
        .wait()
        .unwrap();
    let set2 = sample_tensors(2, 3 << 20);
    engine
        .save(2, to_tensors(&set2), extras(2))
        .unwrap()
        .wait()
        .unwrap();
    // 6+ MiB used of 8: the next 3 MiB does not fit.
    let set3 = sample_tensors(3, 3 << 20);
    let h = engine.save(3, to_tensors(&set3), extras(3)).unwrap();
    h.wait_staged().unwrap();
    let e = h.wait_persisted(TierKind::Disk).unwrap_err();
    assert!(
        matches!(
            e,
            Error::Persist {
                tier: TierKind::Disk,
                step: 3,
                ..
            }
        ),
        "{e:?}"
    );
    eprintln!("disk full error: {e}");
    engine.wait_idle();
    assert_eq!(engine.complete_steps(TierKind::Disk).unwrap(), vec![1, 2]);
    assert_eq!(engine.latest_complete_step().unwrap(), Some(2));
    // No leftovers of the failed write.
    let step3 = dir.path().join("full/step-3");
    let left: Vec<_> = std::fs::read_dir(&step3)
        .map(|d| d.map(|e| e.unwrap().file_name()).collect())
        .unwrap_or_default();
    assert!(left.is_empty(), "left in step-3: {left:?}");
    assert_loaded(
        &engine.load(StepSel::Step(1), Destination::Owned).unwrap(),
        &set1,
        &extras(1),
    );
    assert_loaded(
        &engine.load(StepSel::Latest, Destination::Owned).unwrap(),
        &set2,
        &extras(2),
    );
}

/// A disk that filled up with more steps than retention keeps (as when steps stay on disk while
/// their upload waits out a store outage) frees itself: retention runs after a save that failed
/// on the disk too, so the next save fits. Found by a fault campaign (`hotstart demo --chaos 1000
/// --seed 7`): a node's disk tier stayed full for good, every later save failing on it.
#[test]
fn a_disk_full_of_old_steps_frees_itself_after_a_failed_save() {
    let Some(dir) = Mount::tmpfs("a_disk_full_of_old_steps_frees_itself_after_a_failed_save")
    else {
        return;
    };
    // Two steps of 3 MiB kept (keep 0: everything) fill 6 of the 8 MiB.
    let mut cfg = config("wedge").disk(dir.path());
    cfg.keep = 0;
    let first = engine(cfg);
    for step in 1..=2 {
        let set = sample_tensors(step, 3 << 20);
        first
            .save(step, to_tensors(&set), extras(step))
            .unwrap()
            .wait()
            .unwrap();
    }
    first.wait_idle();
    drop(first);
    // Now keeping one step: the first save does not fit, and retention after it frees step 1.
    let mut cfg = config("wedge").disk(dir.path());
    cfg.keep = 1;
    let engine = engine(cfg);
    let set3 = sample_tensors(3, 3 << 20);
    let h = engine.save(3, to_tensors(&set3), extras(3)).unwrap();
    assert!(
        matches!(
            h.wait_persisted(TierKind::Disk),
            Err(Error::Persist { step: 3, .. })
        ),
        "step 3 should not fit on the full disk"
    );
    engine.wait_idle();
    assert_eq!(engine.complete_steps(TierKind::Disk).unwrap(), vec![2]);
    let set4 = sample_tensors(4, 3 << 20);
    engine
        .save(4, to_tensors(&set4), extras(4))
        .unwrap()
        .wait()
        .unwrap();
    engine.wait_idle();
    assert_eq!(engine.complete_steps(TierKind::Disk).unwrap(), vec![4]);
    assert_loaded(
        &engine.load(StepSel::Latest, Destination::Owned).unwrap(),
        &set4,
        &extras(4),
    );
}
