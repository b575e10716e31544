//! A tenant's tasks in intake: submitting, reading, listing, the projections that
//! keep `task_view`, and retention. A submission commits the idempotency record,
//! the task and its `TaskAccepted` event in one transaction and answers at once;
//! reads come from `task_view`, intake's projection of `fenceline.status`.

mod listing;
mod projections;
mod retention;
mod submission;
mod views;

pub use self::listing::*;
pub use self::projections::*;
pub use self::retention::*;
pub use self::submission::*;
pub use self::views::*;
