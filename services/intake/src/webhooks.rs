//! Signed webhooks: `POST /v1/webhooks/{source}` (docs/intake.md). The sender signs
//! `"{timestamp}.{event_id}.{body}"` with HMAC-SHA256 under one of the source's
//! secrets and sends `Fenceline-Timestamp` (Unix seconds), `Fenceline-Event-Id` (its
//! own id of the delivery) and `Fenceline-Signature` (`v2=<hex>`, several
//! comma-separated during a rotation). The event id is the dedup identity, so it is
//! signed: a captured delivery re-sent under a new id does not verify. A verified
//! delivery becomes a task of the source's kind, once per event id, and is
//! answered at once.

use fenceline_config::{ExposeSecret, Secret};
use hmac::{Hmac, Mac};
use sha2::{Digest, Sha256};
use sqlx::PgPool;
use uuid::Uuid;

use crate::auth::Tenant;
use crate::sealing::{OpenError, SealingKeys};

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
    #[error("the event id must be 1 to {EVENT_ID_MAX} visible ASCII characters other than `.`")]
    BadEventId,
    #[error("v1 signatures do not cover the event id and are refused; sign `timestamp.event_id.body` as v2")]
    OldScheme,
    #[error("the timestamp is {0} s away from now, beyond the tolerance")]
    Stale(i64),
    #[error("no signature matches an active secret of this source")]
    NoMatch,
}

/// The longest event id a sender may use.
pub const EVENT_ID_MAX: usize = 200;

/// A sender's id of one delivery: 1 to [`EVENT_ID_MAX`] visible ASCII characters
/// without `.`, which separates the parts of the signed text (so no other split of
/// the same text yields a different id and body).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EventId(String);

