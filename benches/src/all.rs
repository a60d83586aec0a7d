//! `hotstart-benches all`: every benchmark of the project, one after the other, then one page of
//! results.
//!
//! Each benchmark runs as a child process (this binary's own subcommand, or the Python package's
//! script in `.venv`), with the sizes its issue names, and saves its report as Markdown and JSON
//! under `--out` (default `benches/results/`). A benchmark that fails is reported as not
//! measured and the others still run. Then:
//!
//! - `BENCHMARKS.md` gathers every report with the date, the machine and a summary of the
//!   targets met, and links one chart per report;
//! - `<name>.png` charts each report (see `chart`);
//! - the latest run's table in `docs/PERFORMANCE.md` (every row that has a target), between
//!   `<!-- benchmarks:begin -->` and `<!-- benchmarks:end -->`, is rewritten from the same
//!   figures (unless `--no-summary`). The README's short performance table is written by hand.
//!
//! `--quick` runs every benchmark small and once, to check that all of them work (a few
//! minutes); its figures say little. The full run takes about an hour here and wants an idle
//! machine and root (page-cache drops, FUSE, network namespaces).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::Context;

use crate::chart;
use crate::report::{Report, show_target};

/// Options of `hotstart-benches all`.
#[derive(Debug, clap::Args)]
pub struct AllArgs {
    /// Small sizes and one run each: checks that every benchmark runs.
    #[arg(long)]
    quick: bool,
    /// Run only these benchmarks (comma-separated names, as listed by --list).
    #[arg(long, value_delimiter = ',')]
    only: Vec<String>,
    /// List the benchmarks and their arguments, and exit.
    #[arg(long)]
    list: bool,
    /// Where reports, charts and BENCHMARKS.md go.
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/results"))]
    out: PathBuf,
    /// Leave docs/PERFORMANCE.md alone.
    #[arg(long)]
    no_summary: bool,
    /// Run nothing: rewrite BENCHMARKS.md, the charts and the table in docs/PERFORMANCE.md from
    /// the reports already in --out.
    #[arg(long)]
    no_run: bool,
}

/// How one benchmark runs.
enum Runner {
    /// A subcommand of this binary.
    Own(&'static [&'static str]),
    /// The Python package's benchmark script, after building the extension optimised.
    Python(&'static [&'static str]),
}

/// One benchmark: its name (also the results' file name), full and quick arguments.
struct Bench {
    name: &'static str,
    full: Runner,
    quick: Runner,
}

/// What `import torch` loads from the restart benchmark's venv (`benches/env/torch.txt`): the
/// site-packages entries of its container image.
const TORCH_IMAGE: &str = "torch,torchgen,typing_extensions,numpy,nvidia,cuda";

