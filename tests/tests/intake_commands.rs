//! Cancels, signals and resolutions sent to intake: each sent once however often it is
//! asked, and refused when the task's kind, case or state does not take it.

use std::time::Duration;

use fenceline_events::topics;
use fenceline_tests::*;
use serde_json::{Value, json};

use crate::intake_fixture::*;

/// Events intake wrote to fenceline.tasks, by type, read as the scheduler would.
async fn task_events(intake: &Intake, expected: usize) -> Vec<fenceline_events::Event> {
    let (brokers, topic) = (brokers(), topics::named(&intake.prefix, topics::TASKS));
    let records = tokio::task::spawn_blocking(move || read_topic(&brokers, &topic, expected, Duration::from_secs(30)))
        .await
        .expect("reader");
    records
        .iter()
        .filter_map(|r| rdkafka::message::Message::payload(r).and_then(|p| fenceline_events::decode(p).ok()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_and_signals_are_sent_once_however_often_they_are_asked() {
    let intake = start_intake().await;
    let created =
        call("POST", format!("{}/v1/tasks", intake.base), Some(intake.acme.clone()), Some("k"), Some(image("x"))).await;
    let task = format!("{}/v1/tasks/{}", intake.base, created.body["task_id"].as_str().expect("id"));
    let token = Some(intake.acme.clone());

    for repeated in [false, true] {
        let cancel = call("POST", format!("{task}/cancel"), token.clone(), None, None).await;
        assert_eq!((cancel.status, cancel.body["repeated"].as_bool()), (202, Some(repeated)));
        let approve = call(
            "POST",
            format!("{task}/signals/approve"),
            token.clone(),
            None,
            Some(json!({"approved": true}).to_string()),
        )
        .await;
        assert_eq!((approve.status, approve.body["repeated"].as_bool()), (202, Some(repeated)), "{:?}", approve.body);
    }
    let other =
        call("POST", format!("{task}/signals/approve"), token.clone(), Some("second-approval"), Some("{}".into()))
            .await;
    assert_eq!(other.body["repeated"], false, "a signal with its own key is a new signal");
    let bad = call("POST", format!("{task}/signals/approve"), token.clone(), None, Some("{oops".into())).await;
    assert_eq!((bad.status, bad.body["type"].as_str()), (400, Some("/problems/invalid-request")));
    let foreign = call("POST", format!("{task}/cancel"), Some(intake.globex.clone()), None, None).await;
    assert_eq!(foreign.status, 404);
    let foreign = call("POST", format!("{task}/signals/approve"), Some(intake.globex.clone()), None, None).await;
    assert_eq!(foreign.status, 404, "another tenant cannot signal the task");

    let events = task_events(&intake, 4).await;
    let count = |t: &str| events.iter().filter(|e| e.event_type() == t).count();
    assert_eq!((count("TaskAccepted"), count("CancelRequested"), count("SignalReceived")), (1, 1, 2));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resolution_names_the_case_it_decides_and_is_refused_once_the_case_changed_or_was_decided() {
    let intake = start_intake().await;
    let created =
        call("POST", format!("{}/v1/tasks", intake.base), Some(intake.acme.clone()), Some("k"), Some(image("x"))).await;
    let task_id = created.body["task_id"].as_str().expect("id").to_owned();
    let url = format!("{}/v1/tasks/{task_id}/resolution", intake.base);
    let token = Some(intake.acme.clone());
    let resolve = |token: Option<String>, body: Value| call("POST", url.clone(), token, None, Some(body.to_string()));
    let accept = |case: &str| json!({"case_id": case, "action": "accept_failed"});
    let retry = |case: &str| json!({"case_id": case, "action": "retry_as_new", "acknowledge_possible_charge": true});

    let early = resolve(token.clone(), accept("case-1")).await;
    assert_eq!((early.status, early.body["type"].as_str()), (409, Some("/problems/not-resolvable")));
    let foreign = resolve(Some(intake.globex.clone()), accept("case-1")).await;
    assert_eq!((foreign.status, foreign.body["type"].as_str()), (404, Some("/problems/task-not-found")));

    // The scheduler (simulated here) declared the outcome unknown.
    project(&intake, &task_id, "outcome_unknown", "case-1", 5).await;
    let foreign = resolve(Some(intake.globex.clone()), accept("case-1")).await;
    assert_eq!(foreign.status, 404, "another tenant's task is not found, whatever its state");
    let unacknowledged = resolve(token.clone(), json!({"case_id": "case-1", "action": "retry_as_new"})).await;
    assert_eq!(unacknowledged.status, 400);
    assert!(unacknowledged.body["detail"].as_str().unwrap_or_default().contains("acknowledge_possible_charge"));
    let no_result = resolve(token.clone(), json!({"case_id": "case-1", "action": "attach_result"})).await;
    assert_eq!(no_result.status, 400);
    let no_case = resolve(token.clone(), json!({"action": "accept_failed"})).await;
    assert_eq!((no_case.status, no_case.body["type"].as_str()), (400, Some("/problems/invalid-request")));
    let stale = resolve(token.clone(), accept("case-0")).await;
    assert_eq!((stale.status, stale.body["type"].as_str()), (409, Some("/problems/case-changed")), "{:?}", stale.body);

    // An approval, sent twice with the same payload, is one signal.
    let approve = || {
        call(
            "POST",
            format!("{}/v1/tasks/{task_id}/signals/approve", intake.base),
            token.clone(),
            None,
            Some("{}".into()),
        )
    };
    assert_eq!(approve().await.body["repeated"], false);
    assert_eq!(approve().await.body["repeated"], true);

    let first = resolve(token.clone(), retry("case-1")).await;
    assert_eq!((first.status, first.body["repeated"].as_bool()), (202, Some(false)), "{:?}", first.body);
    let second = resolve(token.clone(), retry("case-1")).await;
    assert_eq!((second.status, second.body["repeated"].as_bool()), (202, Some(true)), "carried out once per case");
    let other = resolve(token.clone(), accept("case-1")).await;
    assert_eq!((other.status, other.body["type"].as_str()), (409, Some("/problems/already-resolved")));
    assert!(other.body["detail"].as_str().unwrap_or_default().contains("retry_as_new"), "{:?}", other.body);

    // The new generation runs its approval step again: the same approval reaches it.
    assert_eq!(approve().await.body["repeated"], false, "a new generation takes the same approval anew");

    // Retries exhausted: the task needs a person, who can resolve it as well.
    project(&intake, &task_id, "needs_human", "needs_human-g1-a3", 9).await;
    let read = call("GET", format!("{}/v1/tasks/{task_id}", intake.base), token.clone(), None, None).await;
    assert_eq!(read.body["case"]["case_id"], "needs_human-g1-a3", "{:?}", read.body);
    assert!(read.body["case"]["evidence"][0]["finding"].as_str().unwrap_or_default().contains("exhausted"));
    let decided = resolve(token.clone(), accept("needs_human-g1-a3")).await;
    assert_eq!((decided.status, decided.body["repeated"].as_bool()), (202, Some(false)), "{:?}", decided.body);

    let events = task_events(&intake, 5).await;
    let resolutions: Vec<_> = events
        .iter()
        .filter_map(|e| match e {
            fenceline_events::Event::ResolutionDecided(r) => Some((r.case_id.as_str(), r.action.as_str())),
            _ => None,
        })
        .collect();
    assert_eq!(resolutions, vec![("case-1", "retry_as_new"), ("needs_human-g1-a3", "accept_failed")]);
    let signals = events.iter().filter(|e| e.event_type() == "SignalReceived").count();
    assert_eq!(signals, 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resolution_keeps_who_made_it_their_note_and_the_evidence_it_was_made_on() {
    let intake = start_intake().await;
    let created =
        call("POST", format!("{}/v1/tasks", intake.base), Some(intake.acme.clone()), Some("r"), Some(image("y"))).await;
    let task_id = created.body["task_id"].as_str().expect("id").to_owned();
    let token = Some(intake.acme.clone());
    // The scheduler and the reconciler (simulated here) declared the outcome unknown, with evidence.
    project(&intake, &task_id, "outcome_unknown", "case-7", 5).await;
    let evidence = json!([{"source": "executor", "observed_at": 1_767_225_617_000_000i64,
                           "finding": "the request left at 10:02:03; no answer within 30 s"}]);
    sqlx::query("INSERT INTO task_cases (task_id, case_id, evidence, decided_at) VALUES ($1, 'case-7', $2, now())")
        .bind(uuid::Uuid::parse_str(&task_id).expect("uuid"))
        .bind(&evidence)
        .execute(&intake.pool)
        .await
        .expect("case row");
    let url = format!("{}/v1/tasks/{task_id}/resolution", intake.base);
    let resolve = |body: Value| call("POST", url.clone(), token.clone(), None, Some(body.to_string()));
    let nameless = resolve(json!({"case_id": "case-7", "action": "accept_failed", "decided_by": " "})).await;
    assert_eq!((nameless.status, nameless.body["type"].as_str()), (400, Some("/problems/invalid-request")));
    let decided = resolve(json!({"case_id": "case-7", "action": "accept_failed", "decided_by": "Rui Costa",
                                 "note": "the gateway shows no message for this number"}))
    .await;
    assert_eq!(decided.status, 202, "{:?}", decided.body);

    // After the case closed (the task failed, the reconciler's case gone), the record stays.
    project(&intake, &task_id, "failed", "case-7", 6).await;
    sqlx::query("DELETE FROM task_cases WHERE task_id = $1")
        .bind(uuid::Uuid::parse_str(&task_id).expect("uuid"))
        .execute(&intake.pool)
        .await
        .expect("case gone");
    let read = call("GET", format!("{}/v1/tasks/{task_id}", intake.base), token.clone(), None, None).await;
    let record = &read.body["resolved_cases"][0];
    assert_eq!(
        (record["case_id"].as_str(), record["action"].as_str(), record["decided_by"].as_str()),
        (Some("case-7"), Some("accept_failed"), Some("Rui Costa")),
        "{:#}",
        read.body
    );
    assert_eq!(record["note"], "the gateway shows no message for this number");
    assert!(record["token_identity"].as_str().is_some_and(|t| !t.is_empty()), "{record}");
    assert!(record["decided_at"].is_string(), "{record}");
    assert_eq!(record["evidence"][0]["finding"], "the request left at 10:02:03; no answer within 30 s", "{record}");
    let events = task_events(&intake, 2).await;
    let by: Vec<&str> = events
        .iter()
        .filter_map(|e| match e {
            fenceline_events::Event::ResolutionDecided(r) => Some(r.decided_by.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(by, ["Rui Costa"], "the event names the person");
}

/// A catalogue as the other services read it: `ticket.triage` waits for
/// `refund_approved` between its calls, `image.generate` for no signal.
fn catalogue_file() -> std::path::PathBuf {
    let catalogue = json!({
        "providers": {"img": {"base_url": "http://127.0.0.1:9", "call_timeout_ms": 1000, "concurrency": 1,
                              "rate_per_second": 1, "burst": 1}},
        "kinds": {
            "image.generate": {"steps": [{"name": "render", "provider": "img"}], "attempt_budget_ms": 5000},
            "ticket.triage": {"steps": [
                {"name": "classify", "provider": "img"},
                {"name": "approve", "approval_signal": "refund_approved"},
                {"name": "refund", "provider": "img"}
            ], "attempt_budget_ms": 5000}
        }
    });
    let path = std::env::temp_dir().join(format!("catalog-{}.json", uuid::Uuid::now_v7().simple()));
    std::fs::write(&path, catalogue.to_string()).expect("write the catalogue");
    path
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_signal_no_step_of_the_tasks_kind_waits_for_is_refused_naming_those_it_takes() {
    let catalogue = catalogue_file();
    let kinds = vec!["image.generate".into(), "ticket.triage".into()];
    let intake = start_intake_with(&[], kinds, |config| config.intake.catalog.catalog = Some(catalogue)).await;
    let token = Some(intake.acme.clone());
    let submit = |key: &'static str, kind: &str| {
        let body = json!({"kind": kind, "input": {}}).to_string();
        call("POST", format!("{}/v1/tasks", intake.base), token.clone(), Some(key), Some(body))
    };
    let ticket = submit("ticket", "ticket.triage").await.body["task_id"].as_str().expect("id").to_owned();
    let image = submit("image", "image.generate").await.body["task_id"].as_str().expect("id").to_owned();
    let signal = |task: &str, name: &str| {
        call("POST", format!("{}/v1/tasks/{task}/signals/{name}", intake.base), token.clone(), None, Some("{}".into()))
    };

    let wrong = signal(&ticket, "approve").await;
    assert_eq!(
        (wrong.status, wrong.content_type.as_str(), wrong.body["type"].as_str()),
        (422, "application/problem+json", Some("/problems/unknown-signal")),
        "{:?}",
        wrong.body
    );
    let detail = wrong.body["detail"].as_str().unwrap_or_default();
    assert!(detail.contains("`approve`") && detail.contains("it takes `refund_approved`"), "{detail}");
    let none = signal(&image, "refund_approved").await;
    assert_eq!((none.status, none.body["type"].as_str()), (422, Some("/problems/unknown-signal")));
    let detail = none.body["detail"].as_str().unwrap_or_default();
    assert!(detail.contains("kind `image.generate` wait for no signal"), "{detail}");

    let right = signal(&ticket, "refund_approved").await;
    assert_eq!((right.status, right.body["repeated"].as_bool()), (202, Some(false)), "{:?}", right.body);
    let kept: Vec<String> =
        sqlx::query_scalar("SELECT signal_name FROM signals").fetch_all(&intake.pool).await.expect("signals");
    assert_eq!(kept, ["refund_approved"], "only the signal a step waits for was sent on");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_finished_task_refuses_new_signals_cancels_and_resolutions_naming_its_state() {
    let intake = start_intake().await;
    let token = Some(intake.acme.clone());
    for state in ["succeeded", "failed", "cancelled"] {
        let created =
            call("POST", format!("{}/v1/tasks", intake.base), token.clone(), Some(state), Some(image(state))).await;
        let task_id = created.body["task_id"].as_str().expect("id").to_owned();
        let task = format!("{}/v1/tasks/{task_id}", intake.base);
        let signal =
            |key: &'static str| call("POST", format!("{task}/signals/approve"), token.clone(), Some(key), None);
        let cancel = || call("POST", format!("{task}/cancel"), token.clone(), None, None);
        // Asked while the task ran.
        assert_eq!(signal("early").await.status, 202);
        if state == "cancelled" {
            assert_eq!(cancel().await.status, 202);
        }
        project(&intake, &task_id, state, "case-1", 7).await;

        let refused = |answer: &Answer, what: &str| {
            assert_eq!(
                (answer.status, answer.content_type.as_str(), answer.body["type"].as_str()),
                (409, "application/problem+json", Some("/problems/task-finished")),
                "{what} of a {state} task: {:?}",
                answer.body
            );
            let expected = format!("task {task_id} is already {state}; nothing to {what}");
            assert_eq!(answer.body["detail"].as_str(), Some(expected.as_str()));
        };
        refused(&signal("late").await, "signal");
        let resolution = json!({"case_id": "case-1", "action": "accept_failed"}).to_string();
        refused(&call("POST", format!("{task}/resolution"), token.clone(), None, Some(resolution)).await, "resolve");
        // What was asked before it finished answers as before: it was carried out once.
        assert_eq!(signal("early").await.body["repeated"], true, "{state}");
        let cancelled = cancel().await;
        if state == "cancelled" {
            assert_eq!((cancelled.status, cancelled.body["repeated"].as_bool()), (202, Some(true)));
        } else {
            refused(&cancelled, "cancel");
        }
    }
    let count = |table: &str| {
        let pool = intake.pool.clone();
        let query = format!("SELECT count(*) FROM {table}");
        async move { sqlx::query_scalar::<_, i64>(&query).fetch_one(&pool).await.expect("count") }
    };
    assert_eq!(
        (count("signals").await, count("cancellations").await, count("resolutions").await),
        (3, 1, 0),
        "nothing refused was recorded"
    );
}
