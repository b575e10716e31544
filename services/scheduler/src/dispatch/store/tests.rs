//! The dispatch round's store against a schema of its own: what a provider's room
//! reads under its lock, what the turns and buckets a round moved write back, and
//! the order in which the due heads come.

use fenceline_config::catalog::ProviderSpec;
use fenceline_domain::admission::Room;
use fenceline_domain::lifecycle::Micros;
use sqlx::PgPool;

use super::*;
use crate::test_schema;

/// A slot's expiry far ahead of the database's clock (the year 2100).
const LIVE: Micros = 4_102_444_800_000_000;
/// A slot's expiry long past.
const EXPIRED: Micros = 1;

/// A provider of concurrency 5 and burst 3, whose limit does not adapt (its room
/// reads no health).
fn provider() -> ProviderSpec {
    serde_json::from_value(serde_json::json!({
        "base_url": "http://127.0.0.1:1",
        "call_timeout_ms": 1_000,
        "concurrency": 5,
        "rate_per_second": 1.0,
        "burst": 3.0,
        "adaptive_concurrency": {"enabled": false},
    }))
    .expect("a provider spec")
}

async fn hold_slot(pool: &PgPool, grant_id: uuid::Uuid, provider: &str, expires_at_us: Micros) {
    sqlx::query(
        "INSERT INTO slots (grant_id, task_id, provider, tenant, kind, expires_at_us) VALUES ($1, $2, $3, 'a', 'k', $4)",
    )
    .bind(grant_id)
    .bind(uuid::Uuid::now_v7())
    .bind(provider)
    .bind(expires_at_us)
    .execute(pool)
    .await
    .expect("insert a slot");
}

async fn hold_other_provider_slot(pool: &PgPool, grant_id: uuid::Uuid, provider: &str) {
    sqlx::query(
        "INSERT INTO other_provider_slots (grant_id, task_id, provider, expires_at_us) VALUES ($1, $2, $3, $4)",
    )
    .bind(grant_id)
    .bind(uuid::Uuid::now_v7())
    .bind(provider)
    .bind(LIVE)
    .execute(pool)
    .await
    .expect("insert another provider's slot");
}

async fn room(pool: &PgPool, name: &str, now: Micros) -> Option<Room> {
    let mut tx = pool.begin().await.expect("begin");
    let room = lock_provider(&mut tx, name, &provider(), now).await.expect("lock the provider");
    tx.commit().await.expect("commit");
    room
}

#[tokio::test]
async fn a_providers_room_counts_its_live_slots_and_creates_its_bucket_full() {
    let db = test_schema::fresh().await;
    let pool = &db.pool;
    let (mine, also_elsewhere) = (uuid::Uuid::now_v7(), uuid::Uuid::now_v7());
    hold_slot(pool, mine, "counted", LIVE).await;
    hold_slot(pool, also_elsewhere, "counted-elsewhere", LIVE).await;
    hold_slot(pool, uuid::Uuid::now_v7(), "counted", EXPIRED).await;
    // A grant whose own slot lives holds one here too; one whose own slot is gone does not.
    hold_other_provider_slot(pool, also_elsewhere, "counted").await;
    hold_other_provider_slot(pool, uuid::Uuid::now_v7(), "counted").await;

    let first = room(pool, "counted", 1_000).await.expect("no other round holds the provider");
    assert_eq!(
        first,
        Room { slots: 2, allowed: 5, reduced: None, tokens: 3.0, counted_at: 1_000 },
        "two live slots (its own and another provider's grant's), the bucket created full at `now`"
    );

    // The bucket is read as it was last written, not created again.
    let mut tx = pool.begin().await.expect("begin");
    write_buckets(&mut tx, &[("counted", 0.5, 2_000)]).await.expect("write the bucket");
    tx.commit().await.expect("commit");
    let later = room(pool, "counted", 3_000).await.expect("no other round holds the provider");
    assert_eq!((later.tokens, later.counted_at), (0.5, 2_000));
}

#[tokio::test]
async fn a_provider_held_by_another_round_has_no_room_until_that_round_ends() {
    // Advisory locks are the database's, not the schema's: the providers here are
    // named for this test alone, so that store tests running beside it never meet them.
    let db = test_schema::fresh().await;
    let mut holder = db.pool.begin().await.expect("begin");
    assert!(lock_provider(&mut holder, "held", &provider(), 1_000).await.expect("lock").is_some());

    let mut other = db.pool.begin().await.expect("begin");
    // A round that went on past the lock would wait for the holder's bucket row: fail instead.
    sqlx::query("SET LOCAL lock_timeout = '2s'").execute(&mut *other).await.expect("set a lock timeout");
    assert_eq!(lock_provider(&mut other, "held", &provider(), 1_000).await.expect("try the lock"), None);
    assert!(
        lock_provider(&mut other, "free", &provider(), 1_000).await.expect("lock").is_some(),
        "another provider's lock is free"
    );
    other.rollback().await.expect("rollback");

    holder.commit().await.expect("commit");
    assert!(room(&db.pool, "held", 1_000).await.is_some(), "the lock ends with its transaction");
}

