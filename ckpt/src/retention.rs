//! The retention rule, as one pure function that the engine (after each save) and
//! `hotstart ckpt gc` ([`crate::Checkpoints::gc`]) both apply; `docs/FORMAT.md` states it.

/// What retention does to a job's steps in one tier.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Plan {
    /// The complete steps kept, ascending.
    pub kept: Vec<u64>,
    /// The steps to remove, ascending.
    pub removed: Vec<u64>,
}

/// Keeps the newest `keep` complete steps; removes older complete steps and incomplete steps
/// older than the newest complete one (torn saves); leaves incomplete steps newer than it alone,
/// since they may still be in progress. `steps` is every step present, ascending, with whether
/// it is complete. `keep == 0` keeps everything.
pub fn plan(steps: &[(u64, bool)], keep: usize) -> Plan {
    let complete: Vec<u64> = steps.iter().filter(|s| s.1).map(|s| s.0).collect();
    let Some(&newest) = complete.last() else {
        return Plan::default();
    };
    if keep == 0 {
        return Plan {
            kept: complete,
            removed: Vec::new(),
        };
    }
    let kept = complete[complete.len().saturating_sub(keep)..].to_vec();
    let removed = steps
        .iter()
        .filter(|&&(s, done)| if done { s < kept[0] } else { s < newest })
        .map(|s| s.0)
        .collect();
    Plan { kept, removed }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_the_newest_complete_and_removes_older_and_torn_steps() {
        // 1, 2, 4, 6 complete; 3 torn (older than the newest complete); 7 in progress.
        let steps = [
            (1, true),
            (2, true),
            (3, false),
            (4, true),
            (6, true),
            (7, false),
        ];
        assert_eq!(
            plan(&steps, 2),
            Plan {
                kept: vec![4, 6],
                removed: vec![1, 2, 3],
            }
        );
        assert_eq!(plan(&steps, 10).removed, vec![3]);
        assert_eq!(plan(&steps, 0).removed, Vec::<u64>::new());
        // Nothing complete: nothing is removed, however old.
        assert_eq!(plan(&[(1, false), (2, false)], 1), Plan::default());
    }
}