impl EventId {
    pub fn parse(raw: &str) -> Result<Self, SignatureError> {
        let valid =
            !raw.is_empty() && raw.len() <= EVENT_ID_MAX && raw.bytes().all(|b| b.is_ascii_graphic() && b != b'.');
        if valid { Ok(Self(raw.to_owned())) } else { Err(SignatureError::BadEventId) }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// Do not change: the text senders sign, `"{timestamp}.{event_id}.{body}"`.
fn mac_of(secret: &[u8], timestamp: &str, event_id: &EventId, body: &[u8]) -> Option<Hmac<Sha256>> {
    let mut mac = Hmac::<Sha256>::new_from_slice(secret).ok()?;
    mac.update(timestamp.as_bytes());
    mac.update(b".");
    mac.update(event_id.0.as_bytes());
    mac.update(b".");
    mac.update(body);
    Some(mac)
}

/// Checks a delivery: the timestamp within `tolerance_s` of `now_s`, and one of the
/// `v2=` signatures an HMAC-SHA256 of `"{timestamp}.{event_id}.{body}"` under one
/// of `secrets`, compared in constant time. Returns the verified event id.
pub fn verify(
    secrets: &[Secret],
    timestamp: Option<&str>,
    event_id: Option<&str>,
    signature: Option<&str>,
    body: &[u8],
    now_s: i64,
    tolerance_s: i64,
) -> Result<EventId, SignatureError> {
    let timestamp = timestamp.ok_or(SignatureError::Missing(headers::TIMESTAMP))?.trim();
    let event_id = EventId::parse(event_id.ok_or(SignatureError::Missing(headers::EVENT_ID))?.trim())?;
    let signature = signature.ok_or(SignatureError::Missing(headers::SIGNATURE))?;
    let sent: i64 = timestamp.parse().map_err(|_| SignatureError::BadTimestamp)?;
    // Saturating: a timestamp at the ends of the range is stale, not an overflow.
    let skew = now_s.saturating_sub(sent);
    if skew.saturating_abs() > tolerance_s {
        return Err(SignatureError::Stale(skew));
    }
    let parts: Vec<&str> = signature.split(',').map(str::trim).collect();
    let candidates: Vec<Vec<u8>> = parts
        .iter()
        .filter_map(|part| part.strip_prefix("v2="))
        .filter_map(|hex_sig| hex::decode(hex_sig).ok())
        .collect();
    if candidates.is_empty() && parts.iter().any(|part| part.starts_with("v1=")) {
        return Err(SignatureError::OldScheme);
    }
    for secret in secrets {
        for candidate in &candidates {
            let Some(mac) = mac_of(secret.expose_secret().as_bytes(), timestamp, &event_id, body) else { continue };
            if mac.verify_slice(candidate).is_ok() {
                return Ok(event_id);
            }
        }
    }
    Err(SignatureError::NoMatch)
}

/// The `v2=` signature a sender computes; for senders' libraries and tests.
pub fn sign(secret: &[u8], timestamp: i64, event_id: &EventId, body: &[u8]) -> String {
    // HMAC accepts keys of any length.
    let mac = mac_of(secret, &timestamp.to_string(), event_id, body).unwrap_or_else(|| unreachable!("any key length"));
    format!("v2={}", hex::encode(mac.finalize().into_bytes()))
}

/// A configured source: where its deliveries go and its active secrets.
#[derive(Debug, Clone)]
pub struct Source {
    pub tenant: Tenant,
    pub kind: String,
    /// Never printed: its `Debug` says `[REDACTED]`.
    pub secrets: Vec<Secret>,
    /// A JSON pointer into the body naming the business id (a ticket id) that a
    /// delivery is deduplicated by, whatever its event id: a sender that gives each
    /// retry a new event id still makes one task. `None`: by event id.
    pub dedupe_field: Option<String>,
}

impl Source {
    /// The idempotency key a delivery is submitted under: its event id, or the
    /// value at the source's dedupe field. The field's value is hashed (it may be
    /// any text) behind a `.`, which no event id contains, so the two kinds of
    /// keys never meet.
    pub fn dedupe_key(&self, source: &str, event_id: &EventId, body: &serde_json::Value) -> Result<String, String> {
        let Some(pointer) = &self.dedupe_field else {
            return Ok(format!("webhook:{source}:{}", event_id.as_str()));
        };
        let value = match body.pointer(pointer) {
            Some(serde_json::Value::String(text)) if !text.is_empty() => text.clone(),
            Some(serde_json::Value::Number(n)) => n.to_string(),
            _ => {
                return Err(format!(
                    "source `{source}` deduplicates deliveries by the body field `{pointer}` (a non-empty string \
                     or a number), and this body has none"
                ));
            }
        };
        let digest = Sha256::digest(format!("{pointer}\0{value}").as_bytes());
        Ok(format!("webhook:{source}:field.{}", hex::encode(digest)))
    }
}

/// Names the body field a source's deliveries are deduplicated by (`None`: by
/// event id). `Ok(false)`: no such source.
pub async fn set_dedupe_field(pool: &PgPool, name: &str, pointer: Option<&str>) -> Result<bool, sqlx::Error> {
    let updated = sqlx::query("UPDATE webhook_sources SET dedupe_field = $2 WHERE source = $1")
        .bind(name)
        .bind(pointer)
        .execute(pool)
        .await?;
    Ok(updated.rows_affected() == 1)
}

/// Looks a source up with its active secrets; `None` if unknown. Sealed secrets are
/// opened with `keys`; one that does not open (its key is not configured, or the
/// value was altered or copied from another row) is left out, with a warning.
pub async fn source(pool: &PgPool, name: &str, keys: Option<&SealingKeys>) -> Result<Option<Source>, sqlx::Error> {
    let row: Option<(String, String, Option<String>)> =
        sqlx::query_as("SELECT tenant, kind, dedupe_field FROM webhook_sources WHERE source = $1")
            .bind(name)
            .fetch_optional(pool)
            .await?;
    let Some((tenant, kind, dedupe_field)) = row else { return Ok(None) };
    let Ok(tenant) = Tenant::parse(&tenant) else { return Ok(None) };
    let rows: Vec<StoredSecret> = sqlx::query_as(
        "SELECT secret_id, secret, sealed_secret, sealing_key_id FROM webhook_secrets \
         WHERE source = $1 AND retired_at IS NULL",
    )
    .bind(name)
    .fetch_all(pool)
    .await?;
    let mut secrets = Vec::with_capacity(rows.len());
    for row in rows {
        match row.open(name, keys) {
            Ok(secret) => secrets.push(secret),
            Err(e) => tracing::warn!(error = %e, "a webhook secret was left out"),
        }
    }
    Ok(Some(Source { tenant, kind, secrets, dedupe_field }))
}

/// One row of `webhook_secrets`: in clear (before sealing keys were set) or sealed.
#[derive(sqlx::FromRow)]
struct StoredSecret {
    secret_id: Uuid,
    secret: Option<String>,
    sealed_secret: Option<Vec<u8>>,
    sealing_key_id: Option<String>,
}

impl StoredSecret {
    fn open(self, source: &str, keys: Option<&SealingKeys>) -> Result<Secret, OpenError> {
        match (self.sealed_secret, self.secret) {
            (Some(sealed), _) => {
                let key_id = self.sealing_key_id.unwrap_or_default();
                let Some(keys) = keys else {
                    return Err(OpenError::UnknownKey {
                        webhook_source: source.to_owned(),
                        secret_id: self.secret_id,
                        key_id,
                    });
                };
                keys.open(source, self.secret_id, &key_id, &sealed)
            }
            (None, Some(clear)) => Ok(Secret::from(clear)),
            (None, None) => Err(OpenError::Refused {
                webhook_source: source.to_owned(),
                secret_id: self.secret_id,
                key_id: String::new(),
            }),
        }
    }
}

/// Adds (or re-points) a source and gives it a new secret; keeps at most two
/// active, retiring the oldest. With `keys` the secret is stored sealed only.
/// Returns (secret id, secret), shown once.
pub async fn add_secret(
    pool: &PgPool,
    name: &str,
    tenant: &Tenant,
    kind: &str,
    keys: Option<&SealingKeys>,
) -> Result<(Uuid, String), sqlx::Error> {
    let secret = format!("whsec_{}{}", Uuid::new_v4().simple(), Uuid::new_v4().simple());
    let secret_id = Uuid::now_v7();
    let (clear, sealed) = match keys {
        Some(keys) => (None, Some(keys.seal(name, secret_id, &secret))),
        None => (Some(secret.as_str()), None),
    };
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
    sqlx::query(
        "INSERT INTO webhook_secrets (secret_id, source, secret, sealed_secret, sealing_key_id) \
         VALUES ($1, $2, $3, $4, $5)",
    )
    .bind(secret_id)
    .bind(name)
    .bind(clear)
    .bind(sealed.as_ref().map(|s| s.bytes.as_slice()))
    .bind(sealed.as_ref().map(|s| s.key_id.as_str()))
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

/// Why intake cannot use the stored webhook secrets with the configured keys.
#[derive(Debug, thiserror::Error)]
pub enum SealingError {
    #[error(
        "intake.webhook_secrets holds {rows} sealed webhook secrets but no sealing key is configured: \
         set FENCELINE_INTAKE_WEBHOOK_SEALING_KEYS (or _FILE) to the keys they were sealed with (docs/deploy.md)"
    )]
    NoKeys { rows: i64 },
    #[error(
        "intake.webhook_secrets holds {rows} webhook secrets sealed with key ids {missing} that are not configured \
         (configured: {configured}): add those keys to FENCELINE_INTAKE_WEBHOOK_SEALING_KEYS (docs/deploy.md)"
    )]
    UnknownKeys { rows: i64, missing: String, configured: String },
    #[error(transparent)]
    Database(#[from] sqlx::Error),
}

