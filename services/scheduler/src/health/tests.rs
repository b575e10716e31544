//! The providers' adaptive limits against a schema of its own: trouble at the
//! provider whose slot a grant holds lowers its shared limit (once per decrease
//! interval), and an outcome that changes nothing writes nothing: a healthy
//! provider at its ceiling, a grant whose slot is gone, a provider whose limit
//! does not adapt.

use fenceline_domain::limits::Trouble;
use sqlx::PgPool;

use super::*;
use crate::test_schema;

/// `img` adapts (concurrency 8, halved on trouble at most once a second); `fixed` does not.
fn catalog() -> Catalog {
    Catalog::parse(
        r#"{
        "providers": {"img": {"base_url": "http://x", "call_timeout_ms": 1000, "concurrency": 8,
                              "rate_per_second": 5, "burst": 5},
                      "fixed": {"base_url": "http://y", "call_timeout_ms": 1000, "concurrency": 8,
                                "rate_per_second": 5, "burst": 5, "adaptive_concurrency": {"enabled": false}}},
        "kinds": {"image.generate": {"steps": [{"name": "render", "provider": "img"}], "attempt_budget_ms": 5000}}
    }"#,
    )
    .expect("a valid catalogue")
}

fn policy(catalog: &Catalog) -> AdaptivePolicy {
    catalog.provider("img").and_then(|p| p.adaptive_policy()).expect("img adapts")
}

async fn slot_at(pool: &PgPool, provider: &str) -> GrantId {
    let grant_id = GrantId::from_uuid(uuid::Uuid::now_v7());
    sqlx::query(
        "INSERT INTO slots (grant_id, task_id, provider, tenant, kind, expires_at_us) \
         VALUES ($1, $2, $3, 'acme', 'image.generate', now_us() + 60000000)",
    )
    .bind(grant_id.as_uuid())
    .bind(uuid::Uuid::now_v7())
    .bind(provider)
    .execute(pool)
    .await
    .expect("insert a slot");
    grant_id
}

async fn observe_one(pool: &PgPool, catalog: &Catalog, grant_id: GrantId, health: Health, now: Micros) {
    let mut tx = pool.begin().await.expect("begin");
    observe_all(&mut tx, catalog, &[Outcome { grant_id, health, at: now }]).await.expect("observe");
    tx.commit().await.expect("commit");
}

/// Every stored limit, by provider.
async fn stored(pool: &PgPool) -> Vec<(String, AdaptiveLimit)> {
    let rows: Vec<(String, Json<AdaptiveLimit>)> =
        sqlx::query_as("SELECT provider, state FROM provider_limits ORDER BY provider")
            .fetch_all(pool)
            .await
            .expect("read the limits");
    rows.into_iter().map(|(provider, state)| (provider, state.0)).collect()
}

async fn read_now(pool: &PgPool, provider: &str, policy: &AdaptivePolicy) -> AdaptiveLimit {
    let mut tx = pool.begin().await.expect("begin");
    let limit = read(&mut tx, provider, policy).await.expect("read");
    tx.commit().await.expect("commit");
    limit
}

#[tokio::test]
async fn trouble_lowers_the_providers_shared_limit_once_per_interval() {
    let db = test_schema::fresh().await;
    let catalog = catalog();
    let policy = policy(&catalog);
    let grant_id = slot_at(&db.pool, "img").await;
    let t = 1_000_000_000;

    observe_one(&db.pool, &catalog, grant_id, Health::Trouble(Trouble::Throttled), t).await;
    let halved = AdaptiveLimit { limit: 4.0, reduced_after: Some(Trouble::Throttled), decreased_at: Some(t) };
    assert_eq!(stored(&db.pool).await, vec![("img".to_owned(), halved)]);
    assert_eq!(read_now(&db.pool, "img", &policy).await.slots(&policy), 4);

    // Within the decrease interval another timeout changes nothing.
    observe_one(&db.pool, &catalog, grant_id, Health::Trouble(Trouble::Timeouts), t + 500_000).await;
    assert_eq!(stored(&db.pool).await, vec![("img".to_owned(), halved)]);

    let later = t + policy.decrease_interval;
    observe_one(&db.pool, &catalog, grant_id, Health::Trouble(Trouble::Timeouts), later).await;
    let again = AdaptiveLimit { limit: 2.0, reduced_after: Some(Trouble::Timeouts), decreased_at: Some(later) };
    assert_eq!(stored(&db.pool).await, vec![("img".to_owned(), again)]);

    // Successes raise it again, a little at a time.
    observe_one(&db.pool, &catalog, grant_id, Health::Healthy, later + 1).await;
    let [(_, raised)] = stored(&db.pool).await[..] else { panic!("one provider's limit") };
    assert!(raised.limit > 2.0 && raised.limit < 8.0, "{raised:?}");
    assert_eq!(raised.reduced_after, Some(Trouble::Timeouts), "still below its ceiling");
}

