//! Signed webhooks: `POST /v1/webhooks/{source}`. The sender signs
//! `"{timestamp}.{body}"` with HMAC-SHA256 under one of the source's secrets and
//! sends `Fenceline-Timestamp` (Unix seconds), `Fenceline-Signature`
//! (`v1=<hex>`, several comma-separated during a rotation) and `Fenceline-Event-Id`
//! (its own id of the delivery). A verified delivery becomes a task of the source's
//! kind, deduplicated by the event id, and is answered at once.

use hmac::{Hmac, Mac};
use sha2::Sha256;
use sqlx::PgPool;
use uuid::Uuid;

use crate::auth::Tenant;

/// Do not change: the header names and the signed text are the senders' contract.
pub mod headers {
    pub const TIMESTAMP: &str = "Fenceline-Timestamp";
    pub const SIGNATURE: &str = "Fenceline-Signature";
    pub const EVENT_ID: &str = "Fenceline-Event-Id";
}

/// Why a delivery was refused. Each answers 401, with this as the detail.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SignatureError {
    #[error("the {0} header is missing")]
    Missing(&'static str),
    #[error("the timestamp is not Unix seconds")]
    BadTimestamp,
    #[error("the timestamp is {0} s away from now, beyond the tolerance")]
    Stale(i64),
    #[error("no signature matches an active secret of this source")]
    NoMatch,
}

/// Checks a delivery: the timestamp within `tolerance_s` of `now_s`, and one of the
/// `v1=` signatures an HMAC-SHA256 of `"{timestamp}.{body}"` under one of `secrets`,
/// compared in constant time.
pub fn verify(
    secrets: &[Vec<u8>],
    timestamp: Option<&str>,
    signature: Option<&str>,
    body: &[u8],
    now_s: i64,
    tolerance_s: i64,
) -> Result<(), SignatureError> {
    let timestamp = timestamp.ok_or(SignatureError::Missing(headers::TIMESTAMP))?;
    let signature = signature.ok_or(SignatureError::Missing(headers::SIGNATURE))?;
    let sent: i64 = timestamp.trim().parse().map_err(|_| SignatureError::BadTimestamp)?;
    let skew = now_s - sent;
    if skew.abs() > tolerance_s {
        return Err(SignatureError::Stale(skew));
    }
    let candidates: Vec<Vec<u8>> = signature
        .split(',')
        .filter_map(|part| part.trim().strip_prefix("v1="))
        .filter_map(|hex_sig| hex::decode(hex_sig).ok())
        .collect();
    for secret in secrets {
        for candidate in &candidates {
            let Ok(mut mac) = Hmac::<Sha256>::new_from_slice(secret) else { continue };
            mac.update(timestamp.trim().as_bytes());
            mac.update(b".");
            mac.update(body);
            if mac.verify_slice(candidate).is_ok() {
                return Ok(());
            }
        }
    }
    Err(SignatureError::NoMatch)
}

/// The `v1=` signature a sender computes; for senders' libraries and tests.
pub fn sign(secret: &[u8], timestamp: i64, body: &[u8]) -> String {
    // HMAC accepts keys of any length.
    let mut mac = Hmac::<Sha256>::new_from_slice(secret).unwrap_or_else(|_| unreachable!("any key length"));
    mac.update(timestamp.to_string().as_bytes());
    mac.update(b".");
    mac.update(body);
    format!("v1={}", hex::encode(mac.finalize().into_bytes()))
}

/// A configured source: where its deliveries go and its active secrets.
#[derive(Debug, Clone)]
pub struct Source {
    pub tenant: Tenant,
    pub kind: String,
    pub secrets: Vec<Vec<u8>>,
}

/// Looks a source up with its active secrets; `None` if unknown.
pub async fn source(pool: &PgPool, name: &str) -> Result<Option<Source>, sqlx::Error> {
    let row: Option<(String, String)> = sqlx::query_as("SELECT tenant, kind FROM webhook_sources WHERE source = $1")
        .bind(name)
        .fetch_optional(pool)
        .await?;
    let Some((tenant, kind)) = row else { return Ok(None) };
    let Ok(tenant) = Tenant::parse(&tenant) else { return Ok(None) };
    let secrets: Vec<String> =
        sqlx::query_scalar("SELECT secret FROM webhook_secrets WHERE source = $1 AND retired_at IS NULL")
            .bind(name)
            .fetch_all(pool)
            .await?;
    Ok(Some(Source { tenant, kind, secrets: secrets.into_iter().map(String::into_bytes).collect() }))
}

