//! One task, one trace, everywhere: many tasks driven at once through the
//! consumers' batches, the dispatcher's rounds, the reconciler's cases and a
//! person's resolutions; every line of every task's timeline carries that task's
//! trace id, and no trace id appears on two tasks.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use fenceline_domain::ids::TaskId;
use fenceline_tests::system::{Caps, System, http_as, http_with};
use serde_json::json;

const LONG: Duration = Duration::from_secs(120);

async fn submit(system: &System, token: &str, n: usize) -> TaskId {
    let auth = format!("Bearer {token}");
    let key = format!("traced-{n}");
    let headers = [("Authorization", auth.as_str()), ("Idempotency-Key", key.as_str())];
    let body = json!({"kind": "image.generate", "input": {"prompt": format!("lamp {n}")}});
    let (status, answer) =
        http_with("POST", format!("{}/v1/tasks", system.url_of("intake")), &headers, Some(body)).await.expect("submit");
    assert_eq!(status, 202, "{answer}");
    answer["task_id"].as_str().and_then(|id| id.parse().ok()).expect("a task id")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_timeline_line_of_a_task_carries_its_own_trace_and_no_other_tasks() {
    const TASKS: usize = 40;
    let mut system = System::new(&[("img", Caps::default())]).await;
    // Three calls lose their answer after the work: cases for the reconciler and a person.
    system.provider("img").rule(json!({"status_after_work": 504, "bare": true, "times": 3})).await;
    system.spawn("intake", "intake", &[("FENCELINE_INTAKE_KINDS", "image.generate".into())]).await;
    let token = system.token("acme").await;
    system.spawn_all(None).await;
    // Submitted back to back: their events share the consumers' batches and the dispatcher's rounds.
    let mut tasks = Vec::with_capacity(TASKS);
    for n in 0..TASKS {
        tasks.push(submit(&system, &token, n).await);
    }

    let mut unknown = Vec::new();
    for task in &tasks {
        if system.wait_state(*task, &["succeeded", "outcome_unknown"], LONG).await == "outcome_unknown" {
            unknown.push(*task);
        }
    }
    assert_eq!(unknown.len(), 3, "three cases for a person");
    for task in &unknown {
        let url = format!("{}/v1/tasks/{task}", system.url_of("intake"));
        let deadline = tokio::time::Instant::now() + LONG;
        let case_id = loop {
            let (_, shown) = http_as("GET", url.clone(), &token, None).await.expect("read");
            if let Some(case_id) = shown["case"]["case_id"].as_str() {
                break case_id.to_owned();
            }
            assert!(tokio::time::Instant::now() < deadline, "intake never showed the case: {shown:#}");
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        let body = json!({"case_id": case_id, "action": "accept_failed", "decided_by": "Ana"});
        let (status, answer) = http_as("POST", format!("{url}/resolution"), &token, Some(body)).await.expect("resolve");
        assert_eq!(status, 202, "{answer}");
        system.wait_state(*task, &["failed"], LONG).await;
    }
    // Intake heard every service's events about each task by the time its final status is shown.
    tokio::time::sleep(Duration::from_secs(3)).await;

    let lines: Vec<(uuid::Uuid, String, Option<String>)> = sqlx::query_as(
        "SELECT task_id, event_type || ': ' || coalesce(detail, ''), trace_id FROM intake.task_timeline \
         WHERE task_id = ANY($1)",
    )
    .bind(tasks.iter().map(TaskId::as_uuid).collect::<Vec<_>>())
    .fetch_all(&system.pool)
    .await
    .expect("the timelines");
    let mut traces_of_task: BTreeMap<uuid::Uuid, BTreeSet<String>> = BTreeMap::new();
    let mut tasks_of_trace: BTreeMap<String, BTreeSet<uuid::Uuid>> = BTreeMap::new();
    let mut untraced = Vec::new();
    for (task, event, trace) in &lines {
        match trace {
            Some(trace) => {
                traces_of_task.entry(*task).or_default().insert(format!("{trace} ({event})"));
                tasks_of_trace.entry(trace.clone()).or_default().insert(*task);
            }
            None => untraced.push((task, event)),
        }
    }
    assert!(untraced.is_empty(), "lines without a trace: {untraced:?}");
    let shared: Vec<_> = tasks_of_trace.iter().filter(|(_, tasks)| tasks.len() > 1).collect();
    assert!(shared.is_empty(), "trace ids on more than one task: {shared:#?}");
    for (task, traces) in &traces_of_task {
        let ids: BTreeSet<&str> = traces.iter().filter_map(|t| t.split(' ').next()).collect();
        assert_eq!(ids.len(), 1, "task {task} has lines in several traces: {traces:#?}");
    }
    assert_eq!(traces_of_task.len(), TASKS, "every task has a traced timeline");
}