#[tokio::test]
async fn an_outcome_that_says_nothing_new_writes_nothing() {
    let db = test_schema::fresh().await;
    let catalog = catalog();
    let policy = policy(&catalog);
    let at_img = slot_at(&db.pool, "img").await;
    let at_fixed = slot_at(&db.pool, "fixed").await;

    observe_one(&db.pool, &catalog, at_img, Health::Healthy, 1).await;
    observe_one(&db.pool, &catalog, at_img, Health::Neutral, 2).await;
    // A grant whose slot is gone (a stale or repeated outcome) says nothing.
    let released = GrantId::from_uuid(uuid::Uuid::now_v7());
    observe_one(&db.pool, &catalog, released, Health::Trouble(Trouble::ServerErrors), 3).await;
    // A provider whose limit does not adapt has none to lower.
    observe_one(&db.pool, &catalog, at_fixed, Health::Trouble(Trouble::ServerErrors), 4).await;

    assert!(stored(&db.pool).await.is_empty(), "no limit was stored");
    assert_eq!(read_now(&db.pool, "img", &policy).await, AdaptiveLimit::full(&policy));
    assert_eq!(read_now(&db.pool, "img", &policy).await.slots(&policy), 8);
}

/// A batch's outcomes are taken together, in their order, as one at a time would
/// have moved the limit: its stale ones (no slot) and those of a provider that does
/// not adapt say nothing.
#[tokio::test]
async fn a_batchs_outcomes_move_each_limit_in_their_order_as_one_at_a_time_would() {
    let db = test_schema::fresh().await;
    let catalog = catalog();
    let policy = policy(&catalog);
    let (first, second) = (slot_at(&db.pool, "img").await, slot_at(&db.pool, "img").await);
    let at_fixed = slot_at(&db.pool, "fixed").await;
    let gone = GrantId::from_uuid(uuid::Uuid::now_v7());
    let t = 1_000_000_000;
    let later = t + policy.decrease_interval;
    let heard = [
        Outcome { grant_id: first, health: Health::Trouble(Trouble::Throttled), at: t },
        Outcome { grant_id: gone, health: Health::Trouble(Trouble::ServerErrors), at: t + 1 },
        Outcome { grant_id: at_fixed, health: Health::Trouble(Trouble::ServerErrors), at: t + 2 },
        Outcome { grant_id: second, health: Health::Trouble(Trouble::Timeouts), at: t + 500_000 },
        Outcome { grant_id: second, health: Health::Trouble(Trouble::Timeouts), at: later },
        Outcome { grant_id: first, health: Health::Healthy, at: later + 1 },
    ];
    let mut tx = db.pool.begin().await.expect("begin");
    observe_all(&mut tx, &catalog, &heard).await.expect("observe the batch");
    tx.commit().await.expect("commit");

    // One at a time: halved, cooling, halved again, raised a little.
    let expected = [(Trouble::Throttled, t), (Trouble::Timeouts, t + 500_000), (Trouble::Timeouts, later)]
        .into_iter()
        .fold(AdaptiveLimit::full(&policy), |limit, (trouble, at)| {
            limit.observe(Health::Trouble(trouble), at, &policy).0
        })
        .observe(Health::Healthy, later + 1, &policy)
        .0;
    assert_eq!(stored(&db.pool).await, vec![("img".to_owned(), expected)], "only img's limit, moved in order");
    assert!(expected.limit > 2.0 && expected.limit < 8.0, "halved twice, then raised: {expected:?}");

    // A batch that moves nothing writes nothing, not even a row for a limit never moved.
    let mut tx = db.pool.begin().await.expect("begin");
    let healthy = Outcome { grant_id: at_fixed, health: Health::Healthy, at: later + 2 };
    observe_all(&mut tx, &catalog, &[healthy, Outcome { grant_id: gone, ..healthy }]).await.expect("observe");
    tx.commit().await.expect("commit");
    assert_eq!(stored(&db.pool).await, vec![("img".to_owned(), expected)]);
}
