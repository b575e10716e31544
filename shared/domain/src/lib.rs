//! Fenceline's decisions as pure functions: no tokio, no sqlx, no rdkafka. The I/O
//! crates call these and carry out what they return.

pub mod admission;
pub mod approvals;
pub mod calls;
pub mod cases;
pub mod ids;
pub mod lifecycle;
pub mod limits;
pub mod outbox;
pub mod progress;
pub mod spend;
pub mod standing;
pub mod vocabulary;
