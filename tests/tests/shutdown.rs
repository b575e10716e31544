//! Shutdown when the service's dependencies are gone: a service asked to stop
//! (SIGTERM) exits within its grace period and a bounded margin, even while its
//! broker and its database are both unreachable and its relay holds rows it could
//! not publish. An orchestrator waits that long before it kills; a service that
//! hangs on would hold its port, and its pod, until then.

#![allow(clippy::print_stdout)] // each service's time to exit is worth seeing

use std::time::Duration;

use fenceline_tests::system::{Caps, Stop, System, api_agent, submit_over_api};
use serde_json::json;

/// The tests' shutdown grace (`FENCELINE_SHUTDOWN_GRACE_MS` in the system's settings).
const GRACE: Duration = Duration::from_secs(3);
/// What a stop may take beyond the grace: the relay's last round and the pool's close,
/// each bounded.
const MARGIN: Duration = Duration::from_secs(7);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_service_exits_on_sigterm_within_its_grace_when_broker_and_database_are_gone() {
    let mut system = System::with_own_broker_and_postgres(&[("imagegen", Caps::default())]).await;
    system.spawn("intake", "intake", &[]).await;
    system.spawn_all(None).await;
    let token = system.token("tenant-a").await;
    let intake = system.url_of("intake");
    let submit = |n: u32| {
        let (intake, token) = (intake.clone(), token.clone());
        tokio::task::spawn_blocking(move || {
            let body = json!({"kind": "image.generate", "input": {"prompt": format!("item {n}")}});
            submit_over_api(&api_agent(), &intake, &token, &format!("shutdown-{n}"), &body)
        })
    };
    // The system works before anything is taken away.
    let first = submit(0).await.expect("thread").expect("intake answers");
    assert_eq!(first.status, 202, "{:?}", first.body);
    let task = first.task_id().expect("a task id").parse().expect("a uuid");
    system.wait_state(task, &["succeeded"], Duration::from_secs(60)).await;

    // The broker dies first: accepted submissions pile up in intake's outbox, and its
    // relay keeps trying to hand them over.
    system.broker().kill();
    for n in 1..=5 {
        let submitted = submit(n).await.expect("thread").expect("intake answers");
        assert_eq!(submitted.status, 202, "intake accepts while the broker is down: {:?}", submitted.body);
    }
    tokio::time::sleep(Duration::from_secs(2)).await;
    // Then the database.
    system.postgres().stop().await;
    tokio::time::sleep(Duration::from_secs(1)).await;

    // While the broker is down, librdkafka reports the same error on every retry;
    // each client logs each kind once in a while, not every time.
    let all_down = system.count_lines("AllBrokersDown");
    println!("lines naming AllBrokersDown with the broker down, every service: {all_down}");
    assert!(all_down <= 16, "{all_down} lines name AllBrokersDown: the repeats are not held back\n{}", system.logs());
    for id in ["intake", "scheduler", "executor", "reconciler"] {
        let took = system.stop(id, Stop::Term).await;
        println!("{id} exited {took:?} after SIGTERM");
        assert!(
            took <= GRACE + MARGIN,
            "{id} took {took:?} to exit after SIGTERM with its broker and database gone (allowed: {:?})\n{}",
            GRACE + MARGIN,
            system.logs()
        );
    }
}
