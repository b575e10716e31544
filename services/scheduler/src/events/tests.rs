//! The scheduler's reading of an attempt's reports: only the live attempt's, and
//! never one behind what its task already shows.

use fenceline_domain::ids::GrantId;
use fenceline_domain::lifecycle::Policy;

use super::*;

/// A task of `image.caption` whose first attempt, granted as `grant`, reported
/// `inputs` (after its grant).
fn row(grant: GrantId, inputs: Vec<Input>) -> TaskRow {
    let policy = Policy {
        max_attempts: 3,
        backoff: fenceline_domain::calls::Backoff { base: Duration::from_secs(1), cap: Duration::from_secs(60) },
        busy_wait: Duration::from_secs(2),
        send_again: Vec::new(),
    };
    let mut task = Task::accepted(0, None, None);
    for input in std::iter::once(Input::Grant { grant_id: grant }).chain(inputs) {
        task = task.apply(input, 1, &policy).task;
    }
    TaskRow {
        task_id: TaskId::new_v7(),
        tenant: "acme".into(),
        kind: "image.caption".into(),
        input_json: "{}".into(),
        lifecycle: task,
        version: 3,
        pending_signal: None,
        pending_step: None,
        traceparent: None,
        accepted_at: 0,
    }
}

#[test]
fn a_report_of_the_live_attempt_applies_unless_it_is_behind_what_the_task_shows() {
    let catalog = crate::test_catalog::draw_then_caption();
    let grant = GrantId::new_v7();
    let row = row(
        grant,
        vec![
            Input::Claimed { grant_id: grant },
            Input::Progress { grant_id: grant, step: "caption".into(), phase: Phase::CallIntent },
        ],
    );
    let applies = |attempt, step, phase| progress(&catalog, &row, attempt, step, phase).is_some();
    assert!(applies(1, "caption", Phase::ResultRecorded), "the next phase of the shown step");
    assert!(applies(1, "caption", Phase::CallIntent), "the shown phase itself, which moves nothing");
    assert!(!applies(1, "draw", Phase::ResultRecorded), "a step before the shown one, heard again");
    assert!(!applies(1, "draw", Phase::CallIntent), "the first step's intent, heard again");
    assert!(!applies(2, "caption", Phase::ResultRecorded), "another attempt's report");
    let unknown = TaskRow { kind: "gone.from.the.catalogue".into(), ..row.clone() };
    assert!(progress(&catalog, &unknown, 1, "draw", Phase::ResultRecorded).is_none(), "no order to tell by");
}
