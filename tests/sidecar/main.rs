//! End-to-end tests of `hotstart serve` with real processes: sidecars (the `hotstart` binary)
//! on their own 127.x.y.z addresses, stand-in training processes, a real SeaweedFS, `kill -9`,
//! SIGTERM, hostile peers and corrupt shards.
//!
//! The test binary is its own training process: `sidecar trainer save|restore ...` runs the
//! role in `trainer.rs` (so it has a main of its own, `harness = false`). Without that first
//! argument it runs every test whose name contains one of the arguments (all without any),
//! one after another: each starts several processes, and the machine they run on is small.

mod budget;
mod cluster;
mod drain;
mod hostile;
mod proxy;
mod restart;
mod share;
mod trainer;

use std::process::ExitCode;
use std::time::Instant;

type Test = (&'static str, fn());

const TESTS: &[Test] = &[
    (
        "trainer_kill_restores_from_memory",
        restart::trainer_kill_restores_from_memory,
    ),
    (
        "a_trainer_killed_mid_copy_never_leaves_a_torn_or_changed_step",
        restart::a_trainer_killed_mid_copy_never_leaves_a_torn_or_changed_step,
    ),
    (
        "node_loss_recovers_from_a_peer_without_the_store",
        restart::node_loss_recovers_from_a_peer_without_the_store,
    ),
    (
        "tokens_frames_and_checksums_are_enforced",
        hostile::tokens_frames_and_checksums_are_enforced,
    ),
    (
        "no_token_refuses_to_start",
        hostile::no_token_refuses_to_start,
    ),
    (
        "budget_evicts_oldest_and_keeps_newest",
        budget::budget_evicts_oldest_and_keeps_newest,
    ),
    (
        "replicas_restore_from_the_store_about_once_for_the_job",
        share::replicas_restore_from_the_store_about_once_for_the_job,
    ),
    (
        "sigterm_drains_persistence",
        drain::sigterm_drains_persistence,
    ),
    (
        "sigterm_reports_what_was_not_persisted",
        drain::sigterm_reports_what_was_not_persisted,
    ),
    (
        "sigterm_reports_a_step_a_tier_failed",
        drain::sigterm_reports_a_step_a_tier_failed,
    ),
    (
        "sigterm_while_recovering_ends_the_recovery",
        drain::sigterm_while_recovering_ends_the_recovery,
    ),
];

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some("trainer") {
        return trainer::main(&args[1..]);
    }
    if args.iter().any(|a| a == "--list") {
        for (name, _) in TESTS {
            println!("{name}: test");
        }
        return ExitCode::SUCCESS;
    }
    let filters: Vec<&str> = args
        .iter()
        .filter(|a| !a.starts_with('-'))
        .map(String::as_str)
        .collect();
    let chosen: Vec<&Test> = TESTS
        .iter()
        .filter(|(name, _)| filters.is_empty() || filters.iter().any(|f| name.contains(f)))
        .collect();
    println!("\nrunning {} tests", chosen.len());
    let mut failed = Vec::new();
    let started = Instant::now();
    for (name, test) in &chosen {
        let t = Instant::now();
        let ok = std::panic::catch_unwind(test).is_ok();
        println!(
            "test {name} ... {} ({:.1}s)",
            if ok { "ok" } else { "FAILED" },
            t.elapsed().as_secs_f64()
        );
        if !ok {
            failed.push(*name);
        }
    }
    println!(
        "\ntest result: {}. {} passed; {} failed; finished in {:.1}s\n",
        if failed.is_empty() { "ok" } else { "FAILED" },
        chosen.len() - failed.len(),
        failed.len(),
        started.elapsed().as_secs_f64()
    );
    if failed.is_empty() {
        ExitCode::SUCCESS
    } else {
        for f in failed {
            println!("    {f}");
        }
        ExitCode::FAILURE
    }
}
