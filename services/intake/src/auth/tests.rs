//! Tenants and their tokens: names are plain, tokens long and random and stored
//! as their digest; against a schema of its own, a created token finds its tenant,
//! a revoked or unknown one finds nobody, and revoking touches only that token.

use super::*;

#[test]
fn tenant_names_are_plain() {
    assert!(Tenant::parse("acme-shop_2").is_ok());
    for bad in ["", "Acme", "a b", "a/b", &"x".repeat(65)] {
        assert!(Tenant::parse(bad).is_err(), "{bad}");
    }
}

#[test]
fn tokens_are_long_random_and_stored_as_their_digest() {
    let (a, b) = (new_token(), new_token());
    assert_ne!(a, b);
    assert_eq!(a.len(), 3 + 64);
    // Do not change: pins the stored form.
    assert_eq!(hex::encode(digest("fl_test")), "84bd166d6d75b8b374609533ebedc30b8353771bea01ab5f6ab8f116ae5ef059");
}

/// A new schema holding the bus tables and intake's.
async fn fresh_schema() -> PgPool {
    fenceline_store::fresh_test_schema(crate::NAME, &[&fenceline_bus::MIGRATOR, &crate::MIGRATOR]).await.pool
}

fn tenant(name: &str) -> Tenant {
    Tenant::parse(name).expect("a tenant name")
}

#[tokio::test]
async fn a_created_token_finds_its_tenant_and_only_its_digest_is_stored() {
    let pool = fresh_schema().await;
    let (first_id, first) = create_token(&pool, &tenant("acme"), "ci").await.expect("create");
    let (second_id, second) = create_token(&pool, &tenant("acme"), "laptop").await.expect("create another");
    let (_, other) = create_token(&pool, &tenant("globex"), "ci").await.expect("create for another tenant");
    assert_ne!(first, second);

    assert_eq!(tenant_of(&pool, &first).await.expect("look up"), Some(tenant("acme")));
    assert_eq!(tenant_of(&pool, &second).await.expect("look up"), Some(tenant("acme")));
    assert_eq!(tenant_of(&pool, &other).await.expect("look up"), Some(tenant("globex")));
    let (found, identity) = holder_of(&pool, &first).await.expect("look up").expect("a holder");
    assert_eq!((found, identity), (tenant("acme"), format!("tenant:acme token:{first_id} (ci)")));

    let tenants: Vec<String> =
        sqlx::query_scalar("SELECT tenant FROM tenants ORDER BY tenant").fetch_all(&pool).await.expect("tenants");
    assert_eq!(tenants, ["acme", "globex"], "a tenant is created once, with its first token");
    let stored: (String, Vec<u8>, String) =
        sqlx::query_as("SELECT tenant, token_sha256, label FROM api_tokens WHERE token_id = $1")
            .bind(second_id)
            .fetch_one(&pool)
            .await
            .expect("the stored token");
    assert_eq!(stored, ("acme".to_owned(), digest(&second), "laptop".to_owned()));
    let holding_the_token: i64 =
        sqlx::query_scalar("SELECT count(*) FROM api_tokens WHERE position($1 IN (api_tokens::text)) > 0")
            .bind(&second)
            .fetch_one(&pool)
            .await
            .expect("search the tokens");
    assert_eq!(holding_the_token, 0, "the token itself is stored nowhere");
}

#[tokio::test]
async fn a_revoked_or_unknown_token_finds_nobody_and_revoking_touches_only_that_token() {
    let pool = fresh_schema().await;
    let (revoked_id, revoked) = create_token(&pool, &tenant("acme"), "old").await.expect("create");
    let (_, kept) = create_token(&pool, &tenant("acme"), "new").await.expect("create another");

    assert!(revoke_token(&pool, revoked_id).await.expect("revoke"), "an active token is revoked");
    assert_eq!(tenant_of(&pool, &revoked).await.expect("look up"), None);
    assert_eq!(tenant_of(&pool, &kept).await.expect("look up"), Some(tenant("acme")));
    assert!(!revoke_token(&pool, revoked_id).await.expect("revoke again"), "revoked already");
    assert!(!revoke_token(&pool, Uuid::now_v7()).await.expect("revoke"), "no such token");

    assert_eq!(tenant_of(&pool, "fl_not_a_token").await.expect("look up"), None);
    assert_eq!(tenant_of(&pool, "").await.expect("look up"), None);
    assert_eq!(tenant_of(&pool, &format!("{kept}{}", "0".repeat(200))).await.expect("look up"), None, "too long");
}

#[tokio::test]
async fn a_remembered_token_is_refused_within_a_second_of_its_revocation_and_a_new_one_works_at_once() {
    let pool = fresh_schema().await;
    let tokens = Tokens::default();
    let (token_id, token) = create_token(&pool, &tenant("acme"), "ci").await.expect("create");
    let tenant_by_cache = async |token: &str| tokens.holder_of(&pool, token).await.expect("look up").map(|(t, _)| t);

    assert_eq!(tenant_by_cache(&token).await, Some(tenant("acme")));
    assert!(revoke_token(&pool, token_id).await.expect("revoke"));
    assert_eq!(tenant_by_cache(&token).await, Some(tenant("acme")), "remembered for a moment after it was found");
    tokio::time::sleep(TOKENS_REMEMBERED_FOR + Duration::from_millis(50)).await;
    assert_eq!(tenant_by_cache(&token).await, None, "refused once the moment has passed");
    assert_eq!(tenant_by_cache(&token).await, None, "and a refusal is not remembered as a holder");

    // An unknown token is not remembered as unknown: created afterwards, it works at once.
    let unknown = "fl_created_later";
    assert_eq!(tenant_by_cache(unknown).await, None);
    sqlx::query("INSERT INTO api_tokens (token_id, tenant, token_sha256, label) VALUES ($1, 'acme', $2, 'later')")
        .bind(Uuid::now_v7())
        .bind(digest(unknown))
        .execute(&pool)
        .await
        .expect("create the token");
    assert_eq!(tenant_by_cache(unknown).await, Some(tenant("acme")));
}
