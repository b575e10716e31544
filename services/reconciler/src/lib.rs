//! Reconciler: finds what is stuck or ambiguous, asks providers for evidence, and decides.

pub mod audit;
pub mod evidence;
pub mod watches;

use std::sync::Arc;
use std::time::Duration;

use fenceline_config::catalog::CatalogConfig;
use fenceline_config::{ExposeSecret, Secret, ServiceConfig};
use fenceline_events::topics;
use fenceline_providers::HttpProvider;
use fenceline_runtime::{Error, ServiceApp};
use fenceline_telemetry::metrics::Group;
use sha2::{Digest, Sha256};

/// The service's name: its log field, its database schema, its outbox producer.
pub const NAME: &str = "reconciler";

/// The reconciler's tables, after the bus tables.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations");

/// Configuration, from environment variables or flags (`--help` lists them).
#[derive(Debug, Clone, clap::Parser)]
#[command(
    name = "fenceline-reconciler",
    about = "Reconciler: finds what is stuck or ambiguous, asks providers for evidence, and decides."
)]
pub struct Config {
    #[command(flatten)]
    pub service: ServiceConfig,
    #[command(flatten)]
    pub catalog: CatalogConfig,
    #[command(flatten)]
    pub reconciler: ReconcilerSettings,
    #[command(subcommand)]
    pub command: Option<Command>,
}

/// What the binary does besides serving.
#[derive(Debug, Clone, clap::Subcommand)]
pub enum Command {
    /// Runs one audit now and lists every finding (exit status 1 if there are any).
    Audit,
}

/// Watches and look-ups.
#[derive(Debug, Clone, clap::Args)]
pub struct ReconcilerSettings {
    /// A grant not claimed within this long is re-issued (same grant id), in milliseconds.
    #[arg(long = "claim-timeout-ms", env = "FENCELINE_RECONCILER_CLAIM_TIMEOUT_MS", default_value_t = 30_000)]
    pub claim_timeout_ms: u64,

    /// How long to keep asking a provider when the task has no deadline, in milliseconds.
    #[arg(long = "ask-for-ms", env = "FENCELINE_RECONCILER_ASK_FOR_MS", default_value_t = 600_000)]
    pub ask_for_ms: u64,

    /// First wait between two look-ups, in milliseconds (doubling, full jitter).
    #[arg(long = "ask-base-ms", env = "FENCELINE_RECONCILER_ASK_BASE_MS", default_value_t = 1_000)]
    pub ask_base_ms: u64,

    /// Longest wait between two look-ups, in milliseconds.
    #[arg(long = "ask-cap-ms", env = "FENCELINE_RECONCILER_ASK_CAP_MS", default_value_t = 60_000)]
    pub ask_cap_ms: u64,

    /// A queued or waiting task whose status has not changed for this long is
    /// reported by the audit, in milliseconds.
    #[arg(long = "no-progress-ms", env = "FENCELINE_RECONCILER_NO_PROGRESS_MS", default_value_t = 900_000)]
    pub no_progress_ms: u64,

    /// How often the audit runs, in milliseconds.
    #[arg(long = "audit-every-ms", env = "FENCELINE_RECONCILER_AUDIT_EVERY_MS", default_value_t = 60_000)]
    pub audit_every_ms: u64,

    /// Rows of finished tasks (grants, calls, cases, status) are deleted this long
    /// after the task's last status, in days.
    #[arg(long = "retention-days", env = "FENCELINE_RECONCILER_RETENTION_DAYS", default_value_t = 30)]
    pub retention_days: u32,

    /// The bearer token `GET /v1/audit` requires (it lists every tenant's tasks).
    /// Never printed. Unset: it answers only on a loopback `FENCELINE_HTTP_ADDR`,
    /// and `401` on any other. (`GET /metrics` names no task and needs no token.)
    #[arg(
        long = "audit-token",
        env = "FENCELINE_RECONCILER_AUDIT_TOKEN",
        hide_env_values = true,
        value_parser = parse_secret,
        conflicts_with = "audit_token_file"
    )]
    pub audit_token: Option<Secret>,

    /// A file holding that token (its trailing newline is dropped).
    #[arg(long = "audit-token-file", env = "FENCELINE_RECONCILER_AUDIT_TOKEN_FILE", value_parser = read_secret_file)]
    pub audit_token_file: Option<Secret>,
}

