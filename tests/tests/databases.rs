//! Each service can have its own database server: intake and the reconciler on the
//! test stack's Postgres, the scheduler and the executor on a second Postgres
//! cluster the test starts. Services share no tables (docs/decisions.md, "Each
//! service may have its own database server"), so tasks still run end to end,
//! the reconciler still settles a call whose answer was lost, intake's view shows
//! the final states, and nothing a service wrote landed on the other server.

use std::time::{Duration, Instant};

use fenceline_tests::process::OwnPostgres;
use fenceline_tests::system::{Caps, System, api_agent, http, http_as, submit_over_api};
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn intake_and_the_reconciler_on_one_server_and_the_scheduler_and_executor_on_another() {
    let mut system = System::new(&[("img", Caps { lookup: true, ..Caps::default() })]).await;
    // The reconciler's look-up path too: the first call is done and charged, and
    // its answer is a gateway's 504.
    system.set_provider_field("img", "call_timeout_ms", json!(2_000));
    system.set_provider_field("img", "registration_ms", json!(200));
    system.provider("img").rule(json!({"status_after_work": 504, "bare": true, "times": 1})).await;
    let second = OwnPostgres::start().await;
    let elsewhere = [("FENCELINE_DATABASE_URL", second.url())];
    system.spawn("intake", "intake", &[]).await;
    system.spawn("reconciler", "reconciler", &[]).await;
    system.spawn("scheduler", "scheduler", &elsewhere).await;
    system.spawn("executor", "executor", &elsewhere).await;
    let other = sqlx::postgres::PgPoolOptions::new().max_connections(2).connect(&second.url()).await.expect("second");

    let token = system.token("acme").await;
    let intake = system.url_of("intake");
    let (client_intake, client_token) = (intake.clone(), token.clone());
    let submitted = tokio::task::spawn_blocking(move || {
        let (intake, token, agent) = (client_intake, client_token, api_agent());
        (0..12)
            .map(|n| {
                let body = json!({"kind": "image.generate", "input": {"n": n}});
                let answer = submit_over_api(&agent, &intake, &token, &format!("db-{n}"), &body).expect("submit");
                assert_eq!(answer.status, 202, "{}", answer.body);
                answer.task_id().expect("task id").to_owned()
            })
            .collect::<Vec<_>>()
    });
    let ids = submitted.await.expect("client");

    // Every task succeeds, as intake (first server) and the scheduler (second) see it.
    let uuids: Vec<uuid::Uuid> = ids.iter().map(|id| id.parse().expect("uuid")).collect();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let at_scheduler: i64 =
            sqlx::query_scalar("SELECT count(*) FROM scheduler.tasks WHERE state = 'succeeded' AND task_id = ANY($1)")
                .bind(&uuids)
                .fetch_one(&other)
                .await
                .expect("scheduler on the second server");
        let in_view: i64 =
            sqlx::query_scalar("SELECT count(*) FROM intake.task_view WHERE state = 'succeeded' AND task_id = ANY($1)")
                .bind(&uuids)
                .fetch_one(&system.pool)
                .await
                .expect("intake on the first server");
        if at_scheduler == ids.len() as i64 && in_view == ids.len() as i64 {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "{at_scheduler} succeeded at the scheduler, {in_view} in intake's view, of {}\n{}",
            ids.len(),
            system.logs()
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    for id in &ids {
        let (status, body) = http_as("GET", format!("{intake}/v1/tasks/{id}"), &token, None).await.expect("read");
        assert_eq!((status, body["state"].as_str()), (200, Some("succeeded")), "{body}");
    }
    // The lost answer was settled by the reconciler's look-up, with no second call.
    let recovered: i64 = sqlx::query_scalar("SELECT count(*) FROM reconciler.cases")
        .fetch_one(&system.pool)
        .await
        .expect("the reconciler's cases on the first server");
    assert_eq!(recovered, 1, "one case: the call answered 504");
    let img = system.provider("img");
    assert_eq!(img.charges().await, ids.len(), "one charge per task");
    assert_eq!(img.calls().await.len(), ids.len(), "the 504 was recovered by look-up, not called again");

    // Each server holds only the schemas of its own services.
    let schemas = |pool: sqlx::PgPool| async move {
        let names: Vec<String> = sqlx::query_scalar(
            "SELECT nspname::text FROM pg_namespace WHERE nspname IN ('intake', 'scheduler', 'executor', 'reconciler') \
             ORDER BY 1",
        )
        .fetch_all(&pool)
        .await
        .expect("schemas");
        names
    };
    assert_eq!(schemas(system.pool.clone()).await, ["intake", "reconciler"]);
    assert_eq!(schemas(other.clone()).await, ["executor", "scheduler"]);

    // The reconciler's audit reads only its own tables: it answers, and finds nothing stuck.
    let (status, body) = http("GET", format!("{}/v1/audit", system.url_of("reconciler")), None).await.expect("audit");
    assert_eq!(status, 200, "{body}");
    assert_eq!(system.count_lines("\"level\":\"ERROR\""), 0, "no service logged an error:\n{}", system.logs());
}
