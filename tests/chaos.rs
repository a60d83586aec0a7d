//! A short random fault campaign with fixed seeds: the demo's real sidecars and trainers, faults
//! drawn from each seed, every invariant checked after each fault and at the end.
//!
//! The trainers and sidecars are this package's `hotstart` binary, the one Cargo builds for
//! every test of the workspace.

use std::path::PathBuf;

/// Seeds 1, 2 and 3, 15 faults each, every invariant checked at least once and every kind of
/// fault injected by one of them. Seed 1 once saw
/// two ranks resume from different steps (each asked its own node's sidecar; now rank 0 decides
/// for the job), seed 3 a step the ledger still counted after the job had gone back past it (now
/// abandoned at the restore). Replay one with `hotstart demo --chaos 15 --seed S`.
#[test]
fn fixed_seed_campaigns_break_no_invariant() {
    let exe = PathBuf::from(env!("CARGO_BIN_EXE_hotstart"));
    let mut kinds = std::collections::BTreeSet::new();
    for seed in [1u64, 2, 3] {
        let dir = tempfile_dir(seed);
        let summary = hotstart_demo::chaos::run(&hotstart_demo::chaos::ChaosConfig {
            demo: hotstart_demo::DemoConfig {
                trainer: Default::default(),
                exe: exe.clone(),
                dir: dir.clone(),
                store: None,
                nodes: 3,
                state_bytes: 4 << 20,
                every: 10,
                elastic: false,
                seed,
                live: false,
            },
            faults: 15,
        })
        .unwrap();
        assert!(
            summary.violation.is_none(),
            "seed {seed}: {}",
            hotstart_demo::chaos::table(&summary)
        );
        assert_eq!(summary.injected, 15);
        assert!(
            summary.checks.values().all(|n| *n > 0),
            "seed {seed}: {:?}",
            summary.checks
        );
        kinds.extend(summary.kinds.keys().cloned());
        kinds.extend(summary.not_drawn.keys().cloned());
        let _ = std::fs::remove_dir_all(&dir);
    }
    // Between them the three seeds draw every kind of fault (a full disk only as root, where
    // each node's disk can be a filesystem of its own; the summary says when it is not drawn).
    for kind in hotstart_demo::chaos::plan::KINDS {
        assert!(kinds.contains(kind), "no seed injected {kind}: {kinds:?}");
    }
}

fn tempfile_dir(seed: u64) -> PathBuf {
    let d = std::env::temp_dir().join(format!("hotstart-chaos-{}-{seed}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}
