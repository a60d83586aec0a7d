//! The Kubernetes example (deploy/kubernetes/job.yaml) and the Dockerfile against the daemon they
//! run: every `HOTSTART_*` variable is one `hotstart serve` reads, the settings resolve, and the
//! ports, probes, socket, shared memory, disk and drain grace agree with the resolved config.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;

use hotstart_sidecar::{Settings, Token};
use serde::Deserialize;
use serde_yaml::Value;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn documents(path: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(path).unwrap();
    serde_yaml::Deserializer::from_str(&text)
        .map(|d| Value::deserialize(d).unwrap())
        .filter(|v| !v.is_null())
        .collect()
}

/// `v[a][b]...` along a dotted path; names the path when something is missing.
fn at<'a>(v: &'a Value, path: &str) -> &'a Value {
    path.split('.').fold(v, |v, key| {
        let next = match key.parse::<usize>() {
            Ok(i) => v.get(i),
            Err(_) => v.get(key),
        };
        next.unwrap_or_else(|| panic!("job.yaml: no {path} (stopped at {key})"))
    })
}

fn str_at<'a>(v: &'a Value, path: &str) -> &'a str {
    at(v, path)
        .as_str()
        .unwrap_or_else(|| panic!("job.yaml: {path} is not a string"))
}

fn named<'a>(list: &'a Value, name: &str) -> &'a Value {
    list.as_sequence()
        .into_iter()
        .flatten()
        .find(|c| c.get("name").and_then(Value::as_str) == Some(name))
        .unwrap_or_else(|| panic!("job.yaml: nothing named {name}"))
}

/// A Kubernetes quantity such as `48Gi` in bytes.
fn quantity(q: &str) -> u64 {
    let (n, unit) = q.split_at(q.find(|c: char| !c.is_ascii_digit()).unwrap_or(q.len()));
    let shift = match unit {
        "" => 0,
        "Ki" => 10,
        "Mi" => 20,
        "Gi" => 30,
        "Ti" => 40,
        other => panic!("unexpected unit {other:?} in {q:?}"),
    };
    n.parse::<u64>().unwrap() << shift
}

/// Variables with literal values, by name.
fn env(container: &Value) -> BTreeMap<String, String> {
    at(container, "env")
        .as_sequence()
        .unwrap()
        .iter()
        .filter_map(|e| Some((str_at(e, "name").into(), e.get("value")?.as_str()?.into())))
        .collect()
}

/// Mount path of `volume` in `container`.
fn mount_of<'a>(container: &'a Value, volume: &str) -> Option<&'a str> {
    at(container, "volumeMounts")
        .as_sequence()
        .unwrap()
        .iter()
        .find(|m| str_at(m, "name") == volume)
        .map(|m| str_at(m, "mountPath"))
}

/// The volume `container` mounts at `path`.
fn volume_at<'a>(container: &'a Value, path: &Path) -> &'a str {
    at(container, "volumeMounts")
        .as_sequence()
        .unwrap()
        .iter()
        .find(|m| Path::new(str_at(m, "mountPath")) == path)
        .map(|m| str_at(m, "name"))
        .unwrap_or_else(|| panic!("nothing mounted at {}", path.display()))
}

fn port_named(container: &Value, name: &str) -> u16 {
    at(named(at(container, "ports"), name), "containerPort")
        .as_u64()
        .unwrap() as u16
}

