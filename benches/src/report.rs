//! Result tables: one row per measurement, with the peer it is compared against and the ratio.
//!
//! A figure is either a throughput (bytes per second, higher is better) or a time (seconds,
//! lower is better); either way a row's ratio says how many times better hotstart did than the
//! peer (above 1: hotstart is faster), so targets and charts read the same for both. A report
//! prints as Markdown and saves as Markdown plus JSON (`Report::save`), which `bench all` gathers
//! into benches/results/BENCHMARKS.md and charts.

use std::path::Path;
use std::time::Duration;

use serde::{Deserialize, Serialize};

/// One measured figure: a median.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Figure {
    /// Bytes per second.
    Rate(f64),
    /// Seconds.
    Time(f64),
}

impl Figure {
    /// `bytes` moved in `took`.
    pub fn rate(bytes: u64, took: Duration) -> Figure {
        Figure::Rate(rate(bytes, took))
    }

    /// A duration.
    pub fn time(took: Duration) -> Figure {
        Figure::Time(took.as_secs_f64())
    }

    fn show(self) -> String {
        match self {
            Figure::Rate(bps) => format!("{:.0} MiB/s", bps / (1u64 << 20) as f64),
            Figure::Time(s) if s < 1.0 => format!("{:.0} ms", s * 1e3),
            Figure::Time(s) => format!("{s:.2} s"),
        }
    }
}

/// One comparison: hotstart's figure against a peer's (or a floor's), same data, same run.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Row {
    /// What was measured, e.g. "read 1 GiB, SeaweedFS loopback".
    pub what: String,
    /// hotstart's figure (median).
    pub ours: Figure,
    /// The alternative's name, e.g. "single GET" or "fio io_uring O_DIRECT".
    pub peer: String,
    /// The alternative's figure (median), of the same kind as `ours`.
    pub theirs: Figure,
    /// The target ratio from the issue, if any (`ratio()` must be at least this).
    pub target: Option<f64>,
}

impl Row {
    /// A throughput comparison: `bytes` moved in `ours` against the same bytes in `theirs`.
    pub fn rate(
        what: impl Into<String>,
        bytes: u64,
        ours: Duration,
        peer: impl Into<String>,
        theirs: Duration,
        target: Option<f64>,
    ) -> Row {
        let (ours, theirs) = (Figure::rate(bytes, ours), Figure::rate(bytes, theirs));
        Row::of(what, ours, peer, theirs, target)
    }

    /// [`Row::rate`] of the medians of several runs of each.
    pub fn rate_medians(
        what: impl Into<String>,
        bytes: u64,
        ours: &[Duration],
        peer: impl Into<String>,
        theirs: &[Duration],
        target: Option<f64>,
    ) -> Row {
        let (ours, theirs) = (median(ours.to_vec()), median(theirs.to_vec()));
        Row::rate(what, bytes, ours, peer, theirs, target)
    }

    /// A time comparison: the same work took `ours` and `theirs`.
    pub fn time(
        what: impl Into<String>,
        ours: Duration,
        peer: impl Into<String>,
        theirs: Duration,
        target: Option<f64>,
    ) -> Row {
        Row::of(what, Figure::time(ours), peer, Figure::time(theirs), target)
    }

    /// The row of two figures, which the public constructors make of one kind.
    fn of(
        what: impl Into<String>,
        ours: Figure,
        peer: impl Into<String>,
        theirs: Figure,
        target: Option<f64>,
    ) -> Row {
        Row {
            what: what.into(),
            ours,
            peer: peer.into(),
            theirs,
            target,
        }
    }

    /// How many times better hotstart did: throughput over throughput, or time over time
    /// inverted.
    pub fn ratio(&self) -> f64 {
        let tiny = f64::MIN_POSITIVE;
        match (self.ours, self.theirs) {
            (Figure::Rate(o), Figure::Rate(t)) => o / t.max(tiny),
            (Figure::Time(o), Figure::Time(t)) => t / o.max(tiny),
            // Rows are built by the constructors above, with figures of one kind.
            _ => f64::NAN,
        }
    }