/// Checks that every sealed row's key is configured; with no keys, that no row is
/// sealed. Tells nothing of the keys but their ids.
pub async fn check_keys(pool: &PgPool, keys: Option<&SealingKeys>) -> Result<(), SealingError> {
    let sealed: Vec<(String, i64)> = sqlx::query_as(
        "SELECT coalesce(sealing_key_id, ''), count(*) FROM webhook_secrets \
         WHERE sealed_secret IS NOT NULL GROUP BY 1 ORDER BY 1",
    )
    .fetch_all(pool)
    .await?;
    let Some(keys) = keys else {
        let rows: i64 = sealed.iter().map(|(_, n)| n).sum();
        return if rows == 0 { Ok(()) } else { Err(SealingError::NoKeys { rows }) };
    };
    let missing: Vec<&(String, i64)> = sealed.iter().filter(|(id, _)| !keys.knows(id)).collect();
    if missing.is_empty() {
        return Ok(());
    }
    Err(SealingError::UnknownKeys {
        rows: missing.iter().map(|(_, n)| n).sum(),
        missing: missing.iter().map(|(id, _)| id.as_str()).collect::<Vec<_>>().join(", "),
        configured: keys.ids().join(", "),
    })
}

/// What [`seal_stored`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Resealed {
    /// Rows that were in clear and are now sealed.
    pub sealed: u64,
    /// Rows that were sealed with another configured key and are now sealed with the first.
    pub resealed: u64,
    /// Sealed rows that did not open (altered, or copied from another row): left as they are.
    pub unopened: u64,
}