fn parse_secret(raw: &str) -> Result<Secret, String> {
    if raw.is_empty() {
        return Err("the audit token may not be empty".into());
    }
    Ok(Secret::from(raw.to_owned()))
}

fn read_secret_file(path: &str) -> Result<Secret, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read {path}: {e}"))?;
    parse_secret(text.trim_end_matches(['\n', '\r']))
}

/// Who may read the audit's endpoints, which list every tenant's task ids, states
/// and details.
#[derive(Clone)]
pub enum AuditAccess {
    /// Callers with `Authorization: Bearer <token>`; only the token's sha256 is kept.
    Token([u8; 32]),
    /// No token configured and the listener is on loopback: callers on this host.
    Loopback,
    /// No token configured and the listener is reachable from other hosts: nobody.
    Closed,
}

impl std::fmt::Debug for AuditAccess {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Token(_) => "Token([redacted])",
            Self::Loopback => "Loopback",
            Self::Closed => "Closed",
        })
    }
}

impl AuditAccess {
    /// The access the settings give on a listener at `addr`.
    pub fn new(settings: &ReconcilerSettings, addr: std::net::SocketAddr) -> Self {
        match settings.audit_token.as_ref().or(settings.audit_token_file.as_ref()) {
            Some(token) => Self::Token(Sha256::digest(token.expose_secret().as_bytes()).into()),
            None if addr.ip().is_loopback() => Self::Loopback,
            None => Self::Closed,
        }
    }

    /// Checks a request's `Authorization` header; the refusal's detail otherwise.
    pub fn check(&self, authorization: Option<&str>) -> Result<(), &'static str> {
        match self {
            Self::Loopback => Ok(()),
            Self::Closed => Err("set FENCELINE_RECONCILER_AUDIT_TOKEN to read the audit from another host"),
            Self::Token(expected) => {
                let given =
                    authorization.and_then(|h| h.strip_prefix("Bearer ")).ok_or("a bearer token is required")?;
                let given: [u8; 32] = Sha256::digest(given.trim().as_bytes()).into();
                // Compared in constant time, over digests of a fixed length.
                let differ = given.iter().zip(expected).fold(0u8, |acc, (a, b)| acc | (a ^ b));
                if differ == 0 { Ok(()) } else { Err("the bearer token is not the audit token") }
            }
        }
    }
}

/// `401` as `application/problem+json`, like every other refusal of Fenceline's.
fn unauthorized(detail: &str) -> actix_web::HttpResponse {
    actix_web::HttpResponse::Unauthorized()
        .content_type("application/problem+json")
        .insert_header(("WWW-Authenticate", "Bearer"))
        .json(serde_json::json!({
            "type": "/problems/unauthorized",
            "title": "Unauthorized",
            "status": 401,
            "detail": detail,
        }))
}

/// The audit's routes, behind `access`.
pub fn audit_routes(cfg: &mut actix_web::web::ServiceConfig, pool: sqlx::PgPool, access: AuditAccess) {
    cfg.app_data(actix_web::web::Data::new(pool))
        .app_data(actix_web::web::Data::new(access))
        .route("/v1/audit", actix_web::web::get().to(audit_findings));
}

impl ReconcilerSettings {
    /// How long a running task may show no live expectation before it is reported:
    /// long enough for the events that end one attempt and start the next.
    pub fn audit_grace(&self) -> Duration {
        Duration::from_millis(self.claim_timeout_ms.max(5_000))
    }
}

