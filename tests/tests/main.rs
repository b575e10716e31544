//! Every end-to-end suite against the real Postgres and the real broker, each a module
//! named after what it tests, in one test binary so that the suites are linked once.
//! Run one suite with `deploy/local/stack test -E 'test(/^chaos::/)'`.

mod adaptive;
mod admission;
mod approvals;
mod bus;
mod chaos;
mod cli;
mod commits;
mod conformance;
mod dashboard;
mod databases;
mod dialects;
mod evidence;
mod fairness;
mod intake_commands;
mod intake_event_stream;
mod intake_fixture;
mod intake_reads;
mod intake_retention;
mod intake_submission;
mod intake_upstream;
mod intake_webhook_secrets;
mod intake_webhooks;
mod kafka;
mod leases;
mod lifecycle;
mod observability;
mod policy;
mod postgres_tls;
mod provider_faults;
mod recovery;
mod resends;
mod retention;
mod scaleout;
mod secrets;
mod shutdown;
mod spend;
mod tls;
mod traces;
mod upgrade;
mod vendor_apis;

/// A suite file that is not a module here would never be compiled or run.
#[test]
fn every_suite_file_is_a_module_of_this_binary() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests");
    let main = include_str!("main.rs");
    for entry in std::fs::read_dir(&dir).expect("the suites' folder") {
        let path = entry.expect("an entry").path();
        let Some(stem) = path.file_stem().and_then(|s| s.to_str()) else { continue };
        if path.extension().is_some_and(|e| e == "rs") && stem != "main" {
            assert!(
                main.contains(&format!("\nmod {stem};\n")),
                "tests/tests/{stem}.rs is not a module of tests/main.rs"
            );
        }
    }
}