    /// Whether the row meets its target (`None` without one).
    pub fn met(&self) -> Option<bool> {
        self.target.map(|t| self.ratio() >= t)
    }
}

/// Rows of a benchmark run plus free-form notes (setup, what the link emulation was).
#[derive(Debug, Default, Serialize, Deserialize)]
pub struct Report {
    pub title: String,
    pub rows: Vec<Row>,
    pub notes: Vec<String>,
}

/// A target ratio for people: at most two decimals (1/1.3 shows as 0.77).
pub fn show_target(t: f64) -> String {
    format!("{}", (t * 100.0).round() / 100.0)
}

/// A builder of [`Row::rate_medians`] rows for one run: each moves `bytes`, and each `what` is
/// followed by `, {label}` (the setup the run's rows share).
pub fn rate_rows(
    label: &str,
    bytes: u64,
) -> impl Fn(&str, &[Duration], &str, &[Duration], Option<f64>) -> Row + '_ {
    move |what, ours, peer, theirs, target| {
        Row::rate_medians(
            format!("{what}, {label}"),
            bytes,
            ours,
            peer,
            theirs,
            target,
        )
    }
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
            row.ours.show(),
            row.peer,
            row.theirs.show(),
            row.ratio()
        );
        self.rows.push(row);
    }

    pub fn note(&mut self, note: impl Into<String>) {
        let note = note.into();
        eprintln!("  note: {note}");
        self.notes.push(note);
    }

    /// The table (under a `###` title) and the notes.
    pub fn markdown(&self) -> String {
        let mut s = format!("### {}\n\n", self.title);
        s.push_str("| measurement | hotstart | peer | peer's | ratio | target |\n|---|---:|---|---:|---:|---:|\n");
        for r in &self.rows {
            let target = match (r.target, r.met()) {
                (Some(t), Some(true)) => format!("≥ {} ✓", show_target(t)),
                (Some(t), _) => format!("≥ {} ✗", show_target(t)),
                (None, _) => "-".into(),
            };
            s.push_str(&format!(
                "| {} | {} | {} | {} | {:.2}× | {} |\n",
                r.what,
                r.ours.show(),
                r.peer,
                r.theirs.show(),
                r.ratio(),
                target
            ));
        }
        if !self.notes.is_empty() {
            s.push('\n');
            for n in &self.notes {
                s.push_str(&format!("- {n}\n"));
            }
        }
        s
    }

    /// Prints the table, and writes it to `markdown` (plus the rows as JSON beside it, same
    /// name with `.json`) when given.
    pub fn finish(&self, markdown: Option<&Path>) -> anyhow::Result<()> {
        println!("{}", self.markdown());
        if let Some(path) = markdown {
            std::fs::write(path, self.markdown())?;
            std::fs::write(
                path.with_extension("json"),
                serde_json::to_vec_pretty(self)?,
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ratios_say_how_many_times_better_for_rates_and_times() {
        let d = Duration::from_millis;
        let rate = Row::rate("read", 1000, d(100), "peer", d(300), Some(2.0));
        assert!((rate.ratio() - 3.0).abs() < 1e-9);
        assert_eq!(rate.met(), Some(true));
        let time = Row::time("start", d(400), "peer", d(200), Some(1.0));
        assert!((time.ratio() - 0.5).abs() < 1e-9);
        assert_eq!(time.met(), Some(false));
        let mut report = Report::new("t");
        report.add(rate);
        report.add(time);
        let md = report.markdown();
        assert!(
            md.contains("| read | 0 MiB/s | peer | 0 MiB/s | 3.00× | ≥ 2 ✓ |"),
            "{md}"
        );
        assert!(
            md.contains("| start | 400 ms | peer | 200 ms | 0.50× | ≥ 1 ✗ |"),
            "{md}"
        );
        let back: Report = serde_json::from_str(&serde_json::to_string(&report).unwrap()).unwrap();
        assert_eq!(back.rows.len(), 2);
        assert_eq!(back.rows[1].ours, Figure::Time(0.4));
    }
}