async fn turns(pool: &PgPool) -> Vec<(String, Micros)> {
    sqlx::query_as("SELECT tenant, last_granted_at_us FROM tenant_turns ORDER BY tenant")
        .fetch_all(pool)
        .await
        .expect("read the turns")
}

#[tokio::test]
async fn moved_turns_put_each_tenant_given_at_now_and_leave_the_others() {
    let db = test_schema::fresh().await;
    let mut tx = db.pool.begin().await.expect("begin");
    move_turns(&mut tx, &["a", "b"], 10).await.expect("move turns");
    move_turns(&mut tx, &["b", "c"], 20).await.expect("move turns");
    move_turns(&mut tx, &[], 30).await.expect("move no turns");
    tx.commit().await.expect("commit");
    assert_eq!(turns(&db.pool).await, [("a".into(), 10), ("b".into(), 20), ("c".into(), 20)]);
}

#[tokio::test]
async fn written_buckets_replace_the_given_providers_tokens_only() {
    let db = test_schema::fresh().await;
    for name in ["imagegen", "llm"] {
        room(&db.pool, name, 1_000).await.expect("create the bucket");
    }
    let mut tx = db.pool.begin().await.expect("begin");
    write_buckets(&mut tx, &[("imagegen", 1.25, 5_000), ("sms", 2.0, 5_000)]).await.expect("write buckets");
    write_buckets(&mut tx, &[]).await.expect("write no buckets");
    tx.commit().await.expect("commit");
    let buckets: Vec<(String, f64, Micros)> =
        sqlx::query_as("SELECT provider, tokens, refilled_at_us FROM rate_buckets ORDER BY provider")
            .fetch_all(&db.pool)
            .await
            .expect("read the buckets");
    assert_eq!(
        buckets,
        [("imagegen".into(), 1.25, 5_000), ("llm".into(), 3.0, 1_000)],
        "a provider without a bucket gets none from a write"
    );
}

/// A task of `tenant` due at `due_at_us` (never, without it), named by `label` in its kind.
async fn queue(pool: &PgPool, label: &str, tenant: &str, provider: Option<&str>, priority: i16, due_at_us: Micros) {
    sqlx::query(
        "INSERT INTO tasks (task_id, tenant, kind, input_json, priority, provider, lifecycle, state, due_at_us) \
         VALUES ($1, $2, $3, '{}', $4, $5, '{}', 'queued', $6)",
    )
    .bind(uuid::Uuid::now_v7())
    .bind(tenant)
    .bind(label)
    .bind(priority)
    .bind(provider)
    .bind(due_at_us)
    .execute(pool)
    .await
    .expect("insert a task");
}

/// The heads due at `now`, by the labels [`queue`] gave them, with their providers.
async fn labelled_heads(pool: &PgPool, now: Micros, limit: i64, excluded: &[String]) -> Vec<(String, String)> {
    let mut tx = pool.begin().await.expect("begin");
    let found = heads(&mut tx, now, limit, excluded).await.expect("read the heads");
    let mut labelled = Vec::new();
    for head in found {
        let label: String = sqlx::query_scalar("SELECT kind FROM tasks WHERE task_id = $1")
            .bind(head.task_id.as_uuid())
            .fetch_one(&mut *tx)
            .await
            .expect("read a head's label");
        labelled.push((label, head.provider));
    }
    labelled
}

#[tokio::test]
async fn heads_give_each_tenant_its_first_before_any_tenant_its_second() {
    let db = test_schema::fresh().await;
    let pool = &db.pool;
    let now = 1_000_000;
    // Tenant a: by priority, then age (a3 is high priority).
    queue(pool, "a1", "a", Some("imagegen"), 1, 100).await;
    queue(pool, "a2", "a", Some("imagegen"), 1, 200).await;
    queue(pool, "a3", "a", Some("llm"), 0, 300).await;
    queue(pool, "b1", "b", Some("llm"), 1, 50).await;
    queue(pool, "b2", "b", Some("llm"), 1, 60).await;
    queue(pool, "c1", "c", None, 1, 10).await;
    queue(pool, "c-later", "c", None, 1, now + 1).await;
    queue(pool, "d-excluded", "d", Some("sms"), 0, 10).await;
    // c was never granted, b longest ago, a most recently.
    let mut tx = pool.begin().await.expect("begin");
    move_turns(&mut tx, &["a"], 5).await.expect("move a's turn");
    move_turns(&mut tx, &["b"], 1).await.expect("move b's turn");
    tx.commit().await.expect("commit");

    let excluded = ["sms".to_owned()];
    let expected = [("c1", ""), ("b1", "llm"), ("a3", "llm"), ("b2", "llm"), ("a1", "imagegen"), ("a2", "imagegen")]
        .map(|(label, provider)| (label.to_owned(), provider.to_owned()));
    assert_eq!(labelled_heads(pool, now, 10, &excluded).await, expected);
    assert_eq!(labelled_heads(pool, now, 4, &excluded).await, expected[..4], "at most `limit`, in the same order");
}