const BENCHES: &[Bench] = &[
    Bench {
        name: "store",
        full: Runner::Own(&["store"]),
        quick: Runner::Own(&[
            "store",
            "--object-mib",
            "64",
            "--file-mib",
            "128",
            "--runs",
            "1",
        ]),
    },
    Bench {
        name: "ckpt",
        full: Runner::Own(&["ckpt", "--gib", "4", "--runs", "3"]),
        quick: Runner::Own(&["ckpt", "--gib", "0.25", "--runs", "1"]),
    },
    Bench {
        name: "fuse",
        full: Runner::Own(&[
            "fuse",
            "--gib",
            "2",
            "--write-gib",
            "0.5",
            "--runs",
            "3",
            "--tee-cost",
        ]),
        quick: Runner::Own(&[
            "fuse",
            "--gib",
            "0.25",
            "--write-gib",
            "0.0625",
            "--runs",
            "1",
        ]),
    },
    Bench {
        name: "fuse-remote",
        full: Runner::Own(&["fuse", "--remote", "--gib", "2", "--runs", "3"]),
        quick: Runner::Own(&["fuse", "--remote", "--gib", "0.25", "--runs", "1"]),
    },
    Bench {
        name: "sidecar",
        full: Runner::Own(&["sidecar", "--gib", "4", "--tensors", "64", "--runs", "3"]),
        quick: Runner::Own(&["sidecar", "--gib", "0.125", "--runs", "1"]),
    },
    Bench {
        name: "restart",
        full: Runner::Own(&["restart", "--gib", "2", "--runs", "3", "--cold"]),
        quick: Runner::Own(&[
            "restart", "--gib", "0.125", "--width", "1024", "--runs", "1",
        ]),
    },
    Bench {
        name: "restart-remote",
        full: Runner::Own(&["restart", "--gib", "2", "--runs", "3", "--cold", "--remote"]),
        quick: Runner::Own(&[
            "restart", "--gib", "0.125", "--width", "1024", "--runs", "1", "--cold", "--remote",
        ]),
    },
    Bench {
        name: "image",
        full: Runner::Own(&["image", "--runs", "7"]),
        quick: Runner::Own(&["image", "--runs", "1", "--record-runs", "1"]),
    },
    Bench {
        name: "container",
        full: Runner::Own(&["container", "--runs", "5"]),
        quick: Runner::Own(&["container", "--runs", "1"]),
    },
    // The image phase of the restart benchmark's job: its environment as a container image,
    // started until `import torch` is done.
    Bench {
        name: "container-torch",
        full: Runner::Own(&[
            "container",
            "--packages",
            TORCH_IMAGE,
            "--imports",
            "torch",
            "--runs",
            "3",
        ]),
        quick: Runner::Own(&[
            "container",
            "--packages",
            TORCH_IMAGE,
            "--imports",
            "torch",
            "--runs",
            "1",
        ]),
    },
    Bench {
        name: "env",
        full: Runner::Own(&["env", "--runs", "3"]),
        quick: Runner::Own(&[
            "env",
            "--set",
            "small",
            "--runs",
            "1",
            "--lazy-runs",
            "1",
            "--stores",
            "local",
            "--no-sdist",
            "--settle",
            "0",
        ]),
    },
    Bench {
        name: "python",
        full: Runner::Python(&["--gib", "2", "--runs", "5"]),
        quick: Runner::Python(&["--gib", "0.125", "--tensors", "8", "--runs", "1"]),
    },
];

fn workspace() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
}

/// Runs one benchmark, its report going to `markdown` (and JSON beside it).
fn run(runner: &Runner, markdown: &Path) -> anyhow::Result<()> {
    let root = workspace();
    let status = match runner {
        Runner::Own(args) => Command::new(std::env::current_exe()?)
            .args(*args)
            .arg("--markdown")
            .arg(markdown)
            .current_dir(root)
            .status()?,
        Runner::Python(args) => {
            let venv = root.join(".venv");
            let built = Command::new(venv.join("bin/maturin"))
                .args(["develop", "--release"])
                .current_dir(root.join("bindings"))
                .env("VIRTUAL_ENV", &venv)
                .status()
                .context("maturin (run scripts/setup.sh)")?;
            anyhow::ensure!(built.success(), "maturin develop --release: {built}");
            Command::new(venv.join("bin/python"))
                .arg(root.join("benches/python/bench_py.py"))
                .args(*args)
                .arg("--markdown")
                .arg(markdown)
                .current_dir(root)
                .status()?
        }
    };
    anyhow::ensure!(status.success(), "exited with {status}");
    Ok(())
}

fn describe(runner: &Runner) -> String {
    match runner {
        Runner::Own(args) => format!("hotstart-benches {}", args.join(" ")),
        Runner::Python(args) => format!("python benches/python/bench_py.py {}", args.join(" ")),
    }
}

