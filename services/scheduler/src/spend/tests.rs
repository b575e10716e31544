//! The spend store against a schema of its own: what a tenant's calls cost adds up
//! per tenant and per UTC day, and today's total is read back.

use fenceline_domain::spend::Amount;
use fenceline_events::Timestamp;
use sqlx::PgPool;

use super::*;
use crate::test_schema;

const DAY_US: i64 = 86_400_000_000;
/// 2030-01-01T00:00:00Z, in microseconds.
const NEW_YEAR_2030_US: i64 = 1_893_456_000_000_000;

async fn days(pool: &PgPool) -> Vec<(String, String, i64)> {
    sqlx::query_as("SELECT tenant, day::text, cost_micros FROM tenant_spend ORDER BY tenant, day")
        .fetch_all(pool)
        .await
        .expect("read the spend")
}

#[tokio::test]
async fn costs_add_up_per_tenant_and_per_utc_day_whatever_the_connections_time_zone() {
    let db = test_schema::fresh().await;
    let mut tx = db.pool.begin().await.expect("begin");
    // In New York both instants fall on 2029-12-31; in UTC they are a day apart.
    sqlx::query("SET LOCAL TIME ZONE 'America/New_York'").execute(&mut *tx).await.expect("set the time zone");
    let before_midnight = Timestamp(NEW_YEAR_2030_US - 1_800_000_000);
    let after_midnight = Timestamp(NEW_YEAR_2030_US + 1_800_000_000);
    add(&mut tx, "a", before_midnight, Amount::from_micros(1_500)).await.expect("add");
    add(&mut tx, "a", after_midnight, Amount::from_micros(250)).await.expect("add");
    add(&mut tx, "a", after_midnight, Amount::from_micros(4)).await.expect("add");
    add(&mut tx, "b", after_midnight, Amount::from_micros(100)).await.expect("add");
    tx.commit().await.expect("commit");
    assert_eq!(
        days(&db.pool).await,
        [
            ("a".into(), "2029-12-31".into(), 1_500),
            ("a".into(), "2030-01-01".into(), 254),
            ("b".into(), "2030-01-01".into(), 100)
        ]
    );
}

#[tokio::test]
async fn today_is_the_tenants_total_of_today_only() {
    let db = test_schema::fresh().await;
    let mut tx = db.pool.begin().await.expect("begin");
    let now: i64 = sqlx::query_scalar("SELECT now_us()").fetch_one(&mut *tx).await.expect("the database's clock");
    // Far enough from midnight either way that the day is today's by the database's clock.
    let noon = Timestamp(now - now.rem_euclid(DAY_US) + DAY_US / 2);
    add(&mut tx, "a", Timestamp(noon.0 - DAY_US), Amount::from_micros(9_000)).await.expect("add yesterday's");
    add(&mut tx, "a", noon, Amount::from_micros(700)).await.expect("add");
    add(&mut tx, "a", noon, Amount::from_micros(300)).await.expect("add");
    add(&mut tx, "a", Timestamp(noon.0 + DAY_US), Amount::from_micros(40_000)).await.expect("add tomorrow's");
    add(&mut tx, "b", noon, Amount::from_micros(5)).await.expect("add");
    assert_eq!(today(&mut tx, "a").await.expect("today"), Amount::from_micros(1_000));
    assert_eq!(today(&mut tx, "nobody").await.expect("today"), Amount::from_micros(0));
    tx.commit().await.expect("commit");
}
