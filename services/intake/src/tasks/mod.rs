//! A tenant's tasks in intake: submitting, reading, listing, the projections that
//! keep `task_view`, and retention. A submission commits the idempotency record,
//! the task and its `TaskAccepted` event in one transaction, shared with the
//! submissions that arrived beside it, and answers once it committed;
//! reads come from `task_view`, intake's projection of `fenceline.status`.

mod listing;
mod projections;
mod retention;
mod submission;
mod views;
mod writer;

pub use self::listing::*;
pub use self::projections::*;
pub use self::retention::*;
pub use self::submission::*;
pub use self::views::*;
pub use self::writer::*;
