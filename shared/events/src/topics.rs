//! Topic names (docs/architecture.md, "Topics and events"). Do not change: they are the contract between
//! services, upstream producers and dashboards.

pub const INTAKE_REQUESTS: &str = "fenceline.intake.requests";
pub const INTAKE_REJECTED: &str = "fenceline.intake.rejected";
pub const TASKS: &str = "fenceline.tasks";
pub const DISPATCH: &str = "fenceline.dispatch";
pub const ATTEMPTS: &str = "fenceline.attempts";
pub const RECOVERY: &str = "fenceline.recovery";
pub const STATUS: &str = "fenceline.status";
pub const DEADLETTER: &str = "fenceline.deadletter";

/// Every topic, with whether it is compacted (latest record per key wins).
pub const ALL: &[(&str, bool)] = &[
    (INTAKE_REQUESTS, false),
    (INTAKE_REJECTED, false),
    (TASKS, false),
    (DISPATCH, false),
    (ATTEMPTS, false),
    (RECOVERY, false),
    (STATUS, true),
    (DEADLETTER, false),
];

/// Whether `name` (a topic as used, behind any prefix) is a compacted contract
/// topic, where a record with a null value is a tombstone (docs/wire.md,
/// "Tombstones on fenceline.status").
pub fn is_compacted(name: &str) -> bool {
    ALL.iter().any(|(topic, compacted)| *compacted && name.ends_with(topic))
}

/// The topic a service actually uses: the contract name behind an optional prefix
/// (tests isolate themselves with one; production leaves it empty).
pub fn named(prefix: &str, topic: &str) -> String {
    format!("{prefix}{topic}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_status_topic_is_compacted_behind_any_prefix() {
        assert!(is_compacted(&named("t1.", STATUS)));
        assert!(is_compacted(STATUS));
        assert!(!is_compacted(&named("t1.", TASKS)));
        assert!(!is_compacted(&named("t1.", DEADLETTER)));
    }
}