/// Seals, in one transaction, every row (retired ones too) still in clear or sealed
/// with a key other than the first, so that after a start with keys every row is
/// sealed with the first key. Call [`check_keys`] first.
pub async fn seal_stored(pool: &PgPool, keys: &SealingKeys) -> Result<Resealed, sqlx::Error> {
    let mut tx = pool.begin().await?;
    let rows: Vec<(String, StoredSecret)> =
        sqlx::query_as::<_, (String, Uuid, Option<String>, Option<Vec<u8>>, Option<String>)>(
            "SELECT source, secret_id, secret, sealed_secret, sealing_key_id FROM webhook_secrets \
         WHERE sealed_secret IS NULL OR sealing_key_id IS DISTINCT FROM $1 OR secret IS NOT NULL FOR UPDATE",
        )
        .bind(keys.sealing_id())
        .fetch_all(&mut *tx)
        .await?
        .into_iter()
        .map(|(source, secret_id, secret, sealed_secret, sealing_key_id)| {
            (source, StoredSecret { secret_id, secret, sealed_secret, sealing_key_id })
        })
        .collect();
    let mut done = Resealed::default();
    for (source, row) in rows {
        let (secret_id, was_sealed) = (row.secret_id, row.sealed_secret.is_some());
        let secret = match row.open(&source, Some(keys)) {
            Ok(secret) => secret,
            Err(e) => {
                tracing::warn!(error = %e, "a sealed webhook secret did not open and was not sealed again");
                done.unopened += 1;
                continue;
            }
        };
        let sealed = keys.seal(&source, secret_id, secret.expose_secret());
        sqlx::query(
            "UPDATE webhook_secrets SET secret = NULL, sealed_secret = $2, sealing_key_id = $3 WHERE secret_id = $1",
        )
        .bind(secret_id)
        .bind(&sealed.bytes)
        .bind(&sealed.key_id)
        .execute(&mut *tx)
        .await?;
        if was_sealed { done.resealed += 1 } else { done.sealed += 1 }
    }
    tx.commit().await?;
    Ok(done)
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: i64 = 1_767_225_600;

    fn secrets() -> Vec<Secret> {
        vec![Secret::from("old-secret".to_owned()), Secret::from("new-secret".to_owned())]
    }

    fn id(raw: &str) -> EventId {
        EventId::parse(raw).expect("event id")
    }

    fn check(id: &str, sig: &str, body: &[u8], now: i64) -> Result<EventId, SignatureError> {
        verify(&secrets(), Some(&NOW.to_string()), Some(id), Some(sig), body, now, 300)
    }

    #[test]
    fn a_signature_under_either_active_secret_is_accepted() {
        for secret in secrets() {
            let sig = sign(secret.expose_secret().as_bytes(), NOW, &id("evt-1"), b"{}");
            assert_eq!(check("evt-1", &sig, b"{}", NOW), Ok(id("evt-1")));
        }
        let both = format!("{},{}", sign(b"retired", NOW, &id("e"), b"{}"), sign(b"new-secret", NOW, &id("e"), b"{}"));
        assert_eq!(check("e", &both, b"{}", NOW), Ok(id("e")));
    }

    #[test]
    fn tampering_staleness_and_missing_headers_are_refused() {
        let sig = sign(b"new-secret", NOW, &id("evt-1"), b"{\"a\":1}");
        let ts = NOW.to_string();
        assert_eq!(check("evt-1", &sig, b"{\"a\":2}", NOW), Err(SignatureError::NoMatch));
        assert_eq!(check("evt-1", &sig, b"{\"a\":1}", NOW + 301), Err(SignatureError::Stale(301)));
        assert_eq!(
            verify(&secrets(), None, Some("e"), Some(&sig), b"", NOW, 300),
            Err(SignatureError::Missing(headers::TIMESTAMP))
        );
        assert_eq!(
            verify(&secrets(), Some(&ts), Some("e"), None, b"", NOW, 300),
            Err(SignatureError::Missing(headers::SIGNATURE))
        );
        assert_eq!(
            verify(&secrets(), Some(&ts), None, Some(&sig), b"", NOW, 300),
            Err(SignatureError::Missing(headers::EVENT_ID))
        );
        assert_eq!(
            verify(&secrets(), Some("soon"), Some("e"), Some(&sig), b"", NOW, 300),
            Err(SignatureError::BadTimestamp)
        );
        assert_eq!(
            verify(&[], Some(&ts), Some("evt-1"), Some(&sig), b"{\"a\":1}", NOW, 300),
            Err(SignatureError::NoMatch)
        );
        for bad in ["", "a.b", "with space", &"e".repeat(EVENT_ID_MAX + 1)] {
            assert_eq!(EventId::parse(bad), Err(SignatureError::BadEventId), "{bad}");
        }
    }

    #[test]
    fn a_timestamp_at_the_ends_of_the_range_is_stale_not_an_overflow() {
        let sig = sign(b"new-secret", NOW, &id("e"), b"{}");
        for sent in [i64::MIN, i64::MAX] {
            let refused = verify(&secrets(), Some(&sent.to_string()), Some("e"), Some(&sig), b"{}", NOW, 300);
            assert!(matches!(refused, Err(SignatureError::Stale(_))), "{sent}: {refused:?}");
        }
    }

    #[test]
    fn a_captured_delivery_under_a_new_event_id_does_not_verify() {
        let body = b"{\"ticket\":81723}";
        let sig = sign(b"new-secret", NOW, &id("evt-1"), body);
        assert_eq!(check("evt-1", &sig, body, NOW), Ok(id("evt-1")));
        assert_eq!(check("evt-2", &sig, body, NOW), Err(SignatureError::NoMatch));
    }

    #[test]
    fn old_signatures_without_the_event_id_are_refused() {
        // What a sender of the old scheme computes: HMAC of "{timestamp}.{body}", labelled v1.
        let mut mac = Hmac::<Sha256>::new_from_slice(b"new-secret").expect("key");
        mac.update(format!("{NOW}.{{}}").as_bytes());
        let old = format!("v1={}", hex::encode(mac.finalize().into_bytes()));
        assert_eq!(check("evt-1", &old, b"{}", NOW), Err(SignatureError::OldScheme));
        // Relabelled v2, it still does not match: the event id is not in it.
        assert_eq!(check("evt-1", &old.replacen("v1=", "v2=", 1), b"{}", NOW), Err(SignatureError::NoMatch));
    }

    #[test]
    fn a_source_never_prints_its_secrets() {
        let source = Source {
            tenant: Tenant::parse("acme").expect("tenant"),
            kind: "ticket.triage".into(),
            secrets: vec![Secret::from("whsec_known_5c1d".to_owned())],
            dedupe_field: None,
        };
        let printed = format!("{source:?}");
        assert!(printed.contains("acme") && !printed.contains("whsec_known_5c1d"), "{printed}");
    }

    #[test]
    fn the_signature_formula_is_pinned() {
        // Do not change: senders compute exactly this, HMAC-SHA256("secret", "1700000000.evt-1.{}").
        assert_eq!(
            sign(b"secret", 1_700_000_000, &id("evt-1"), b"{}"),
            "v2=1337c301e24753d7306be70fa05c47e871a6d032d735f4ac527524d0842b74e1"
        );
    }
}