/// Runs the benchmarks, then writes BENCHMARKS.md, the charts and the table in
/// docs/PERFORMANCE.md.
pub fn all(args: &AllArgs) -> anyhow::Result<()> {
    let chosen: Vec<&'static Bench> = BENCHES
        .iter()
        .filter(|b| args.only.is_empty() || args.only.iter().any(|o| o == b.name))
        .collect();
    if let Some(unknown) = args
        .only
        .iter()
        .find(|o| !BENCHES.iter().any(|b| b.name == o.as_str()))
    {
        anyhow::bail!("no benchmark named {unknown:?} (see --list)");
    }
    let runner = |b: &'static Bench| if args.quick { &b.quick } else { &b.full };
    if args.list {
        for b in &chosen {
            println!("{:<12} {}", b.name, describe(runner(b)));
        }
        return Ok(());
    }
    std::fs::create_dir_all(&args.out).with_context(|| format!("create {}", args.out.display()))?;
    let mut failed = Vec::new();
    for b in chosen.iter().filter(|_| !args.no_run) {
        let started = Instant::now();
        eprintln!("\n==== {} : {}", b.name, describe(runner(b)));
        let md = args.out.join(format!("{}.md", b.name));
        if let Err(e) = run(runner(b), &md) {
            eprintln!("==== {} failed: {e:#}", b.name);
            failed.push((b.name, format!("{e:#}")));
        } else {
            eprintln!("==== {} done in {:.0?}", b.name, started.elapsed());
        }
    }
    // Every report in the directory, this run's and earlier ones, in the benchmarks' order.
    let mut reports = Vec::new();
    for b in BENCHES {
        let json = args.out.join(format!("{}.json", b.name));
        let Ok(text) = std::fs::read_to_string(&json) else {
            continue;
        };
        let report: Report =
            serde_json::from_str(&text).with_context(|| format!("parse {}", json.display()))?;
        let png = args.out.join(format!("{}.png", b.name));
        if let Err(e) = chart::draw(&report, &png) {
            eprintln!("chart {}: {e:#}", png.display());
        }
        reports.push((b.name, report));
    }
    let page = benchmarks_md(&reports, &failed, args.quick);
    let page_path = args.out.join("BENCHMARKS.md");
    std::fs::write(&page_path, page)?;
    eprintln!("wrote {}", page_path.display());
    if !args.no_summary && !args.quick {
        let doc = workspace().join("docs").join("PERFORMANCE.md");
        update_summary(&doc, &reports)?;
        eprintln!("updated the latest run's table in {}", doc.display());
    }
    anyhow::ensure!(
        failed.is_empty(),
        "{} benchmark(s) failed: {}",
        failed.len(),
        failed
            .iter()
            .map(|(n, _)| *n)
            .collect::<Vec<_>>()
            .join(", ")
    );
    Ok(())
}

/// The results page.
fn benchmarks_md(reports: &[(&str, Report)], failed: &[(&str, String)], quick: bool) -> String {
    let rows = reports.iter().flat_map(|(_, r)| &r.rows);
    let targets = rows.clone().filter(|r| r.target.is_some()).count();
    let met = rows.filter(|r| r.met() == Some(true)).count();
    let mut s = String::from("# hotstart benchmarks\n\n");
    s.push_str(&format!(
        "Generated by `cargo run --profile bench -p hotstart-benches -- all{}` on {} (UTC), on {}.\n\n",
        if quick { " --quick" } else { "" },
        today(),
        machine()
    ));
    if quick {
        s.push_str("**Quick run**: small sizes, one run each; these figures only show that every benchmark works.\n\n");
    }
    s.push_str(
        "Every row compares hotstart with the tool a user would pick instead (or with the floor: \
         memcpy, fio, a raw stream), in the same run on the same data. The ratio is how many times \
         better hotstart did: throughput over throughput, or the peer's time over ours. Targets \
         come from the issues; ✓ where met, ✗ where not.\n\n",
    );
    s.push_str(&format!("**Targets met: {met} of {targets}.**\n\n"));
    for (name, failure) in failed {
        s.push_str(&format!(
            "- `{name}` was not measured in this run: {failure}\n"
        ));
    }
    for (name, report) in reports {
        s.push('\n');
        s.push_str(&report.markdown().replacen("### ", "## ", 1));
        s.push_str(&format!("\n![{}]({name}.png)\n", report.title));
    }
    s
}

