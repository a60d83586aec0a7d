//! A full local disk: a real 8 MiB tmpfs as the disk tier (needs root to mount; skipped with a
//! message otherwise).

mod common;

use std::process::Command;

use common::*;
use hotstart_ckpt::{Destination, Error, StepSel, TierKind};

struct Mount(std::path::PathBuf);

impl Drop for Mount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

#[test]
fn disk_full_reports_error_and_keeps_earlier_steps() {
    let dir = tempfile::tempdir().unwrap();
    let ok = Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=8m", "tmpfs"])
        .arg(dir.path())
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        eprintln!(
            "skipping disk_full_reports_error_and_keeps_earlier_steps: cannot mount tmpfs (not root?)"
        );
        return;
    }
    let _mount = Mount(dir.path().to_path_buf());
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
