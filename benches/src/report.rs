//! Result tables: one row per measurement, with the peer it is compared against and the ratio.

use std::time::Duration;

/// One comparison: hotstart's figure against a peer's (or a floor's), same data, same run.
#[derive(Debug, Clone)]
pub struct Row {
    /// What was measured, e.g. "read 1 GiB, SeaweedFS loopback".
    pub what: String,
    /// hotstart's throughput in bytes per second (median).
    pub ours: f64,
    /// The alternative's name, e.g. "single GET" or "fio io_uring O_DIRECT".
    pub peer: String,
    /// The alternative's throughput in bytes per second (median).
    pub theirs: f64,
    /// The target ratio from the issue, if any (ours / theirs must be at least this).
    pub target: Option<f64>,
}

impl Row {
    pub fn ratio(&self) -> f64 {
        self.ours / self.theirs.max(f64::MIN_POSITIVE)
    }
}

/// Rows of a benchmark run plus free-form notes (setup, what the link emulation was).
#[derive(Debug, Default)]
pub struct Report {
    title: String,
    rows: Vec<Row>,
    notes: Vec<String>,
}

/// Median of durations.
pub fn median(mut xs: Vec<Duration>) -> Duration {
    xs.sort();
    xs.get(xs.len() / 2).copied().unwrap_or_default()
}

/// Bytes per second of `bytes` moved in `d`.
pub fn rate(bytes: u64, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64().max(1e-9)
}

fn mib(bps: f64) -> String {
    format!("{:.0} MiB/s", bps / (1u64 << 20) as f64)
}

impl Report {
    pub fn new(title: &str) -> Report {
        Report {
            title: title.to_string(),
            ..Default::default()
        }
    }

    pub fn add(&mut self, row: Row) {
        eprintln!(
            "  {}: {} vs {} {} = {:.2}x",
            row.what,
            mib(row.ours),
            row.peer,
            mib(row.theirs),
            row.ratio()
        );
        self.rows.push(row);
    }

    pub fn note(&mut self, note: impl Into<String>) {
        let note = note.into();
        eprintln!("  note: {note}");
        self.notes.push(note);
    }

    pub fn markdown(&self) -> String {
        let lines = self.rows.iter().map(|r| Line {
            what: &r.what,
            ours: mib(r.ours),
            peer: &r.peer,
            theirs: mib(r.theirs),
            ratio: r.ratio(),
            target: r.target,
        });
        markdown(&self.title, lines, &self.notes)
    }

    pub fn print(&self) {
        println!("{}", self.markdown());
    }
}

/// One row of a results table with its figures already formatted (throughputs, times).
pub struct Line<'a> {
    pub what: &'a str,
    pub ours: String,
    pub peer: &'a str,
    pub theirs: String,
    /// How many times better hotstart is than the peer.
    pub ratio: f64,
    pub target: Option<f64>,
}

/// A Markdown results table under `title`, each ratio checked against its target, then notes.
pub fn markdown<'a>(
    title: &str,
    lines: impl IntoIterator<Item = Line<'a>>,
    notes: &[String],
) -> String {
    let mut s = format!("### {title}\n\n");
    s.push_str("| measurement | hotstart | peer | peer's | ratio | target |\n|---|---:|---|---:|---:|---:|\n");
    for l in lines {
        let target = match l.target {
            Some(t) if l.ratio >= t => format!("≥ {t} ✓"),
            Some(t) => format!("≥ {t} ✗"),
            None => "-".into(),
        };
        s.push_str(&format!(
            "| {} | {} | {} | {} | {:.2}× | {} |\n",
            l.what, l.ours, l.peer, l.theirs, l.ratio, target
        ));
    }
    if !notes.is_empty() {
        s.push('\n');
        for n in notes {
            s.push_str(&format!("- {n}\n"));
        }
    }
    s
}