/// The latest run's table in docs/PERFORMANCE.md: every row that has a target.
fn summary_table(reports: &[(&str, Report)]) -> String {
    let mut s =
        String::from("| area | measurement | peer | ratio | target |\n|---|---|---|---:|---:|\n");
    for (name, report) in reports {
        for r in report.rows.iter().filter(|r| r.target.is_some()) {
            s.push_str(&format!(
                "| {name} | {} | {} | {:.2}× | ≥ {} {} |\n",
                r.what,
                r.peer,
                r.ratio(),
                show_target(r.target.unwrap_or_default()),
                if r.met() == Some(true) { "✓" } else { "✗" }
            ));
        }
    }
    s.push_str(&format!(
        "\nMeasured on {} on {}; every table, note and chart: [benches/results/BENCHMARKS.md](../benches/results/BENCHMARKS.md).\n",
        machine(),
        today()
    ));
    s
}

const BEGIN: &str = "<!-- benchmarks:begin -->";
const END: &str = "<!-- benchmarks:end -->";

/// Replaces the marked section of `page` (docs/PERFORMANCE.md) with [`summary_table`].
fn update_summary(page: &Path, reports: &[(&str, Report)]) -> anyhow::Result<()> {
    let text = std::fs::read_to_string(page)?;
    let (Some(a), Some(b)) = (text.find(BEGIN), text.find(END)) else {
        anyhow::bail!("{} has no {BEGIN} … {END} section", page.display());
    };
    anyhow::ensure!(a < b, "{}: {END} before {BEGIN}", page.display());
    let new = format!(
        "{}{BEGIN}\n{}{}",
        &text[..a],
        summary_table(reports),
        &text[b..]
    );
    std::fs::write(page, new)?;
    Ok(())
}

/// Today's date, `YYYY-MM-DD`, UTC.
fn today() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let (y, m, d) = civil_from_days((secs / 86_400) as i64);
    format!("{y:04}-{m:02}-{d:02}")
}

/// The proleptic Gregorian date of a day count since 1970-01-01 (Howard Hinnant's algorithm).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    (yoe + era * 400 + i64::from(m <= 2), m, d)
}

/// The machine, in one line: CPU, cores, memory, kernel.
fn machine() -> String {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let cpu = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .map(|l| l.trim_start_matches([' ', '\t', ':']).to_string())
        .unwrap_or_else(|| "unknown CPU".into());
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    let mem_kib: u64 = std::fs::read_to_string("/proc/meminfo")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("MemTotal:"))
        .and_then(|l| l.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0);
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    format!(
        "{cpu}, {cores} cores, {:.0} GiB memory, Linux {}",
        mem_kib as f64 / (1u64 << 20) as f64,
        kernel.trim()
    )
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::report::Row;

    #[test]
    fn dates_from_day_counts() {
        assert_eq!(civil_from_days(0), (1970, 1, 1));
        assert_eq!(civil_from_days(11_016), (2000, 2, 29));
        assert_eq!(civil_from_days(20_780), (2026, 11, 23));
    }

    #[test]
    fn the_performance_table_is_replaced_and_the_rest_kept() {
        let dir = tempfile::tempdir().unwrap();
        let page = dir.path().join("PERFORMANCE.md");
        std::fs::write(
            &page,
            format!("# x\n\nbefore\n{BEGIN}\nold table\n{END}\nafter\n"),
        )
        .unwrap();
        let mut report = Report::new("store");
        let d = Duration::from_millis;
        report.add(Row::rate(
            "read",
            1 << 20,
            d(1),
            "single GET",
            d(2),
            Some(0.95),
        ));
        report.add(Row::rate("write", 1 << 20, d(1), "single PUT", d(2), None));
        update_summary(&page, &[("store", report)]).unwrap();
        let text = std::fs::read_to_string(&page).unwrap();
        assert!(text.starts_with("# x\n\nbefore\n<!-- benchmarks:begin -->\n| area |"));
        assert!(
            text.contains("| store | read | single GET | 2.00× | ≥ 0.95 ✓ |"),
            "{text}"
        );
        assert!(!text.contains("old table") && !text.contains("single PUT"));
        // The page is in docs/: its link to the results page goes up one level.
        assert!(
            text.contains("[benches/results/BENCHMARKS.md](../benches/results/BENCHMARKS.md)"),
            "{text}"
        );
        assert!(text.ends_with("<!-- benchmarks:end -->\nafter\n"));
    }
}
