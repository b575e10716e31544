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

/// The topic a service actually uses: the contract name behind an optional prefix
/// (tests isolate themselves with one; production leaves it empty).
pub fn named(prefix: &str, topic: &str) -> String {
    format!("{prefix}{topic}")
}
