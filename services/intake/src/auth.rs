//! Tenants and their bearer tokens. A token is shown once when created; only its
//! sha256 is stored, so a database dump does not hand out access.

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use actix_web::{FromRequest, HttpRequest, dev::Payload, web};
use sha2::{Digest, Sha256};
use sqlx::PgPool;
use uuid::Uuid;

use crate::problem::ApiError;

/// A tenant name: lower-case letters, digits, `-` and `_`, at most 64 characters.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tenant(String);

impl Tenant {
    pub fn parse(name: &str) -> Result<Self, String> {
        let valid = !name.is_empty()
            && name.len() <= 64
            && name.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-' || c == '_');
        if valid { Ok(Self(name.to_owned())) } else { Err(format!("`{name}` is not a valid tenant name")) }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// Do not change: the stored form of a token.
fn digest(token: &str) -> Vec<u8> {
    Sha256::digest(token.as_bytes()).to_vec()
}

/// A new token: `fl_` and 32 random bytes in hex (two v4 UUIDs' worth of entropy).
fn new_token() -> String {
    format!("fl_{}{}", Uuid::new_v4().simple(), Uuid::new_v4().simple())
}

/// Creates the tenant if needed and a token for it; returns (token id, token).
pub async fn create_token(pool: &PgPool, tenant: &Tenant, label: &str) -> Result<(Uuid, String), sqlx::Error> {
    let token = new_token();
    let token_id = Uuid::now_v7();
    let mut tx = pool.begin().await?;
    sqlx::query("INSERT INTO tenants (tenant) VALUES ($1) ON CONFLICT DO NOTHING")
        .bind(tenant.as_str())
        .execute(&mut *tx)
        .await?;
    sqlx::query("INSERT INTO api_tokens (token_id, tenant, token_sha256, label) VALUES ($1, $2, $3, $4)")
        .bind(token_id)
        .bind(tenant.as_str())
        .bind(digest(&token))
        .bind(label)
        .execute(&mut *tx)
        .await?;
    tx.commit().await?;
    Ok((token_id, token))
}

/// Revokes a token; returns whether it existed and was active.
pub async fn revoke_token(pool: &PgPool, token_id: Uuid) -> Result<bool, sqlx::Error> {
    let result = sqlx::query("UPDATE api_tokens SET revoked_at = now() WHERE token_id = $1 AND revoked_at IS NULL")
        .bind(token_id)
        .execute(pool)
        .await?;
    Ok(result.rows_affected() == 1)
}

/// The bearer token of a request, if it carries one.
pub fn bearer(req: &HttpRequest) -> Option<String> {
    req.headers()
        .get("Authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(|t| t.trim().to_owned())
}

/// The tenant of an active token; `None` for an unknown or revoked one.
pub async fn tenant_of(pool: &PgPool, token: &str) -> Result<Option<Tenant>, sqlx::Error> {
    Ok(holder_of(pool, token).await?.map(|(tenant, _)| tenant))
}

/// The tenant of an active token and the token's identity (its id and label,
/// never the token); `None` for an unknown or revoked one.
async fn holder_of(pool: &PgPool, token: &str) -> Result<Option<(Tenant, String)>, sqlx::Error> {
    if token.len() > 200 {
        return Ok(None);
    }
    holder_by_digest(pool, &digest(token)).await
}

async fn holder_by_digest(pool: &PgPool, digest: &[u8]) -> Result<Option<(Tenant, String)>, sqlx::Error> {
    let found: Option<(String, Uuid, String)> =
        sqlx::query_as("SELECT tenant, token_id, label FROM api_tokens WHERE token_sha256 = $1 AND revoked_at IS NULL")
            .bind(digest)
            .fetch_optional(pool)
            .await?;
    Ok(found.and_then(|(tenant, token_id, label)| {
        let tenant = Tenant::parse(&tenant).ok()?;
        let identity = format!("tenant:{} token:{token_id} ({label})", tenant.as_str());
        Some((tenant, identity))
    }))
}

/// How long an active token's holder is remembered: a token revoked anywhere is
/// refused by every instance within this long.
pub const TOKENS_REMEMBERED_FOR: Duration = Duration::from_secs(1);

/// At most this many tokens are remembered; past it, the stale ones are forgotten.
const MOST_TOKENS_REMEMBERED: usize = 10_000;

/// The holders of active tokens looked up in the last [`TOKENS_REMEMBERED_FOR`], by
/// digest, so that a client's requests do not each cost a look-up. Unknown and
/// revoked tokens are never remembered: a token just created works at once.
#[derive(Debug, Default)]
pub struct Tokens {
    remembered: Mutex<HashMap<Vec<u8>, (Instant, Tenant, String)>>,
}

impl Tokens {
    /// As [`holder_of`], from memory when the token was found active less than
    /// [`TOKENS_REMEMBERED_FOR`] ago.
    pub async fn holder_of(&self, pool: &PgPool, token: &str) -> Result<Option<(Tenant, String)>, sqlx::Error> {
        if token.len() > 200 {
            return Ok(None);
        }
        let digest = digest(token);
        if let Some((_, tenant, identity)) =
            self.held().get(&digest).filter(|(found_at, ..)| found_at.elapsed() < TOKENS_REMEMBERED_FOR)
        {
            return Ok(Some((tenant.clone(), identity.clone())));
        }
        let found = holder_by_digest(pool, &digest).await?;
        let mut held = self.held();
        match &found {
            Some((tenant, identity)) => {
                if held.len() >= MOST_TOKENS_REMEMBERED {
                    held.retain(|_, (found_at, ..)| found_at.elapsed() < TOKENS_REMEMBERED_FOR);
                }
                held.insert(digest, (Instant::now(), tenant.clone(), identity.clone()));
            }
            None => {
                held.remove(&digest);
            }
        }
        Ok(found)
    }

    fn held(&self) -> std::sync::MutexGuard<'_, HashMap<Vec<u8>, (Instant, Tenant, String)>> {
        self.remembered.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// The tenant of the request's bearer token. Extracting it answers 401 for a missing,
/// unknown or revoked token, and 429 when the tenant is over its request rate.
#[derive(Debug, Clone)]
pub struct Caller(pub Tenant, pub TokenIdentity);

/// Which token a request came with, for the record of a person's decision:
/// `tenant:acme token:<id> (<label>)`.
#[derive(Debug, Clone)]
pub struct TokenIdentity(pub String);

impl FromRequest for Caller {
    type Error = ApiError;
    type Future = std::pin::Pin<Box<dyn Future<Output = Result<Self, Self::Error>>>>;

    fn from_request(req: &HttpRequest, _: &mut Payload) -> Self::Future {
        let token = bearer(req);
        let pool = req.app_data::<web::Data<PgPool>>().cloned();
        let admission = req.app_data::<web::Data<crate::admission::Admission>>().cloned();
        let tokens = req.app_data::<web::Data<Tokens>>().cloned();
        Box::pin(async move {
            let (Some(token), Some(pool)) = (token, pool) else {
                return Err(ApiError::Unauthorized);
            };
            let holder = match tokens {
                Some(tokens) => tokens.holder_of(pool.get_ref(), &token).await?,
                None => holder_of(pool.get_ref(), &token).await?,
            };
            let (tenant, identity) = holder.ok_or(ApiError::Unauthorized)?;
            if let Some(admission) = admission {
                admission.admit(&tenant)?;
            }
            Ok(Caller(tenant, TokenIdentity(identity)))
        })
    }
}

#[cfg(test)]
mod tests;
