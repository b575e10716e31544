//! Signed webhooks that submit tasks: each delivery becomes a task once, and a bad,
//! stale or replayed signature creates none.

use fenceline_intake::auth::Tenant;
use serde_json::{Value, json};

use crate::intake_fixture::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn signed_webhooks_become_tasks_once_and_bad_or_stale_signatures_are_refused() {
    use fenceline_intake::webhooks::add_secret;
    let intake = start_intake().await;
    let tenant = Tenant::parse("acme").expect("tenant");
    let (_, old) = add_secret(&intake.pool, "helpdesk", &tenant, "ticket.triage", None).await.expect("secret");
    let (_, new) = add_secret(&intake.pool, "helpdesk", &tenant, "ticket.triage", None).await.expect("rotated");
    let now = time::OffsetDateTime::now_utc().unix_timestamp();
    let body = json!({"ticket": 81723, "subject": "refund please"}).to_string();

    let first = deliver(&intake, "helpdesk", "evt-1", now, &sign(&old, now, "evt-1", &body), &body).await;
    assert_eq!(first.status, 202, "{:?}", first.body);
    // The sender retries after 5 seconds, now signing with the new secret.
    let resent = deliver(&intake, "helpdesk", "evt-1", now, &sign(&new, now, "evt-1", &body), &body).await;
    assert_eq!((resent.status, resent.replayed), (202, true));
    assert_eq!(resent.body["task_id"], first.body["task_id"], "deduplicated by the source's event id");

    let tampered = deliver(&intake, "helpdesk", "evt-2", now, &sign(&new, now, "evt-2", "{}"), &body).await;
    let stale = deliver(&intake, "helpdesk", "evt-3", now - 600, &sign(&new, now - 600, "evt-3", &body), &body).await;
    let unknown = deliver(&intake, "nobody", "evt-4", now, &sign(&new, now, "evt-4", &body), &body).await;
    for refused in [&tampered, &stale, &unknown] {
        assert_eq!((refused.status, refused.body["type"].as_str()), (401, Some("/problems/bad-signature")));
    }
    // A third secret retires the oldest.
    add_secret(&intake.pool, "helpdesk", &tenant, "ticket.triage", None).await.expect("third");
    let retired = deliver(&intake, "helpdesk", "evt-5", now, &sign(&old, now, "evt-5", &body), &body).await;
    assert_eq!(retired.status, 401, "the oldest secret was retired");

    assert_eq!(task_rows(&intake.pool).await, 1);
    let kind: String = sqlx::query_scalar("SELECT kind FROM tasks").fetch_one(&intake.pool).await.expect("kind");
    assert_eq!(kind, "ticket.triage", "mapped to the source's kind");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_api_key_spelled_like_a_webhooks_key_is_its_own_submission() {
    let intake = start_intake().await;
    let tenant = Tenant::parse("acme").expect("tenant");
    let (_, secret) = fenceline_intake::webhooks::add_secret(&intake.pool, "helpdesk", &tenant, "ticket.triage", None)
        .await
        .expect("secret");
    let now = time::OffsetDateTime::now_utc().unix_timestamp();
    let body = json!({"ticket": 1}).to_string();
    let hook = deliver(&intake, "helpdesk", "evt-1", now, &sign(&secret, now, "evt-1", &body), &body).await;
    assert_eq!(hook.status, 202, "{:?}", hook.body);

    // The webhook's key is `webhook:helpdesk:evt-1` in acme; an API client picks the same text.
    let url = format!("{}/v1/tasks", intake.base);
    let key = Some("webhook:helpdesk:evt-1");
    let api = call("POST", url.clone(), Some(intake.acme.clone()), key, Some(image("red shoe"))).await;
    assert_eq!((api.status, api.replayed), (202, false), "neither a replay of the webhook's task nor a 422: {api:?}");
    assert_ne!(api.body["task_id"], hook.body["task_id"]);
    let again = call("POST", url, Some(intake.acme.clone()), key, Some(image("red shoe"))).await;
    assert_eq!((again.status, again.replayed, &again.body["task_id"]), (202, true, &api.body["task_id"]));
    let resent = deliver(&intake, "helpdesk", "evt-1", now, &sign(&secret, now, "evt-1", &body), &body).await;
    assert_eq!((resent.replayed, &resent.body["task_id"]), (true, &hook.body["task_id"]), "the webhook's own replay");
    assert_eq!(task_rows(&intake.pool).await, 2);
}

/// HMAC-SHA256 (RFC 2104) on Postgres's `sha256`, for signing the way old senders did.
async fn hmac_sha256(pool: &sqlx::PgPool, key: &[u8], message: String) -> Vec<u8> {
    async fn sha256(pool: &sqlx::PgPool, bytes: Vec<u8>) -> Vec<u8> {
        sqlx::query_scalar("SELECT sha256($1)").bind(bytes).fetch_one(pool).await.expect("sha256")
    }
    let mut block = if key.len() > 64 { sha256(pool, key.to_vec()).await } else { key.to_vec() };
    block.resize(64, 0);
    let pad = |byte: u8| block.iter().map(|k| k ^ byte).collect::<Vec<u8>>();
    let inner = sha256(pool, [pad(0x36), message.into_bytes()].concat()).await;
    sha256(pool, [pad(0x5c), inner].concat()).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_captured_delivery_replayed_under_a_new_event_id_or_signed_the_old_way_creates_no_task() {
    let intake = start_intake().await;
    let tenant = Tenant::parse("acme").expect("tenant");
    let (_, secret) = fenceline_intake::webhooks::add_secret(&intake.pool, "helpdesk", &tenant, "ticket.triage", None)
        .await
        .expect("s");
    let now = time::OffsetDateTime::now_utc().unix_timestamp();
    let body = json!({"ticket": 81723, "subject": "refund please"}).to_string();
    let captured = sign(&secret, now, "evt-1", &body);
    let first = deliver(&intake, "helpdesk", "evt-1", now, &captured, &body).await;
    assert_eq!(first.status, 202, "{:?}", first.body);

    // Someone who saw that delivery sends it again inside the window, with a fresh id.
    let replayed = deliver(&intake, "helpdesk", "evt-1-again", now, &captured, &body).await;
    assert_eq!((replayed.status, replayed.body["type"].as_str()), (401, Some("/problems/bad-signature")));
    // A sender still on the old scheme (HMAC of "timestamp.body", v1) is refused, saying why.
    let pinned = hmac_sha256(&intake.pool, b"secret", "1700000000.{}".into()).await;
    assert_eq!(
        hex::encode(pinned),
        "b8569b78799ff9e3cbff0fc2d63a33a2b57f3282abd07c37ae5e8e7d79a5f163",
        "the old formula"
    );
    let old =
        format!("v1={}", hex::encode(hmac_sha256(&intake.pool, secret.as_bytes(), format!("{now}.{body}")).await));
    let old_style = deliver(&intake, "helpdesk", "evt-2", now, &old, &body).await;
    assert_eq!((old_style.status, old_style.body["type"].as_str()), (401, Some("/problems/bad-signature")));
    assert!(old_style.body["detail"].as_str().unwrap_or_default().contains("v1"), "{:?}", old_style.body);
    // An event id the signed text cannot carry unambiguously is refused too.
    let dotted = deliver(&intake, "helpdesk", "evt.3", now, &captured, &body).await;
    assert_eq!(dotted.status, 401);

    assert_eq!(task_rows(&intake.pool).await, 1, "only the original delivery became a task");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_source_that_dedupes_by_ticket_id_makes_one_task_however_many_event_ids_its_retries_carry() {
    let intake = start_intake().await;
    let tenant = Tenant::parse("acme").expect("tenant");
    let (_, secret) = fenceline_intake::webhooks::add_secret(&intake.pool, "helpdesk", &tenant, "ticket.triage", None)
        .await
        .expect("s");
    let set = fenceline_intake::webhooks::set_dedupe_field(&intake.pool, "helpdesk", Some("/ticket/id"));
    assert!(set.await.expect("dedupe field"), "the source exists");
    let now = time::OffsetDateTime::now_utc().unix_timestamp();
    let body =
        |id: Value, note: &str| json!({"ticket": {"id": id, "subject": "refund please"}, "note": note}).to_string();

    // The helpdesk gives each delivery attempt its own event id, each signed.
    let first_body = body(json!(81723), "first try");
    let first =
        deliver(&intake, "helpdesk", "try-1", now, &sign(&secret, now, "try-1", &first_body), &first_body).await;
    assert_eq!((first.status, first.replayed), (202, false), "{:?}", first.body);
    let retry_body = body(json!(81723), "first try");
    let retry =
        deliver(&intake, "helpdesk", "try-2", now, &sign(&secret, now, "try-2", &retry_body), &retry_body).await;
    assert_eq!((retry.status, retry.replayed, &retry.body["task_id"]), (202, true, &first.body["task_id"]));
    // The same ticket with another body is the reuse of a key, not a new task.
    let changed = body(json!(81723), "edited");
    let reused = deliver(&intake, "helpdesk", "try-3", now, &sign(&secret, now, "try-3", &changed), &changed).await;
    assert_eq!(reused.status, 422, "{:?}", reused.body);
    // Another ticket is another task; a body without the field is refused, saying why.
    let other = body(json!("81724"), "first try");
    let second = deliver(&intake, "helpdesk", "try-4", now, &sign(&secret, now, "try-4", &other), &other).await;
    assert_eq!((second.status, second.replayed), (202, false), "{:?}", second.body);
    let bare = json!({"subject": "no ticket"}).to_string();
    let refused = deliver(&intake, "helpdesk", "try-5", now, &sign(&secret, now, "try-5", &bare), &bare).await;
    assert_eq!(refused.status, 400, "{:?}", refused.body);
    assert!(refused.body["detail"].as_str().unwrap_or_default().contains("/ticket/id"), "{:?}", refused.body);
    assert_eq!(task_rows(&intake.pool).await, 2);
}
