//! Fairness on the real stack: with 5,000 queued tasks of tenant A and a provider
//! limited to 4 concurrent calls, a task of tenant B is dispatched within the time
//! of a few attempts, while a task A submits at the same moment waits behind A's
//! own backlog. The measured waits are printed.

#![allow(clippy::print_stdout)] // the measured waits are the point of this test

use std::time::{Duration, Instant};

use fenceline_domain::ids::TaskId;
use fenceline_tests::system::{Caps, System};
use serde_json::json;

/// The task's last granted attempt as the scheduler has it; `None` until the
/// scheduler has taken the task in.
async fn attempt_of(system: &System, task: TaskId) -> Option<i64> {
    sqlx::query_scalar("SELECT (lifecycle->>'attempt')::bigint FROM scheduler.tasks WHERE task_id = $1")
        .bind(task.as_uuid())
        .fetch_optional(&system.pool)
        .await
        .expect("task")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_tenants_backlog_does_not_block_another_tenant() {
    let mut system = System::new(&[("img", Caps::default())]).await;
    // Every call takes 300 ms: four slots finish about 13 attempts a second.
    system.provider("img").rule(json!({"latency_ms": 300})).await;
    system.spawn_all(None).await;

    // `FENCELINE_FAIRNESS_BACKLOG` sets the backlog's size.
    let backlog: usize = std::env::var("FENCELINE_FAIRNESS_BACKLOG").ok().and_then(|v| v.parse().ok()).unwrap_or(5_000);
    let started = Instant::now();
    system.submit_many("tenant-a", "image.generate", backlog).await;
    let deadline = Instant::now() + Duration::from_secs(180);
    loop {
        let seen: i64 = sqlx::query_scalar("SELECT count(*) FROM scheduler.tasks WHERE tenant = 'tenant-a'")
            .fetch_one(&system.pool)
            .await
            .expect("count");
        if seen == i64::try_from(backlog).unwrap_or(i64::MAX) {
            break;
        }
        assert!(Instant::now() < deadline, "the scheduler took in {seen} of {backlog} tasks");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    println!("the scheduler took in {backlog} tasks of tenant A in {:?}", started.elapsed());

    let submitted = Instant::now();
    let b = system.submit("tenant-b", "image.generate", json!({"who": "b"})).await;
    let late_a = system.submit("tenant-a", "image.generate", json!({"who": "late a"})).await;
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut taken_in = None;
    // The database's clock when B's row was first seen in the scheduler: every dispatch
    // round whose transaction began later saw B.
    let mut seen_in_scheduler_us = None;
    loop {
        let attempt = attempt_of(&system, b).await;
        if attempt.is_some_and(|n| n >= 1) {
            break;
        }
        if taken_in.is_none() && attempt.is_some() {
            taken_in = Some(Instant::now());
            seen_in_scheduler_us = Some(
                sqlx::query_scalar::<_, i64>("SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::bigint")
                    .fetch_one(&system.pool)
                    .await
                    .expect("clock"),
            );
        }
        assert!(Instant::now() < deadline, "tenant B's task was not dispatched within 120 s");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let dispatched = Instant::now();
    let taken_in = taken_in.unwrap_or(dispatched);
    let b_wait = dispatched - taken_in;
    let done: i64 =
        sqlx::query_scalar("SELECT count(*) FROM scheduler.tasks WHERE tenant = 'tenant-a' AND state = 'succeeded'")
            .fetch_one(&system.pool)
            .await
            .expect("count");
    println!(
        "tenant B's task: taken in by the scheduler {:?} after submission (the broker's transport), dispatched \
         {b_wait:?} after that, with {} of tenant A's tasks still queued",
        taken_in - submitted,
        i64::try_from(backlog).unwrap_or(i64::MAX) - done
    );
    // Fairness by order, whatever the transport: once B was in the scheduler, no more
    // than one of A's tasks (a dispatch round already under way) was granted before B.
    // The broker's transport before that (B's `accepted_at` is intake's instant) is not
    // the scheduler's order. A grant's `created_at` is its round's transaction start.
    // Had B been granted before the test saw its row, nothing is counted.
    let granted_before_b: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM scheduler.outbox o WHERE o.event_type = 'AttemptGranted' \
           AND o.record_key <> convert_to($1::text, 'UTF8') \
           AND o.created_at > coalesce(to_timestamp($2::bigint / 1000000.0), 'infinity') \
           AND o.created_at < (SELECT min(created_at) FROM scheduler.outbox \
                               WHERE event_type = 'AttemptGranted' AND record_key = convert_to($1::text, 'UTF8'))",
    )
    .bind(b.as_uuid())
    .bind(seen_in_scheduler_us)
    .fetch_one(&system.pool)
    .await
    .expect("grants");
    println!("grants to tenant A between B's arrival at the scheduler and B's grant: {granted_before_b}");
    assert!(granted_before_b <= 1, "{granted_before_b} of A's tasks were granted while B waited");
    if b_wait >= Duration::from_secs(3) {
        let progress: Vec<(String, String, i32, i64, Option<i64>, f64)> = sqlx::query_as(
            "SELECT consumer_group, topic, partition, epoch, next_offset, \
             extract(epoch FROM now() - updated_at)::float8 FROM executor.consumer_partitions \
             UNION ALL SELECT consumer_group, topic, partition, epoch, next_offset, \
             extract(epoch FROM now() - updated_at)::float8 FROM scheduler.consumer_partitions ORDER BY 1, 2, 3",
        )
        .fetch_all(&system.pool)
        .await
        .unwrap_or_default();
        panic!(
            "B waited {b_wait:?} in the scheduler: longer than a few 300 ms attempts\nconsumer progress \
             (group, topic, partition, epoch, next offset, idle s): {progress:#?}\n{}",
            system.logs()
        );
    }
    assert!(attempt_of(&system, late_a).await.unwrap_or(0) == 0, "A's own new task waits behind A's backlog");
    system.wait_state(b, &["succeeded"], Duration::from_secs(30)).await;
}

/// A provider whose slots are all taken does not hide the due tasks of another: with
/// rounds of two grants and three tenants' tasks waiting ahead on a full provider, a
/// task for a free provider is granted at once, not when the full one frees a slot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_provider_does_not_hide_the_due_tasks_of_another() {
    let mut system = System::new(&[("slow", Caps::default()), ("fast", Caps::default())]).await;
    system.set_provider_limits("slow", 1, 50.0, 50.0);
    let kind = |provider: &str| json!({"steps": [{"name": "run", "provider": provider}], "max_attempts": 3, "attempt_budget_ms": 60_000});
    system.set_kinds(json!({"slow.job": kind("slow"), "fast.job": kind("fast")}));
    // The slow provider's one slot stays taken for the rest of the test.
    system.provider("slow").rule(json!({"latency_ms": 60_000})).await;
    system.spawn("scheduler", "scheduler", &[("FENCELINE_SCHEDULER_GRANTS_PER_ROUND", "2".into())]).await;
    system.spawn("executor", "executor", &[]).await;

    // Seven tasks for the one-slot provider: one of them takes the slot (which one
    // depends on the order the scheduler took them in), six queue behind it.
    let mut slow = vec![];
    for tenant in ["tenant-a", "tenant-b", "tenant-c"] {
        for n in 0..if tenant == "tenant-a" { 3 } else { 2 } {
            slow.push(system.submit(tenant, "slow.job", json!({"n": n})).await);
        }
    }
    let granted_and_queued = |attempts: &[Option<i64>]| {
        let granted = attempts.iter().filter(|a| a.is_some_and(|n| n >= 1)).count();
        let queued = attempts.iter().filter(|a| **a == Some(0)).count();
        (granted, queued)
    };
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let mut attempts = vec![];
        for task in &slow {
            attempts.push(attempt_of(&system, *task).await);
        }
        if granted_and_queued(&attempts) == (1, 6) {
            break;
        }
        assert!(Instant::now() < deadline, "the slow provider's tasks never queued behind its one slot: {attempts:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // Tenant D has never been granted: it sorts behind two of the queued tenants by
    // name, so the first page of two heads is all for the full provider.
    let fast = system.submit("tenant-d", "fast.job", json!({"n": 0})).await;
    let submitted = Instant::now();
    while attempt_of(&system, fast).await.is_none_or(|n| n == 0) {
        assert!(
            // The full provider's call times out after 10 s and frees its slot.
            submitted.elapsed() < Duration::from_secs(5),
            "the free provider's task waited behind the full provider's"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    println!("a task for a free provider was granted {:?} after submission", submitted.elapsed());
    let mut attempts = vec![];
    for task in &slow {
        attempts.push(attempt_of(&system, *task).await);
    }
    assert_eq!(granted_and_queued(&attempts), (1, 6), "the full provider granted beyond its one slot");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tasks_of_a_kind_the_catalogue_no_longer_has_do_not_hold_up_their_tenants_queue() {
    let mut system = System::new(&[("img", Caps::default())]).await;
    let kind = |steps: serde_json::Value| json!({"steps": steps, "max_attempts": 4, "attempt_budget_ms": 60_000});
    let render = json!([{"name": "render", "provider": "img"}]);
    system.set_kinds(json!({"image.generate": kind(render.clone()), "image.gone": kind(render.clone())}));
    system.spawn_all(None).await;
    // More queued tasks of one kind than a round looks at, due in a few seconds…
    let due = fenceline_events::Timestamp(fenceline_events::Timestamp::now().0 + 6_000_000);
    system.submit_many_with("tenant-a", "image.gone", 40, |_, t| t.not_before = Some(due)).await;
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let seen: i64 = sqlx::query_scalar("SELECT count(*) FROM scheduler.tasks WHERE kind = 'image.gone'")
            .fetch_one(&system.pool)
            .await
            .expect("count");
        if seen == 40 {
            break;
        }
        assert!(Instant::now() < deadline, "the scheduler took in {seen} of 40");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // …and then the kind leaves the catalogue: the scheduler restarts without it.
    system.set_kinds(json!({"image.generate": kind(render)}));
    system.spawn("scheduler", "scheduler", &[]).await;
    let later = fenceline_events::Timestamp(due.0 + 1_000_000);
    let known = system
        .submit_with("tenant-a", "image.generate", json!({"prompt": "a known kind"}), |t| t.not_before = Some(later))
        .await;
    system.wait_state(known, &["succeeded"], Duration::from_secs(30)).await;
}

/// The dispatcher's question, asked of a scheduler whose one provider is at its
/// limit with 20,000 due tasks of one tenant: the answer is each tenant's head in
/// the tenants' turn, and asking costs a few index entries per tenant and
/// provider, not a read of every due task (429 buffers at 20,000, and 62 ms a
/// round at 100,000, before).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dispatch_round_reads_a_few_entries_per_tenant_and_provider_however_long_the_queue() {
    let url = fenceline_tests::fresh_database().await;
    let db = fenceline_store::connect(
        &fenceline_tests::postgres(&url, "scheduler"),
        "scheduler",
        &[&fenceline_bus::MIGRATOR, &fenceline_scheduler::MIGRATOR],
    )
    .await
    .expect("the scheduler's schema");
    let add = |tenant: &str, provider: Option<&str>, count: i64, priority: i16, first_due: i64| {
        sqlx::query(
            "INSERT INTO tasks (task_id, tenant, kind, input_json, priority, provider, lifecycle, state, due_at_us) \
             SELECT gen_random_uuid(), $1, 'image.generate', '{}', $4, $2, '{}', 'queued', $5 + i \
             FROM generate_series(1, $3) i",
        )
        .bind(tenant.to_owned())
        .bind(provider.map(str::to_owned))
        .bind(count)
        .bind(priority)
        .bind(first_due)
    };
    add("tenant-a", Some("img"), 20_000, 1, 1_000).execute(&db.pool).await.expect("tenant A's backlog");
    add("tenant-b", Some("txt"), 3, 1, 50_000).execute(&db.pool).await.expect("tenant B's tasks");
    add("tenant-c", None, 2, 0, 60_000).execute(&db.pool).await.expect("tenant C's approvals");
    add("tenant-b", Some("img"), 5, 1, 10_000_000).execute(&db.pool).await.expect("not due yet");
    sqlx::query("INSERT INTO tenant_turns (tenant, last_granted_at_us) VALUES ('tenant-a', 1), ('tenant-b', 2)")
        .execute(&db.pool)
        .await
        .expect("turns");
    sqlx::query("ANALYZE tasks").execute(&db.pool).await.expect("analyze");

    // Each head with its tenant and due time, in the order the dispatcher gets them.
    let heads = async |limit: i64, excluded: Vec<String>| -> Vec<(String, Option<String>, i64)> {
        let ids: Vec<(uuid::Uuid, Option<String>)> = sqlx::query_as(fenceline_scheduler::dispatch::store::HEADS)
            .bind(1_000_000_i64)
            .bind(limit)
            .bind(excluded)
            .fetch_all(&db.pool)
            .await
            .expect("heads");
        let (task_ids, providers): (Vec<uuid::Uuid>, Vec<Option<String>>) = ids.into_iter().unzip();
        let described: Vec<(String, i64)> = sqlx::query_as(
            "SELECT t.tenant, t.due_at_us FROM unnest($1::uuid[]) WITH ORDINALITY AS h (task_id, n) \
             JOIN tasks t USING (task_id) ORDER BY h.n",
        )
        .bind(&task_ids)
        .fetch_all(&db.pool)
        .await
        .expect("heads' tasks");
        described.into_iter().zip(providers).map(|((tenant, due), provider)| (tenant, provider, due)).collect()
    };
    let first = heads(4, vec![]).await;
    let order: Vec<(&str, Option<&str>)> = first.iter().map(|(t, p, _)| (t.as_str(), p.as_deref())).collect();
    assert_eq!(
        order[..3],
        [("tenant-c", None), ("tenant-a", Some("img")), ("tenant-b", Some("txt"))],
        "each tenant's head first, the tenant never granted before the others, then by last grant: {first:?}"
    );
    assert_eq!(first[3].0, "tenant-c", "then each tenant's second: {first:?}");
    let without_img = heads(32, vec!["img".into()]).await;
    assert_eq!(without_img.len(), 5, "every due task of the other providers, none of img's: {without_img:?}");
    assert!(without_img.iter().all(|(_, p, due)| p.as_deref() != Some("img") && *due <= 1_000_000));

    for excluded in [vec![], vec!["img".to_owned()]] {
        let plan: serde_json::Value = sqlx::query_scalar(&format!(
            "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) {}",
            fenceline_scheduler::dispatch::store::HEADS
        ))
        .bind(1_000_000_i64)
        .bind(32_i64)
        .bind(&excluded)
        .fetch_one(&db.pool)
        .await
        .expect("plan");
        let top = &plan[0]["Plan"];
        let buffers = top["Shared Hit Blocks"].as_i64().unwrap_or(0) + top["Shared Read Blocks"].as_i64().unwrap_or(0);
        assert!(
            buffers < 100,
            "excluding {excluded:?}, a round read {buffers} buffers of a queue of 20,000: {}",
            serde_json::to_string_pretty(&plan).unwrap_or_default()
        );
    }
}