/// Builds the reconciler: connects and migrates its schema, starts its outbox
/// relay, its consumer of grants and attempts, and its evidence loop.
pub async fn build(config: Config) -> Result<ServiceApp, Error> {
    let catalog = Arc::new(config.catalog.load()?);
    let reconciler_retention_days = config.reconciler.retention_days;
    let settings = Arc::new(config.reconciler);
    let providers =
        HttpProvider::all_of(&catalog).map_err(|e| Error::Config(fenceline_config::Error(e.to_string())))?;
    let access = AuditAccess::new(&settings, config.service.http.addr);
    if matches!(access, AuditAccess::Closed) {
        tracing::warn!(
            "the HTTP listener is not on loopback and FENCELINE_RECONCILER_AUDIT_TOKEN is unset: \
             GET /v1/audit answers 401"
        );
    }
    let mut app =
        ServiceApp::build(NAME, &[Group::Reconciler, Group::ProviderCalls], &config.service, &MIGRATOR, |base| {
            let pool = base.database.pool.clone();
            move |cfg: &mut actix_web::web::ServiceConfig| audit_routes(cfg, pool.clone(), access.clone())
        })
        .await?;
    let pool = app.base.database.pool.clone();
    app.base.scrape.probe(move || {
        let pool = pool.clone();
        async move {
            if let Err(e) = audit::refresh_gauges(&pool).await {
                tracing::warn!(error = %e, "reading the open cases and findings for /metrics failed");
            }
        }
    });
    let wake = Arc::new(tokio::sync::Notify::new());
    let watches = watches::Watches {
        catalog: catalog.clone(),
        settings: settings.clone(),
        wake: wake.clone(),
        batch: Default::default(),
    };
    app.consume("watches", &[topics::DISPATCH, topics::ATTEMPTS, topics::STATUS], watches)?;
    let reconciler = evidence::Reconciler {
        pool: app.base.database.pool.clone(),
        outbox: app.base.outbox.clone(),
        catalog,
        providers: Arc::new(providers),
        settings,
        wake,
    };
    let shutdown = app.base.shutdown.child_token();
    let pool = app.base.database.pool.clone();
    let audit_settings = reconciler.settings.clone();
    app.base.spawn(reconciler.run(shutdown));
    let no_progress = Duration::from_millis(audit_settings.no_progress_ms);
    let grace = audit_settings.audit_grace();
    app.base.spawn_every(Duration::from_millis(audit_settings.audit_every_ms.max(100)), move || {
        let pool = pool.clone();
        async move {
            if let Err(e) = audit::run(&pool, no_progress, grace).await {
                tracing::warn!(error = %e, "the audit failed; trying again at the next round");
            }
        }
    });
    let pool = app.base.database.pool.clone();
    let retention = Duration::from_secs(u64::from(reconciler_retention_days) * 86_400);
    app.base.spawn_every(Duration::from_secs(300), move || {
        let pool = pool.clone();
        async move {
            match audit::purge_finished(&pool, retention, 500).await {
                Ok(0) => {}
                Ok(n) => tracing::info!(purged = n, "finished tasks past their retention purged"),
                Err(e) => tracing::warn!(error = %e, "purging finished tasks failed"),
            }
        }
    });
    Ok(app)
}

/// Runs one audit against the reconciler's schema and returns its findings.
pub async fn audit_now(config: &Config) -> anyhow::Result<Vec<audit::Finding>> {
    let database =
        fenceline_store::connect(&config.service.postgres, NAME, &[&fenceline_bus::MIGRATOR, &MIGRATOR]).await?;
    let no_progress = Duration::from_millis(config.reconciler.no_progress_ms);
    let (found, _) = audit::run(&database.pool, no_progress, config.reconciler.audit_grace()).await?;
    Ok(found)
}

fn authorization(req: &actix_web::HttpRequest) -> Option<&str> {
    req.headers().get(actix_web::http::header::AUTHORIZATION).and_then(|v| v.to_str().ok())
}

