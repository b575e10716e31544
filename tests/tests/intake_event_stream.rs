//! The event stream `GET /v1/events`: every change of the tenant's tasks is heard,
//! whichever instance made it and in whatever order the transactions committed.

use std::time::Duration;

use serde_json::Value;

use crate::intake_fixture::*;

/// One server-sent event a stream carried.
#[derive(Debug)]
struct Sent {
    event: String,
    data: String,
}

/// What an open event stream has carried so far, event by event.
type Stream = tokio::sync::mpsc::UnboundedReceiver<Sent>;

/// Opens `GET /v1/events` as the holder of `token` and passes on each event it
/// carries, until the stream ends or the receiver is dropped.
fn open_stream(intake: &Intake, token: &str) -> Stream {
    use std::io::BufRead;
    let (sent, received) = tokio::sync::mpsc::unbounded_channel();
    let (url, token) = (format!("{}/v1/events", intake.base), token.to_owned());
    std::thread::spawn(move || {
        let agent = ureq::Agent::config_builder().http_status_as_error(false).build().new_agent();
        let Ok(response) = agent.get(&url).header("Authorization", format!("Bearer {token}")).call() else { return };
        let (mut event, mut data) = (String::new(), String::new());
        for line in std::io::BufReader::new(response.into_body().into_reader()).lines() {
            let Ok(line) = line else { return };
            if let Some(name) = line.strip_prefix("event: ") {
                event = name.to_owned();
            } else if let Some(text) = line.strip_prefix("data: ") {
                data = text.to_owned();
            } else if line.is_empty() && !event.is_empty() {
                let one = Sent { event: std::mem::take(&mut event), data: std::mem::take(&mut data) };
                if sent.send(one).is_err() {
                    return;
                }
            }
        }
    });
    received
}

/// The task of the stream's next `task` event, if one comes before `until`; the
/// stream must not ask for a reload meanwhile.
async fn next_task(stream: &mut Stream, until: tokio::time::Instant) -> Option<String> {
    while let Ok(Some(sent)) = tokio::time::timeout_at(until, stream.recv()).await {
        assert_ne!(sent.event, "reset", "the stream asked for a reload");
        if sent.event == "task" {
            let view: Value = serde_json::from_str(&sent.data).expect("a task event carries the task");
            return Some(view["task_id"].as_str().expect("task id").to_owned());
        }
    }
    None
}

/// The tasks a stream sent `task` events for within `within`, in order.
async fn heard_within(stream: &mut Stream, within: Duration) -> Vec<String> {
    let until = tokio::time::Instant::now() + within;
    let mut tasks = Vec::new();
    while let Some(task) = next_task(stream, until).await {
        tasks.push(task);
    }
    tasks
}

/// Waits (up to 10 s) for a stream's `task` event about `task_id`.
async fn hears(stream: &mut Stream, task_id: &str) {
    let until = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        match next_task(stream, until).await {
            Some(task) if task == task_id => return,
            Some(_) => {}
            None => panic!("the stream did not hear of {task_id} within 10 s"),
        }
    }
}

/// Waits (up to 10 s) for the stream's first event, which must be `ready`.
async fn ready(stream: &mut Stream) {
    let first = tokio::time::timeout(Duration::from_secs(10), stream.recv()).await.expect("ready in time");
    assert_eq!(first.map(|s| s.event).as_deref(), Some("ready"));
}

/// Submits an image through `intake` as the holder of `token`; the new task's id.
async fn submitted(intake: &Intake, token: &str, key: &str) -> String {
    let answer =
        call("POST", format!("{}/v1/tasks", intake.base), Some(token.to_owned()), Some(key), Some(image(key))).await;
    assert_eq!(answer.status, 202, "{:?}", answer.body);
    answer.body["task_id"].as_str().expect("task id").to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_hears_every_change_of_its_tenant_whichever_instance_made_it() {
    let first = start_intake().await;
    let second = restart_intake(&first, None).await.expect("a second intake starts");
    let mut acme = open_stream(&first, &first.acme);
    let mut globex = open_stream(&first, &first.globex);
    ready(&mut acme).await;
    ready(&mut globex).await;

    let task = submitted(&second, &second.acme, "through-the-other-instance").await;
    hears(&mut acme, &task).await;
    let cancel =
        call("POST", format!("{}/v1/tasks/{task}/cancel", second.base), Some(second.acme.clone()), None, None).await;
    assert_eq!(cancel.status, 202);
    hears(&mut acme, &task).await;
    let theirs = submitted(&second, &second.globex, "another-tenant").await;
    hears(&mut globex, &theirs).await;

    let heard_by_globex = heard_within(&mut globex, Duration::from_millis(500)).await;
    let heard_by_acme = heard_within(&mut acme, Duration::from_millis(500)).await;
    assert!(!heard_by_globex.contains(&task), "a stream never carries another tenant's task");
    assert!(!heard_by_acme.contains(&theirs), "a stream never carries another tenant's task");
}

/// A transaction marks its change before others commit theirs and commits after
/// the streams heard of those: a follower that only read forward from the newest
/// change it saw would never hear it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_committed_after_later_ones_were_heard_is_heard_too() {
    let intake = start_intake().await;
    let mut acme = open_stream(&intake, &intake.acme);
    ready(&mut acme).await;
    let early = submitted(&intake, &intake.acme, "marked-early").await;
    hears(&mut acme, &early).await;

    let mut held = intake.pool.begin().await.expect("begin");
    let early_id: fenceline_domain::ids::TaskId = early.parse().expect("task id");
    fenceline_intake::live::changed(&mut held, early_id, Some("acme")).await.expect("marked");
    let later = submitted(&intake, &intake.acme, "committed-first").await;
    hears(&mut acme, &later).await;
    let while_held = heard_within(&mut acme, fenceline_intake::live::POLL_EVERY * 5).await;
    assert!(!while_held.contains(&early), "a change is not heard before it commits");

    held.commit().await.expect("commit");
    hears(&mut acme, &early).await;
}
