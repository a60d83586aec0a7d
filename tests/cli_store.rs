//! End-to-end: the `hotstart` binary copying files to and from real stores.

use std::path::Path;
use std::process::Command;

use hotstart_testkit::{SeaweedFs, pattern, run_ok};

fn hotstart() -> Command {
    Command::new(env!("CARGO_BIN_EXE_hotstart"))
}

/// Upload, list, download; the downloaded bytes equal the source.
fn round_trip(base_url: &str, env: &[(String, String)], work: &Path) {
    let src = work.join("model.bin");
    let data = pattern((20 << 20) + 12_345, 42);
    std::fs::write(&src, &data).unwrap();
    let url = format!("{base_url}/runs/model.bin");
    let with_env = |c: &mut Command| {
        for (k, v) in env {
            c.env(k, v);
        }
    };
    let mut up = hotstart();
    up.args(["store", "cp", "--stripe-size", "5242880"])
        .arg(&src)
        .arg(&url);
    with_env(&mut up);
    run_ok(&mut up);

    // Into a folder: a URL ending in '/' keeps the file's name, inside that folder.
    let mut into = hotstart();
    into.args(["store", "cp"])
        .arg(&src)
        .arg(format!("{base_url}/runs/folder/"));
    with_env(&mut into);
    run_ok(&mut into);

    let mut ls = hotstart();
    ls.args(["store", "ls", &format!("{base_url}/runs/")]);
    with_env(&mut ls);
    let listing = run_ok(&mut ls);
    let line = |key: &str| {
        listing
            .lines()
            .find(|l| l.ends_with(&format!("/{key}")))
            .unwrap_or_else(|| panic!("{key} is not listed: {listing}"))
            .to_string()
    };
    for key in ["runs/model.bin", "runs/folder/model.bin"] {
        assert!(line(key).contains(&data.len().to_string()), "{listing}");
    }
    assert_eq!(listing.lines().count(), 2, "{listing}");

    let dst = work.join("back.bin");
    let mut down = hotstart();
    down.args(["store", "cp", &url]).arg(&dst);
    with_env(&mut down);
    run_ok(&mut down);
    assert!(
        std::fs::read(&dst).unwrap() == data,
        "downloaded bytes differ"
    );
    // No temporary files left beside the destination.
    let names: Vec<_> = std::fs::read_dir(work)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(
        names.len(),
        2 + usize::from(work.join("store").exists()),
        "{names:?}"
    );
}

#[test]
fn copies_through_a_local_directory_store() {
    let work = tempfile::tempdir().unwrap();
    let store = work.path().join("store");
    round_trip(&format!("file://{}", store.display()), &[], work.path());
    assert!(
        store.join("runs/model.bin").is_file(),
        "a plain file in the store directory"
    );
}

#[test]
fn copies_through_seaweedfs() {
    let Some(weed) = SeaweedFs::shared() else {
        return;
    };
    let bucket = weed.fresh_bucket("cli");
    let work = tempfile::tempdir().unwrap();
    round_trip(&bucket, &weed.env(), work.path());
}

#[test]
fn bad_input_gets_a_clear_error() {
    let out = hotstart()
        .args(["store", "ls", "ftp://x/y"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("\"ftp://x/y\"") && err.contains("unknown scheme"),
        "{err}"
    );

    let work = tempfile::tempdir().unwrap();
    let url = format!("file://{}/store/missing.bin", work.path().display());
    let out = hotstart()
        .args(["store", "cp", &url])
        .arg(work.path().join("x"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("not found"), "{err}");
    assert!(!work.path().join("x").exists());

    // Listing a directory that is not there is an error, and does not make it.
    let missing = work.path().join("nowhere");
    let out = hotstart()
        .args(["store", "ls"])
        .arg(&missing)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("is not a directory"), "{err}");
    assert!(!missing.exists());

    // A stripe of no bytes is refused by the argument parser, not cut into one-byte parts.
    let src = work.path().join("one.bin");
    std::fs::write(&src, b"bytes").unwrap();
    let dst = format!("file://{}/store/one.bin", work.path().display());
    let out = hotstart()
        .args(["store", "cp", "--stripe-size", "0"])
        .arg(&src)
        .arg(&dst)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--stripe-size") && err.contains("4096"),
        "{err}"
    );
    assert!(!work.path().join("store").exists());
}

/// With no S3 credentials set anywhere, the client asks the instance metadata service last; when
/// that gives none, the error says which variables to set rather than only the service's answer.
#[test]
fn missing_s3_credentials_name_the_variables_to_set() {
    // Nothing listens on port 9: neither the store nor the metadata service answers.
    let mut cmd = hotstart();
    for (key, _) in std::env::vars().filter(|(k, _)| k.starts_with("AWS_")) {
        cmd.env_remove(key);
    }
    let out = cmd
        .args(["store", "ls", "s3://bucket/runs"])
        .env("AWS_ENDPOINT", "http://127.0.0.1:9")
        .env("AWS_ALLOW_HTTP", "true")
        .env("AWS_METADATA_ENDPOINT", "http://127.0.0.1:9")
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("no S3 credentials"), "{err}");
    assert!(
        err.contains("AWS_ACCESS_KEY_ID") && err.contains("AWS_SECRET_ACCESS_KEY"),
        "{err}"
    );
    assert!(err.contains("127.0.0.1:9/latest/api/token"), "{err}");
}

/// Output piped into a reader that stops early ends the program quietly and successfully, as
/// `hotstart ckpt` does, without a panic. The listing is larger than a pipe holds, so it cannot all fit before the
/// reader goes away.
#[test]
fn a_closed_output_pipe_ends_quietly() {
    let work = tempfile::tempdir().unwrap();
    for i in 0..2000 {
        std::fs::write(work.path().join(format!("{i:0>64}")), b"x").unwrap();
    }
    let mut child = hotstart()
        .args(["store", "ls"])
        .arg(work.path())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}
