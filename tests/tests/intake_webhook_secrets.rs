//! Webhook signing secrets at rest: sealed with the configured keys, sealed again
//! after a rotation, and never opened in another row or without the key.

use fenceline_intake::auth::Tenant;
use serde_json::json;

use crate::intake_fixture::*;

/// Two webhook sealing keys (64 hex digits each), and the text of each.
const SEALING_KEY_A: &str = "5e1f0c2a9d8b7e6f5a4b3c2d1e0f9a8b7c6d5e4f3a2b1c0d9e8f7a6b5c4d3e2f";
const SEALING_KEY_B: &str = "b7c1e2d3f4a5968778695a4b3c2d1e0ff0e1d2c3b4a5968778695a4b3c2d1e0f";

fn sealing_keys(text: &str) -> fenceline_intake::sealing::SealingKeys {
    fenceline_intake::sealing::SealingKeys::parse(&text.to_owned().into()).expect("sealing keys")
}

async fn start_intake_sealing_with(keys: &str) -> Intake {
    start_intake_with(&[], vec!["image.generate".into(), "ticket.triage".into()], |config| {
        config.intake.webhook_sealing_keys = Some(keys.to_owned().into());
    })
    .await
}

/// Each row of `webhook_secrets`: (secret id, source, clear secret, sealed bytes, key id).
type SecretRow = (uuid::Uuid, String, Option<String>, Option<Vec<u8>>, Option<String>);

async fn secret_rows(pool: &sqlx::PgPool) -> Vec<SecretRow> {
    sqlx::query_as(
        "SELECT secret_id, source, secret, sealed_secret, sealing_key_id FROM webhook_secrets ORDER BY created_at, secret_id",
    )
    .fetch_all(pool)
    .await
    .expect("secret rows")
}

/// Asserts that no row holds `secret` in clear, neither in `secret` nor inside the
/// sealed bytes, and that each is sealed with `key_id`.
async fn assert_sealed_only(pool: &sqlx::PgPool, secret: &str, key_id: &str) {
    let rows = secret_rows(pool).await;
    assert!(!rows.is_empty());
    for (id, _, clear, sealed, sealed_with) in rows {
        assert_eq!(clear, None, "row {id} holds no clear secret");
        let sealed = sealed.expect("sealed");
        assert!(!sealed.windows(secret.len()).any(|w| w == secret.as_bytes()), "row {id} holds the secret's bytes");
        assert_eq!(sealed_with.as_deref(), Some(key_id), "row {id}");
    }
}

