//! Every end-to-end suite against the real Postgres and the real broker, each a module
//! named after what it tests, in one test binary so that the suites are linked once.
//! Run one suite with `deploy/local/stack test -E 'test(/^chaos::/)'`.

mod adaptive;
mod admission;
mod bus;
mod chaos;
mod cli;
mod commits;
mod dashboard;
mod databases;
mod fairness;
mod intake;
mod kafka;
mod leases;
mod lifecycle;
mod observability;
mod postgres_tls;
mod provider_faults;
mod recovery;
mod retention;
mod scaleout;
mod secrets;
mod tls;
mod upgrade;
