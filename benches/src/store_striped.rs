//! Striped object I/O against one plain GET/PUT of the same object.
//!
//! The alternative a user would pick is the store client's ordinary call: one `PUT` of the whole
//! object and one `GET` streaming it back (what `aws s3api put-object`/`get-object` or
//! `object_store::put`/`get` do). Both sides move the same bytes from and into memory, in the same
//! run, against the same server, so the ratio is what striping buys:
//!
//! - **loopback**: SeaweedFS on 127.0.0.1 and a local directory store. Here the link is not the
//!   limit, so striping should cost nothing (target ratio ≥ 0.95).
//! - **remote**: SeaweedFS behind an emulated link, 10 ms RTT and 100 MB/s per TCP connection
//!   (benches/netem.sh: network namespaces, a per-connection HTB cap and a packet delay).
//!   One connection is capped, many are not: targets ≥ 6× for reads, ≥ 4× for writes. The same
//!   link is also emulated in-process (the throttled store wrapper) over an in-memory store, which
//!   shows what striping buys against the link alone when no server competes for the cores.

use std::net::Ipv4Addr;
use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use bytes::Bytes;
use hotstart_store::wrap::{Interceptor, Throttle, ThrottleConfig};
use hotstart_store::{Store, StripeConfig, StripedReader, StripedWriter};
use hotstart_testkit::SeaweedFs;

use crate::StoreArgs;
use crate::report::{Report, Row, median};

/// The four timings of one backend: single PUT, striped write, single GET, striped read.
struct Timings {
    put: Vec<Duration>,
    striped_write: Vec<Duration>,
    get: Vec<Duration>,
    striped_read: Vec<Duration>,
}

fn payload(mib: usize) -> Bytes {
    Bytes::from(hotstart_testkit::pattern(mib << 20, 7))
}

async fn measure(store: &Store, data: &Bytes, args: &StoreArgs) -> anyhow::Result<Timings> {
    let runs = args.runs;
    let cfg = StripeConfig {
        stripe_size: args.stripe_mib << 20,
        max_in_flight: args.in_flight,
        ..StripeConfig::default()
    };
    let mut t = Timings {
        put: vec![],
        striped_write: vec![],
        get: vec![],
        striped_read: vec![],
    };
    let len = data.len();
    for run in 0..runs {
        let key = format!("bench/single-{run}");
        let start = Instant::now();
        store.put(&key, data.clone()).await?;
        t.put.push(start.elapsed());

        let start = Instant::now();
        let got = store.get(&key).await?;
        t.get.push(start.elapsed());
        anyhow::ensure!(got.len() == len, "single GET returned {} bytes", got.len());
        drop(got);

        let key = format!("bench/striped-{run}");
        let start = Instant::now();
        let mut w = StripedWriter::new(store, &key, cfg.clone())?;
        w.write_bytes(data.clone()).await?;
        w.finish().await?;
        t.striped_write.push(start.elapsed());

        let start = Instant::now();
        let r = StripedReader::open(store, &key, cfg.clone()).await?;
        let got = r.read_at(0, len).await?;
        t.striped_read.push(start.elapsed());
        anyhow::ensure!(got == *data, "striped read returned different bytes");
        store.delete(&key).await?;
        store.delete(&format!("bench/single-{run}")).await?;
    }
    Ok(t)
}

fn add_rows(
    report: &mut Report,
    label: &str,
    bytes: u64,
    t: Timings,
    read_target: Option<f64>,
    write_target: Option<f64>,
) {
    report.add(Row::rate(
        format!("read, {label}"),
        bytes,
        median(t.striped_read),
        "single GET",
        median(t.get),
        read_target,
    ));
    report.add(Row::rate(
        format!("write, {label}"),
        bytes,
        median(t.striped_write),
        "single PUT",
        median(t.put),
        write_target,
    ));
}

fn s3_store(weed: &SeaweedFs, bucket: &str) -> anyhow::Result<Store> {
    let url = weed.fresh_bucket(bucket);
    Ok(Store::open_with(&url, &weed.client_options())?)
}