/// Adds (or re-points) a source and gives it a new secret; keeps at most two
/// active, retiring the oldest. Returns (secret id, secret), shown once.
pub async fn add_secret(pool: &PgPool, name: &str, tenant: &Tenant, kind: &str) -> Result<(Uuid, String), sqlx::Error> {
    let secret = format!("whsec_{}{}", Uuid::new_v4().simple(), Uuid::new_v4().simple());
    let secret_id = Uuid::now_v7();
    let mut tx = pool.begin().await?;
    sqlx::query("INSERT INTO tenants (tenant) VALUES ($1) ON CONFLICT DO NOTHING")
        .bind(tenant.as_str())
        .execute(&mut *tx)
        .await?;
    sqlx::query(
        "INSERT INTO webhook_sources (source, tenant, kind) VALUES ($1, $2, $3) \
         ON CONFLICT (source) DO UPDATE SET tenant = EXCLUDED.tenant, kind = EXCLUDED.kind",
    )
    .bind(name)
    .bind(tenant.as_str())
    .bind(kind)
    .execute(&mut *tx)
    .await?;
    sqlx::query("INSERT INTO webhook_secrets (secret_id, source, secret) VALUES ($1, $2, $3)")
        .bind(secret_id)
        .bind(name)
        .bind(&secret)
        .execute(&mut *tx)
        .await?;
    sqlx::query(
        "UPDATE webhook_secrets SET retired_at = now() WHERE source = $1 AND retired_at IS NULL AND secret_id NOT IN \
         (SELECT secret_id FROM webhook_secrets WHERE source = $1 AND retired_at IS NULL ORDER BY created_at DESC, secret_id DESC LIMIT 2)",
    )
    .bind(name)
    .execute(&mut *tx)
    .await?;
    tx.commit().await?;
    Ok((secret_id, secret))
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: i64 = 1_767_225_600;

    fn secrets() -> Vec<Vec<u8>> {
        vec![b"old-secret".to_vec(), b"new-secret".to_vec()]
    }

    #[test]
    fn a_signature_under_either_active_secret_is_accepted() {
        for secret in secrets() {
            let sig = sign(&secret, NOW, b"{}");
            assert_eq!(verify(&secrets(), Some(&NOW.to_string()), Some(&sig), b"{}", NOW, 300), Ok(()));
        }
        let both = format!("{},{}", sign(b"retired", NOW, b"{}"), sign(b"new-secret", NOW, b"{}"));
        assert_eq!(verify(&secrets(), Some(&NOW.to_string()), Some(&both), b"{}", NOW, 300), Ok(()));
    }

    #[test]
    fn tampering_staleness_and_missing_headers_are_refused() {
        let sig = sign(b"new-secret", NOW, b"{\"a\":1}");
        let ts = NOW.to_string();
        assert_eq!(verify(&secrets(), Some(&ts), Some(&sig), b"{\"a\":2}", NOW, 300), Err(SignatureError::NoMatch));
        assert_eq!(
            verify(&secrets(), Some(&ts), Some(&sig), b"{\"a\":1}", NOW + 301, 300),
            Err(SignatureError::Stale(301))
        );
        assert_eq!(
            verify(&secrets(), None, Some(&sig), b"", NOW, 300),
            Err(SignatureError::Missing(headers::TIMESTAMP))
        );
        assert_eq!(
            verify(&secrets(), Some(&ts), None, b"", NOW, 300),
            Err(SignatureError::Missing(headers::SIGNATURE))
        );
        assert_eq!(verify(&secrets(), Some("soon"), Some(&sig), b"", NOW, 300), Err(SignatureError::BadTimestamp));
        assert_eq!(verify(&[], Some(&ts), Some(&sig), b"{\"a\":1}", NOW, 300), Err(SignatureError::NoMatch));
    }

    #[test]
    fn the_signature_formula_is_pinned() {
        // Do not change: senders compute exactly this.
        assert_eq!(
            sign(b"secret", 1_700_000_000, b"{}"),
            "v1=b8569b78799ff9e3cbff0fc2d63a33a2b57f3282abd07c37ae5e8e7d79a5f163"
        );
    }
}