#[test]
fn kubernetes_example_matches_the_daemon() {
    let docs = documents(&root().join("deploy/kubernetes/job.yaml"));
    let kind = |k: &str| {
        docs.iter()
            .find(|d| d.get("kind").and_then(Value::as_str) == Some(k))
            .unwrap_or_else(|| panic!("job.yaml has no {k}"))
    };
    let (service, job) = (kind("Service"), kind("Job"));
    let pod = at(job, "spec.template.spec");

    // The sidecar is a native sidecar running `hotstart serve`.
    let sidecar = named(at(pod, "initContainers"), "hotstart");
    assert_eq!(str_at(sidecar, "restartPolicy"), "Always");
    assert_eq!(str_at(sidecar, "args.0"), "serve");

    // Every variable is one the daemon reads...
    let vars = env(sidecar);
    let help = Command::new(env!("CARGO_BIN_EXE_hotstart"))
        .args(["serve", "--help"])
        .output()
        .unwrap();
    assert!(help.status.success());
    let help = String::from_utf8(help.stdout).unwrap();
    for name in vars.keys().filter(|k| k.starts_with("HOTSTART_")) {
        assert!(
            help.contains(&format!("[env: {name}=")),
            "job.yaml sets {name}, which `hotstart serve` does not read"
        );
    }

    // ...and their values resolve, the token read from the mounted Secret.
    let token_path = PathBuf::from(&vars["HOTSTART_CLUSTER_TOKEN_FILE"]);
    let secret_mount = mount_of(sidecar, "cluster-token").expect("the token Secret is mounted");
    assert!(token_path.starts_with(secret_mount), "{token_path:?}");
    let secret = str_at(
        named(at(pod, "volumes"), "cluster-token"),
        "secret.secretName",
    );
    assert_eq!(secret, "hotstart-cluster-token");
    let scratch = tempfile::tempdir().unwrap();
    let token_file = scratch.path().join("token");
    std::fs::write(&token_file, "0123456789abcdef0123456789abcdef").unwrap();
    let mut toml = String::new();
    for (name, value) in &vars {
        let Some(key) = name.strip_prefix("HOTSTART_") else {
            continue;
        };
        let key = match key {
            "CLUSTER_TOKEN_FILE" => "token_file".to_string(),
            k => k.to_lowercase(),
        };
        let value = match (key.as_str(), value.parse::<u64>()) {
            ("token_file", _) => format!("{:?}", token_file.display().to_string()),
            (_, Ok(n)) => n.to_string(),
            (_, Err(_)) => format!("{value:?}"),
        };
        toml.push_str(&format!("{key} = {value}\n"));
    }
    let cfg = Settings::from_toml(&toml)
        .and_then(Settings::resolve)
        .unwrap_or_else(|e| panic!("job.yaml's settings do not resolve: {e}\n{toml}"));
    assert!(cfg.token.is_some());
    // Peer links encrypted, with the certificates of a mounted Secret.
    let tls_dir = cfg.tls_dir.as_deref().expect("peer links over TLS");
    assert_eq!(mount_of(sidecar, "peer-tls").map(Path::new), Some(tls_dir));
    let tls_secret = str_at(named(at(pod, "volumes"), "peer-tls"), "secret.secretName");
    let comments = std::fs::read_to_string(root().join("deploy/kubernetes/job.yaml")).unwrap();
    assert!(comments.contains(&format!("kubectl create secret generic {tls_secret}")));

    // Ports and probes.
    assert_eq!(port_named(sidecar, "peer"), cfg.listen.port());
    assert_eq!(port_named(sidecar, "http"), cfg.http.port());
    for (probe, path) in [
        ("startupProbe", "/readyz"),
        ("readinessProbe", "/readyz"),
        ("livenessProbe", "/livez"),
    ] {
        assert_eq!(str_at(sidecar, &format!("{probe}.httpGet.path")), path);
        assert_eq!(str_at(sidecar, &format!("{probe}.httpGet.port")), "http");
    }
    // The startup probe waits at least as long as recovery from peers may take.
    let startup = |k: &str| at(sidecar, &format!("startupProbe.{k}")).as_u64().unwrap();
    assert!(
        startup("periodSeconds") * startup("failureThreshold") >= cfg.recovery_timeout.as_secs()
    );

    // Peers through the headless Service the pods are a subdomain of.
    let svc_name = str_at(service, "metadata.name");
    assert!(at(service, "spec.clusterIP").as_str() == Some("None"));
    assert_eq!(
        at(service, "spec.publishNotReadyAddresses").as_bool(),
        Some(true)
    );
    let svc_port = at(named(at(service, "spec.ports"), "peer"), "port")
        .as_u64()
        .unwrap();
    assert_eq!(svc_port, u64::from(cfg.listen.port()));
    assert_eq!(str_at(pod, "subdomain"), svc_name);
    assert_eq!(
        cfg.peers_dns.as_deref(),
        Some(format!("{svc_name}:{svc_port}").as_str())
    );
    let selector = at(service, "spec.selector").as_mapping().unwrap();
    let labels = at(job, "spec.template.metadata.labels")
        .as_mapping()
        .unwrap();
    for (k, v) in selector {
        assert_eq!(labels.get(k), Some(v), "the Service selects the job's pods");
    }

    // The trainer reaches the socket through a volume both containers mount at the same path.
    let trainer = named(at(pod, "containers"), "trainer");
    assert_eq!(
        env(trainer)["HOTSTART_SOCKET"],
        cfg.socket.display().to_string()
    );
    let socket_dir = cfg.socket.parent().unwrap();
    let run = volume_at(sidecar, socket_dir);
    assert_eq!(volume_at(trainer, socket_dir), run);

    // /dev/shm is a memory volume in both, sized for the memory tier, and the sidecar's memory
    // limit covers the budget.
    let shm = volume_at(sidecar, Path::new("/dev/shm"));
    assert_eq!(volume_at(trainer, Path::new("/dev/shm")), shm);
    let shm = named(at(pod, "volumes"), shm);
    assert_eq!(str_at(shm, "emptyDir.medium"), "Memory");
    assert!(quantity(str_at(shm, "emptyDir.sizeLimit")) >= cfg.memory_budget);
    assert!(quantity(str_at(sidecar, "resources.limits.memory")) > cfg.memory_budget);

    // The disk tier is on a volume.
    volume_at(sidecar, cfg.disk_dir.as_deref().expect("a disk tier"));

    // Kubernetes waits longer than the sidecar drains.
    let grace = at(pod, "terminationGracePeriodSeconds").as_u64().unwrap();
    assert!(grace > cfg.grace.as_secs(), "{grace} s vs {:?}", cfg.grace);
}

