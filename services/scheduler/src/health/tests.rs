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
    observe(&mut tx, catalog, grant_id, health, now).await.expect("observe");
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