async fn audit_findings(
    req: actix_web::HttpRequest,
    access: actix_web::web::Data<AuditAccess>,
    pool: actix_web::web::Data<sqlx::PgPool>,
) -> actix_web::HttpResponse {
    if let Err(detail) = access.check(authorization(&req)) {
        return unauthorized(detail);
    }
    match audit::findings(&pool).await {
        Ok(found) => actix_web::HttpResponse::Ok().json(serde_json::json!({ "findings": found })),
        Err(e) => actix_web::HttpResponse::ServiceUnavailable().body(e.to_string()),
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser as _;

    use super::*;

    #[derive(clap::Parser)]
    struct Only {
        #[command(flatten)]
        settings: ReconcilerSettings,
    }

    fn settings(args: &[&str]) -> ReconcilerSettings {
        let mut argv = vec!["fenceline-reconciler"];
        argv.extend_from_slice(args);
        Only::try_parse_from(argv).expect("settings").settings
    }

    /// A pool that never connects: a refused request must not need the database.
    fn nowhere() -> sqlx::PgPool {
        sqlx::postgres::PgPoolOptions::new()
            .acquire_timeout(Duration::from_millis(200))
            .connect_lazy("postgres://nobody@127.0.0.1:1/none")
            .expect("lazy pool")
    }

    async fn get(access: AuditAccess, path: &str, token: Option<&str>) -> (u16, String, String) {
        use actix_web::test;
        let app = test::init_service(actix_web::App::new().configure(|cfg| audit_routes(cfg, nowhere(), access))).await;
        let mut request = test::TestRequest::get().uri(path);
        if let Some(token) = token {
            request = request.insert_header(("Authorization", format!("Bearer {token}")));
        }
        let answer = test::call_service(&app, request.to_request()).await;
        let status = answer.status().as_u16();
        let media = answer.headers().get("content-type").and_then(|v| v.to_str().ok()).unwrap_or("").to_owned();
        let body = String::from_utf8_lossy(&test::read_body(answer).await).into_owned();
        (status, media, body)
    }

    #[actix_web::test]
    async fn the_audit_needs_the_token() {
        let remote: std::net::SocketAddr = "0.0.0.0:8080".parse().expect("addr");
        let access = AuditAccess::new(&settings(&["--audit-token", "s3cret-audit"]), remote);
        for path in ["/v1/audit"] {
            for token in [None, Some("wrong")] {
                let (status, media, body) = get(access.clone(), path, token).await;
                assert_eq!((status, media.as_str()), (401, "application/problem+json"), "{path} {token:?}: {body}");
                assert!(body.contains("/problems/unauthorized"), "{body}");
            }
            // The right token passes the check (and then finds no database here).
            let (status, _, body) = get(access.clone(), path, Some("s3cret-audit")).await;
            assert_eq!(status, 503, "{path}: {body}");
        }
        assert!(!format!("{access:?}{:?}", settings(&["--audit-token", "s3cret-audit"])).contains("s3cret"));
    }

    #[actix_web::test]
    async fn without_a_token_only_a_loopback_listener_serves_the_audit() {
        let loopback = AuditAccess::new(&settings(&[]), "127.0.0.1:0".parse().expect("addr"));
        assert_eq!(get(loopback, "/v1/audit", None).await.0, 503, "served (no database here)");
        let remote = AuditAccess::new(&settings(&[]), "0.0.0.0:0".parse().expect("addr"));
        let (status, _, body) = get(remote, "/v1/audit", Some("anything")).await;
        assert_eq!(status, 401, "{body}");
        assert!(body.contains("FENCELINE_RECONCILER_AUDIT_TOKEN"), "{body}");
    }

    #[test]
    fn the_token_can_come_from_a_file() {
        let path = std::env::temp_dir().join(format!("audit-token-{}", std::process::id()));
        std::fs::write(&path, "from-a-file\n").expect("write");
        let access = AuditAccess::new(
            &settings(&["--audit-token-file", &path.display().to_string()]),
            "0.0.0.0:0".parse().expect("addr"),
        );
        let _ = std::fs::remove_file(&path);
        assert_eq!(access.check(Some("Bearer from-a-file")), Ok(()));
        assert!(access.check(Some("Bearer from-a-file\n ")).is_ok(), "surrounding space is not part of a token");
        assert!(access.check(None).is_err());
    }
}