#[test]
fn dockerfile_exposes_the_daemons_default_ports_and_runs_it() {
    let text = std::fs::read_to_string(root().join("Dockerfile")).unwrap();
    let defaults = Settings {
        token: Some(Token::new("0123456789abcdef0123456789abcdef").unwrap()),
        tls_dir: Some("/etc/hotstart/tls".into()),
        ..Settings::default()
    }
    .resolve()
    .unwrap();
    let expose: Vec<u16> = text
        .lines()
        .filter_map(|l| l.strip_prefix("EXPOSE "))
        .flat_map(|l| l.split_whitespace().map(|p| p.parse().unwrap()))
        .collect();
    assert_eq!(expose, vec![defaults.listen.port(), defaults.http.port()]);
    assert!(text.contains(r#"ENTRYPOINT ["/usr/local/bin/hotstart"]"#));
    assert!(text.contains(r#"CMD ["serve"]"#));
}

#[test]
fn snapshotter_deployments_agree_with_the_command() {
    let help = Command::new(env!("CARGO_BIN_EXE_hotstart"))
        .args(["snapshotter", "--help"])
        .output()
        .unwrap();
    assert!(help.status.success());
    let help = String::from_utf8(help.stdout).unwrap();
    let (root_dir, socket) = (
        "/var/lib/hotstart/snapshotter",
        "/run/hotstart/snapshotter.sock",
    );
    for default in [root_dir, socket] {
        assert!(help.contains(&format!("[default: {default}]")), "{help}");
    }

    // containerd's proxy plugin and the systemd unit name the same socket and root.
    let config = std::fs::read_to_string(root().join("deploy/containerd/config.toml")).unwrap();
    let plugin = config
        .split("[proxy_plugins.hotstart]")
        .nth(1)
        .expect("config.toml: no [proxy_plugins.hotstart]");
    assert!(plugin.contains("type = \"snapshot\""), "{plugin}");
    assert!(
        plugin.contains(&format!("address = \"{socket}\"")),
        "{plugin}"
    );
    assert!(config.contains("snapshotter = \"hotstart\""));
    let unit =
        std::fs::read_to_string(root().join("deploy/containerd/hotstart-snapshotter.service"))
            .unwrap();
    let exec = unit
        .lines()
        .find_map(|l| l.strip_prefix("ExecStart="))
        .expect("the unit has an ExecStart");
    assert!(
        exec.ends_with(&format!("snapshotter --root {root_dir} --socket {socket}")),
        "{exec}"
    );

    // The DaemonSet runs it with the host's state directory and socket directory.
    let docs = documents(&root().join("deploy/kubernetes/snapshotter-daemonset.yaml"));
    let ds = docs
        .iter()
        .find(|d| d.get("kind").and_then(Value::as_str) == Some("DaemonSet"))
        .expect("a DaemonSet");
    let pod = at(ds, "spec.template.spec");
    let c = named(at(pod, "containers"), "snapshotter");
    let args: Vec<&str> = at(c, "args")
        .as_sequence()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    assert_eq!(
        args,
        ["snapshotter", "--root", root_dir, "--socket", socket]
    );
    for (volume, path) in [("state", root_dir), ("socket", "/run/hotstart")] {
        assert_eq!(
            str_at(named(at(pod, "volumes"), volume), "hostPath.path"),
            path
        );
        assert_eq!(mount_of(c, volume), Some(path));
    }
    assert_eq!(at(c, "securityContext.privileged").as_bool(), Some(true));
}
