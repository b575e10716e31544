//! What people do to a task: a signal that approves or rejects a wait (kept when
//! it comes before its wait), and a resolution of the case a task stopped under.

use serde::{Deserialize, Serialize};

use super::{Artifact, Micros, Task};
use crate::vocabulary::{ApprovalDecision, ResolutionAction, TaskState};

/// A signal heard while the task was not waiting for it (an approval given before
/// the approval step began), kept for the wait it names.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct KeptSignal {
    pub name: String,
    pub signal_id: String,
    /// The approval step it answers; `None`: any wait for the name.
    #[serde(default)]
    pub step: Option<String>,
    /// The generation it answers; `None`: any.
    #[serde(default)]
    pub generation: Option<u32>,
    #[serde(default = "approves")]
    pub decision: ApprovalDecision,
}

fn approves() -> ApprovalDecision {
    ApprovalDecision::Approve
}

impl KeptSignal {
    /// Whether it answers the wait for `name` at `step` in `generation`.
    pub(super) fn answers(&self, name: &str, step: Option<&str>, generation: u32) -> bool {
        self.name == name
            && self.step.as_deref().is_none_or(|s| step == Some(s))
            && self.generation.is_none_or(|g| g == generation)
    }
}

/// How the reason of a task a person rejected begins, everywhere its state shows.
///
/// Do not change: readers (the CLI, dashboards) recognise a rejection by it.
pub const REJECTED_BY_PERSON: &str = "rejected by a person";

/// How many signal ids a task keeps, early ones and consumed ones each: a
/// duplicate of a consumed signal cannot approve a later wait, and a flood of
/// early signals cannot grow the task without bound.
pub(super) const SIGNALS_KEPT: usize = 32;

impl Task {
    /// A person's resolution of the case the task stopped under.
    pub(super) fn resolved(&mut self, action: ResolutionAction, result: Option<Artifact>, now: Micros) {
        match action {
            ResolutionAction::RetryAsNew => {
                self.generation += 1;
                self.key_in_doubt = false;
                self.failures = 0;
                self.throttles = 0;
                self.case_id = None;
                self.resume_after_step = None;
                // A new generation calls the step in doubt again under a new key;
                // the executor keeps the verified checkpoints of the steps before
                // it (approvals given included). A signal kept from before this
                // decision approves nothing the new generation has not reached.
                self.kept_signals.clear();
                self.wait_until(now, format!("retry as a new operation (generation {})", self.generation));
                self.state = TaskState::Queued;
            }
            ResolutionAction::AcceptFailed => self.finish(TaskState::Failed, "accepted as failed by a person"),
            ResolutionAction::AttachResult => {
                if let Some(result) = result {
                    self.result = Some(result);
                    self.finish(TaskState::Succeeded, "result attached by a person");
                }
            }
        }
    }

    /// Whether a signal with this id was kept or has ended a wait already.
    pub(super) fn signal_seen(&self, signal_id: &str) -> bool {
        self.consumed_signals.iter().any(|id| id == signal_id)
            || self.kept_signals.iter().any(|k| k.signal_id == signal_id)
    }

    /// A person's decision ends the wait: an approval lets the task go on, a
    /// rejection ends it failed, and no step after the wait runs.
    pub(super) fn decided(
        &mut self,
        name: &str,
        signal_id: String,
        decision: ApprovalDecision,
        now: Micros,
        how: &str,
    ) {
        match decision {
            ApprovalDecision::Approve => self.resume(name, signal_id, now, how),
            ApprovalDecision::Reject => {
                self.awaiting_signal = None;
                self.remember(signal_id);
                let step = self.step.clone().unwrap_or_default();
                self.finish(
                    TaskState::Failed,
                    &format!(
                        "{REJECTED_BY_PERSON}: the approval `{name}` of step `{step}` was refused; no step after it runs"
                    ),
                );
            }
        }
    }

    pub(super) fn remember(&mut self, signal_id: String) {
        self.consumed_signals.push(signal_id);
        if self.consumed_signals.len() > SIGNALS_KEPT {
            self.consumed_signals.remove(0);
        }
    }

    /// A signal ends the wait: the next attempt resumes after the waiting step.
    pub(super) fn resume(&mut self, name: &str, signal_id: String, now: Micros, how: &str) {
        self.awaiting_signal = None;
        self.resume_after_step = self.step.clone();
        self.remember(signal_id);
        self.wait_until(now, format!("signal `{name}` {how}"));
        self.state = TaskState::Queued;
    }
}