/// Delivers one signed body to `source`; its status.
async fn deliver_signed(intake: &Intake, source: &str, secret: &str, event_id: &str) -> u16 {
    let now = time::OffsetDateTime::now_utc().unix_timestamp();
    let body = json!({"ticket": event_id}).to_string();
    deliver(intake, source, event_id, now, &sign(secret, now, event_id, &body), &body).await.status
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_sealing_keys_a_new_webhook_secret_is_stored_sealed_only_and_verifies() {
    let intake = start_intake_sealing_with(SEALING_KEY_A).await;
    let keys = sealing_keys(SEALING_KEY_A);
    let tenant = Tenant::parse("acme").expect("tenant");
    let add = fenceline_intake::webhooks::add_secret(&intake.pool, "helpdesk", &tenant, "ticket.triage", Some(&keys));
    let (_, secret) = add.await.expect("secret");
    assert_sealed_only(&intake.pool, &secret, keys.sealing_id()).await;
    assert_eq!(deliver_signed(&intake, "helpdesk", &secret, "evt-1").await, 202);
    assert_eq!(deliver_signed(&intake, "helpdesk", "whsec_guessed", "evt-2").await, 401);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secrets_stored_in_clear_are_sealed_at_the_next_start_with_keys_and_still_verify() {
    let clear = start_intake().await;
    let tenant = Tenant::parse("acme").expect("tenant");
    let mut secrets = Vec::new();
    for source in ["helpdesk", "helpdesk", "billing"] {
        let add = fenceline_intake::webhooks::add_secret(&clear.pool, source, &tenant, "ticket.triage", None);
        secrets.push((source, add.await.expect("secret").1));
    }
    assert!(secret_rows(&clear.pool).await.iter().all(|row| row.2.is_some()), "without keys, in clear");

    let sealed = restart_intake(&clear, Some(SEALING_KEY_A)).await.expect("starts with keys");
    drop(clear);
    for (_, secret) in &secrets {
        assert_sealed_only(&sealed.pool, secret, sealing_keys(SEALING_KEY_A).sealing_id()).await;
    }
    for (n, (source, secret)) in secrets.iter().enumerate() {
        assert_eq!(deliver_signed(&sealed, source, secret, &format!("evt-{n}")).await, 202, "{source}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sealed_secret_copied_into_another_row_does_not_open() {
    let intake = start_intake_sealing_with(SEALING_KEY_A).await;
    let keys = sealing_keys(SEALING_KEY_A);
    let tenant = Tenant::parse("acme").expect("tenant");
    let webhooks = |source: &'static str| {
        fenceline_intake::webhooks::add_secret(&intake.pool, source, &tenant, "ticket.triage", Some(&keys))
    };
    let (helpdesk_id, helpdesk) = webhooks("helpdesk").await.expect("secret");
    let (_, billing) = webhooks("billing").await.expect("secret");
    // Someone with write access to the table puts helpdesk's sealed secret in billing's row.
    let moved = sqlx::query(
        "UPDATE webhook_secrets SET sealed_secret = (SELECT sealed_secret FROM webhook_secrets WHERE secret_id = $1) \
         WHERE source = 'billing'",
    )
    .bind(helpdesk_id)
    .execute(&intake.pool)
    .await
    .expect("moved");
    assert_eq!(moved.rows_affected(), 1);
    assert_eq!(deliver_signed(&intake, "billing", &helpdesk, "evt-1").await, 401, "the moved value does not open");
    assert_eq!(deliver_signed(&intake, "billing", &billing, "evt-2").await, 401, "billing's own secret is gone");
    assert_eq!(deliver_signed(&intake, "helpdesk", &helpdesk, "evt-3").await, 202, "in its own row it opens");
    assert_eq!(task_rows(&intake.pool).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_start_with_sealed_secrets_and_no_key_or_another_key_is_refused_without_printing_a_key() {
    let intake = start_intake_sealing_with(SEALING_KEY_A).await;
    let tenant = Tenant::parse("acme").expect("tenant");
    let keys = sealing_keys(SEALING_KEY_A);
    let add = fenceline_intake::webhooks::add_secret(&intake.pool, "helpdesk", &tenant, "ticket.triage", Some(&keys));
    add.await.expect("secret");

    let refusal = |started: Result<Intake, fenceline_runtime::Error>| match started {
        Ok(_) => panic!("intake started with sealed secrets it cannot open"),
        Err(e) => e.to_string(),
    };
    let without = refusal(restart_intake(&intake, None).await);
    assert!(without.contains("1 sealed webhook secrets but no sealing key is configured"), "{without}");
    let other = refusal(restart_intake(&intake, Some(SEALING_KEY_B)).await);
    assert!(other.contains(&format!("sealed with key ids {} that are not configured", keys.sealing_id())), "{other}");
    let malformed = refusal(restart_intake(&intake, Some(&SEALING_KEY_B[..63])).await);
    assert!(malformed.contains("sealing key 1 is 63 characters long"), "{malformed}");
    for message in [&without, &other, &malformed] {
        for key in [SEALING_KEY_A, SEALING_KEY_B] {
            assert!(!message.to_lowercase().contains(&key[..12]), "{message}");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_secret_sealed_with_the_old_key_opens_after_rotation_and_is_sealed_again_with_the_new_one() {
    let old = start_intake_sealing_with(SEALING_KEY_A).await;
    let tenant = Tenant::parse("acme").expect("tenant");
    let keys = sealing_keys(SEALING_KEY_A);
    let add = fenceline_intake::webhooks::add_secret(&old.pool, "helpdesk", &tenant, "ticket.triage", Some(&keys));
    let (_, secret) = add.await.expect("secret");
    let before = secret_rows(&old.pool).await;

    // The new key first, the old one second: the row opens, and the start seals it again.
    let rotated = restart_intake(&old, Some(&format!("{SEALING_KEY_B},{SEALING_KEY_A}"))).await.expect("rotated");
    drop(old);
    let new_id = sealing_keys(SEALING_KEY_B).sealing_id().to_owned();
    assert_sealed_only(&rotated.pool, &secret, &new_id).await;
    assert_ne!(secret_rows(&rotated.pool).await[0].3, before[0].3, "sealed anew");
    assert_eq!(deliver_signed(&rotated, "helpdesk", &secret, "evt-1").await, 202);

    // Every row is sealed with the new key now: the old key may go.
    let only_new = restart_intake(&rotated, Some(SEALING_KEY_B)).await.expect("the old key is no longer needed");
    drop(rotated);
    assert_eq!(deliver_signed(&only_new, "helpdesk", &secret, "evt-2").await, 202);
}
