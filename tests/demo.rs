//! `hotstart demo` end to end at a small size: three real sidecars and trainers, the three faults
//! (kill -9 of a trainer, of a whole node, every node plus a flipped byte on disk), and the JSON
//! summary's proof that every recovery was bit-exact and came from the tier it should, the
//! peers linked over TLS.

use std::process::Command;

use serde_json::Value;

#[test]
fn demo_recovers_every_fault_bit_exact() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_hotstart"))
        .args(["demo", "--size", "8MiB", "--every", "50", "--json", "--dir"])
        .arg(dir.path())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "hotstart demo failed:\n{stderr}");
    let summary: Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("summary is not JSON ({e}):\n{stderr}"));

    assert_eq!(summary["nodes"], 3);
    assert_eq!(summary["problems"], Value::Array(vec![]), "{stderr}");
    let faults = summary["faults"].as_array().unwrap();
    assert_eq!(faults.len(), 3, "{summary:#}");
    let mut last_step = 0;
    for f in faults {
        assert_eq!(f["exact"], true, "{f:#}");
        let step = f["step"].as_u64().unwrap();
        assert!(step > last_step, "restored steps go forward: {summary:#}");
        last_step = step;
        assert_eq!(f["sources"].as_array().unwrap().len(), 3, "{f:#}");
    }
    let sources = |i: usize| -> Vec<String> {
        faults[i]["sources"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s.as_str().unwrap().to_string())
            .collect()
    };
    // A trainer killed: every rank comes back from its sidecar's memory.
    assert!(sources(0).iter().all(|s| s == "memory"), "{:?}", sources(0));
    // Every node killed: no memory survives; rank 0's flipped chunk comes from the store.
    let third = sources(2);
    assert!(third.iter().all(|s| !s.contains("memory")), "{third:?}");
    assert!(third[0].contains("store"), "{third:?}");

    // Peers replicated over mutual TLS, with certificates made for the run.
    assert!(stderr.contains("peers over mutual TLS 1.3"), "{stderr}");
    for node in 0..3 {
        let log = std::fs::read_to_string(dir.path().join(format!("node-{node}.log"))).unwrap();
        assert!(log.contains("tls=true"), "node-{node} without TLS:\n{log}");
    }

    // Every tier took part.
    let tiers: Vec<&str> = summary["tiers"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t["tier"].as_str().unwrap())
        .collect();
    for tier in ["memory", "peer", "disk", "store"] {
        assert!(tiers.contains(&tier), "{tiers:?}");
    }
}

/// `hotstart demo --elastic` at a small size: a node lost for good, the job resharded onto 2
/// ranks from the survivors' memory, then grown back to 3; every reshard's job digest equal to
/// the one saved, no chunk read from disk or store.
#[test]
fn demo_elastic_reshards_from_memory_bit_exact() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_hotstart"))
        .args(["demo", "--elastic", "--size", "8MiB", "--every", "50"])
        .args(["--json", "--dir"])
        .arg(dir.path())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "hotstart demo --elastic failed:\n{stderr}"
    );
    let summary: Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("summary is not JSON ({e}):\n{stderr}"));
    assert_eq!(summary["problems"], Value::Array(vec![]), "{stderr}");
    let faults = summary["faults"].as_array().unwrap();
    assert_eq!(faults.len(), 2, "{summary:#}");
    // Shrunk to 2 ranks, then grown back to 3, each from a newer step.
    let mut last_step = 0;
    for (f, ranks) in faults.iter().zip([2, 3]) {
        assert_eq!(f["exact"], true, "{f:#}");
        let step = f["step"].as_u64().unwrap();
        assert!(step > last_step, "{summary:#}");
        last_step = step;
        let sources = f["sources"].as_array().unwrap();
        assert_eq!(sources.len(), ranks, "{f:#}");
        for s in sources {
            let s = s.as_str().unwrap();
            assert!(
                !s.contains("disk") && !s.contains("store") && s != "nothing",
                "a reshard read outside the cluster's memory: {f:#}"
            );
        }
    }
    assert!(
        faults[0]["fault"]
            .as_str()
            .unwrap()
            .contains("not replaced")
    );
    // The steps the bigger job trained past the resharded step, trained again with the same
    // job-wide losses (every rank was a few steps past it when the job restarted).
    let replayed: u64 = faults
        .iter()
        .map(|f| f["replayed_steps"].as_u64().unwrap())
        .sum();
    assert!(replayed > 0, "{summary:#}");
}