/// Loopback SeaweedFS and a local directory: striping must not cost anything.
pub async fn loopback(args: &StoreArgs, report: &mut Report) -> anyhow::Result<()> {
    let data = payload(args.object_mib);
    let bytes = data.len() as u64;
    let label = format!("{} MiB", args.object_mib);

    eprintln!(
        "striped vs single request, SeaweedFS on loopback ({label}, {} runs)",
        args.runs
    );
    let weed =
        SeaweedFs::start().context("start SeaweedFS (run scripts/setup.sh to install weed)")?;
    let store = s3_store(&weed, "bench-loopback")?;
    let t = measure(&store, &data, args).await?;
    add_rows(
        report,
        &format!("{label}, SeaweedFS loopback"),
        bytes,
        t,
        Some(0.95),
        Some(0.95),
    );
    drop(weed);

    eprintln!("striped vs single request, local directory store ({label})");
    let dir = tempfile::tempdir_in(&args.dir)?;
    let store = Store::open(&dir.path().display().to_string())?;
    let t = measure(&store, &data, args).await?;
    add_rows(
        report,
        &format!("{label}, local directory"),
        bytes,
        t,
        None,
        None,
    );
    Ok(())
}

pub(crate) const NETNS: &str = "hs-remote";

pub(crate) fn netem(action: &str) -> anyhow::Result<()> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("netem.sh");
    let status = Command::new("bash").arg(&script).arg(action).status()?;
    anyhow::ensure!(status.success(), "{} {action} failed", script.display());
    Ok(())
}

pub(crate) fn netem_ip() -> anyhow::Result<Ipv4Addr> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("netem.sh");
    let out = Command::new("bash").arg(&script).arg("ip").output()?;
    Ok(String::from_utf8(out.stdout)?.trim().parse()?)
}

/// The emulated remote link (benches/netem.sh), taken down when dropped: drop the server behind
/// it first.
pub(crate) struct RemoteLink;

impl RemoteLink {
    /// Brings the link up and starts a private SeaweedFS server behind it.
    pub(crate) fn up() -> anyhow::Result<(RemoteLink, SeaweedFs)> {
        let link = RemoteLink;
        netem("up")?;
        let weed = SeaweedFs::start_in_netns(NETNS, netem_ip()?)
            .context("start SeaweedFS behind the remote link")?;
        Ok((link, weed))
    }
}

impl Drop for RemoteLink {
    fn drop(&mut self) {
        if let Err(e) = netem("down") {
            eprintln!("taking the remote link down: {e:#}");
        }
    }
}

/// SeaweedFS behind an emulated remote link: striping must multiply throughput.
pub async fn remote(args: &StoreArgs, report: &mut Report) -> anyhow::Result<()> {
    let data = payload(args.object_mib);
    let bytes = data.len() as u64;
    let label = format!("{} MiB", args.object_mib);
    eprintln!("striped vs single request over an emulated remote link ({label})");

    let namespaced = netem("up").and_then(|()| {
        let ip = netem_ip()?;
        Ok(SeaweedFs::start_in_netns(NETNS, ip)?)
    });
    match namespaced {
        Ok(weed) => {
            report.note(
                "remote link, SeaweedFS: network namespaces (benches/netem.sh), 10 ms RTT, 100 MB/s \
                 per TCP connection (HTB class per connection), SeaweedFS in the remote namespace \
                 on the same two cores",
            );
            let store = s3_store(&weed, "bench-remote")?;
            let t = measure(&store, &data, args).await;
            drop(weed);
            netem("down")?;
            let label = format!("{label}, remote link, SeaweedFS");
            add_rows(report, &label, bytes, t?, Some(6.0), Some(4.0));
        }
        Err(e) => {
            let _ = netem("down");
            report.note(format!(
                "remote link over SeaweedFS not measured: the network namespaces could not be set up: {e:#}"
            ));
        }
    }

    // The same link in-process over an in-memory store: what striping buys against the link
    // alone, with no server competing for this machine's cores.
    report.note(
        "remote link, in-memory store: the throttled store wrapper (10 ms per request, 100 MB/s \
         per request) over memory://, so only the link limits",
    );
    let throttle = Arc::new(Throttle::new(ThrottleConfig {
        latency: Duration::from_millis(10),
        per_request_bytes_per_sec: Some(100_000_000),
        total_bytes_per_sec: None,
    }));
    let store = Store::open("memory://")?.wrap(|inner| throttle.wrap(inner));
    let t = measure(&store, &data, args).await?;
    let label = format!("{label}, remote link, in-memory store");
    add_rows(report, &label, bytes, t, Some(6.0), Some(4.0));
    Ok(())
}
