//! Named fault points. Compiled in only with the `faults` feature (otherwise
//! [`fault!`](crate::fault) expands to nothing) and armed by the `FAILPOINTS`
//! variable, for example `FAILPOINTS='consumer.after_db_commit=return(crash)'`:
//!
//! - `return(crash)`: abort the process on the spot, as SIGKILL would;
//! - `return` or `1*return`: fail the operation (once), as a lost connection would;
//! - `pause`, `sleep(ms)`: stop the thread (forever, or for a while).

#[doc(hidden)]
pub use fail as __fail;

/// An error injected at a fault point.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("fault injected at {0}")]
pub struct Injected(pub &'static str);

/// Arms the fault points named in `FAILPOINTS`. Keep the guard for the process's
/// lifetime. Without the `faults` feature this does nothing.
pub fn setup() -> fail::FailScenario<'static> {
    fail::FailScenario::setup()
}

/// What a `return` action at a fault point does. Never returns for `crash`.
#[doc(hidden)]
pub fn on_return(name: &'static str, action: Option<String>) -> Injected {
    if action.as_deref() == Some("crash") {
        // Logged to stderr first, so a test can tell a planned crash from a bug; a
        // closed stderr must not turn the crash into a panic.
        use std::io::Write as _;
        let _ = writeln!(
            std::io::stderr(),
            "{{\"level\":\"WARN\",\"message\":\"fault point crashes the process\",\"fault_point\":\"{name}\"}}"
        );
        std::process::abort();
    }
    Injected(name)
}

/// A named fault point in a function returning `Result<_, E>` with
/// `E: From<Injected>`.
#[macro_export]
macro_rules! fault {
    ($name:literal) => {
        $crate::faults::__fail::fail_point!($name, |action: Option<String>| {
            Err($crate::faults::on_return($name, action).into())
        })
    };
}

/// Whether the fault point `name` fires now, for points that drop work on the
/// floor (a record lost in transit) instead of failing an operation. Always
/// `false` without the `faults` feature.
#[cfg(feature = "faults")]
pub fn drops(name: &'static str) -> bool {
    fail::eval(name, |action: Option<String>| on_return(name, action)).is_some()
}

/// Whether the fault point `name` fires now. Always `false` without the `faults` feature.
#[cfg(not(feature = "faults"))]
pub fn drops(_name: &'static str) -> bool {
    false
}

/// The signed milliseconds that the variable `name` (a service's
/// `FENCELINE_<SERVICE>_CLOCK_SKEW_MS`) adds to every reading of its host's wall
/// clock, in micros: a test runs a service whose clock is wrong. Always 0 without
/// the `faults` feature.
#[cfg(feature = "faults")]
pub fn clock_skew_us(name: &str) -> i64 {
    std::env::var(name).ok().and_then(|v| v.parse::<i64>().ok()).unwrap_or(0) * 1_000
}

/// Always 0 without the `faults` feature.
#[cfg(not(feature = "faults"))]
pub fn clock_skew_us(_name: &str) -> i64 {
    0
}
