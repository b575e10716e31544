//! Postgres access shared by every service: a pool whose connections see only the
//! service's own schema, and migrations embedded in the binaries.

pub mod word;

use std::str::FromStr;
use std::time::Duration;

use fenceline_config::{ExposeSecret, PostgresConfig};
use sqlx::migrate::Migrator;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{ConnectOptions, PgPool};

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error("schema name `{0}` must be lower-case letters, digits and underscores, starting with a letter")]
    SchemaName(String),
    #[error("{0}")]
    Config(#[from] fenceline_config::Error),
    #[error("database URL is invalid: {0}")]
    Url(#[source] sqlx::Error),
    #[error("connecting to the database: {0}")]
    Connect(#[source] sqlx::Error),
    #[error(
        "connecting to the database over TLS (sslmode={mode}): {source}; the server's certificate is checked \
         against the URL's sslrootcert, or the system's roots without it"
    )]
    Tls {
        mode: &'static str,
        #[source]
        source: sqlx::Error,
    },
    #[error("migrating schema {schema}: {source}")]
    Migrate {
        schema: String,
        #[source]
        source: sqlx::migrate::MigrateError,
    },
}

/// A schema name, checked so it can be put into SQL unquoted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SchemaName(String);

impl SchemaName {
    pub fn parse(name: &str) -> Result<Self, Error> {
        let mut chars = name.chars();
        let valid = name.len() <= 63
            && chars.next().is_some_and(|c| c.is_ascii_lowercase())
            && chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
        if valid { Ok(Self(name.to_owned())) } else { Err(Error::SchemaName(name.to_owned())) }
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// The service's database: a pool, and the options to open a connection of its own
/// (for session-level locks) with the same search path.
#[derive(Debug, Clone)]
pub struct Database {
    pub pool: PgPool,
    pub options: PgConnectOptions,
    pub schema: SchemaName,
}

/// Connects, creates the service's schema if needed, and runs `migrators` in order
/// (the bus tables first, then the service's own). Each migrator tolerates the
/// others' versions in the shared `_sqlx_migrations` table of the schema.
pub async fn connect(
    config: &PostgresConfig,
    default_schema: &str,
    migrators: &[&Migrator],
) -> Result<Database, Error> {
    let schema = SchemaName::parse(config.schema.as_deref().unwrap_or(default_schema))?;
    let base = PgConnectOptions::from_str(config.database_url()?.expose_secret())
        .map_err(Error::Url)?
        .log_statements(tracing::log::LevelFilter::Trace)
        .log_slow_statements(tracing::log::LevelFilter::Warn, Duration::from_secs(1));
    {
        let bootstrap = PgPoolOptions::new()
            .max_connections(1)
            .acquire_timeout(Duration::from_secs(10))
            .connect_with(base.clone())
            .await
            .map_err(|e| connect_error(&base, e))?;
        sqlx::query(&format!("CREATE SCHEMA IF NOT EXISTS {}", schema.as_str()))
            .execute(&bootstrap)
            .await
            .map_err(Error::Connect)?;
        bootstrap.close().await;
    }
    let options = base.options([("search_path", schema.as_str())]);
    let pool = PgPoolOptions::new()
        .max_connections(config.max_connections)
        .acquire_timeout(Duration::from_secs(10))
        // No ping on checkout: the pool pings every connection it takes back
        // already, and a connection that broke in between fails its statement,
        // which every caller retries. One round trip less per statement.
        .test_before_acquire(false)
        .connect_with(options.clone())
        .await
        .map_err(Error::Connect)?;
    for migrator in migrators {
        let migrator = Migrator { ignore_missing: true, locking: true, ..clone_migrator(migrator) };
        migrator.run(&pool).await.map_err(|source| Error::Migrate { schema: schema.as_str().to_owned(), source })?;
    }
    tracing::info!(schema = schema.as_str(), "database ready");
    Ok(Database { pool, options, schema })
}

/// A failed first connection; one that failed in the TLS handshake says which
/// mode asked for it and what the certificate is checked against.
fn connect_error(options: &PgConnectOptions, error: sqlx::Error) -> Error {
    use sqlx::postgres::PgSslMode;
    let mode = match options.get_ssl_mode() {
        PgSslMode::Disable => "disable",
        PgSslMode::Allow => "allow",
        PgSslMode::Prefer => "prefer",
        PgSslMode::Require => "require",
        PgSslMode::VerifyCa => "verify-ca",
        PgSslMode::VerifyFull => "verify-full",
    };
    // rustls reports a refused certificate as an I/O error of the handshake.
    let in_handshake = match &error {
        sqlx::Error::Tls(_) => true,
        sqlx::Error::Io(io) => io.kind() == std::io::ErrorKind::InvalidData,
        _ => false,
    };
    if in_handshake && mode != "disable" { Error::Tls { mode, source: error } } else { Error::Connect(error) }
}

/// `migrator`'s migrations whose version `keep` accepts, applied as a service's start
/// applies them (tolerant of versions it does not list): for a test that migrates a
/// schema up to a version, writes rows as the release before left them, and then
/// runs the rest.
pub fn migrations_where(migrator: &Migrator, keep: impl Fn(i64) -> bool) -> Migrator {
    Migrator {
        migrations: std::borrow::Cow::Owned(migrator.migrations.iter().filter(|m| keep(m.version)).cloned().collect()),
        ignore_missing: true,
        locking: true,
        no_tx: false,
    }
}

fn clone_migrator(migrator: &Migrator) -> Migrator {
    Migrator {
        migrations: migrator.migrations.clone(),
        ignore_missing: migrator.ignore_missing,
        locking: migrator.locking,
        no_tx: migrator.no_tx,
    }
}

/// A new schema of its own in the test Postgres (`FENCELINE_TEST_DATABASE_URL`, which
/// `deploy/local/stack test` exports), migrated with `migrators` as `service`
/// migrates its own: store tests run side by side on empty tables without the rest
/// of the system.
///
/// # Panics
///
/// Without `FENCELINE_TEST_DATABASE_URL`, or when the schema cannot be made: it is
/// for tests only.
pub async fn fresh_test_schema(service: &str, migrators: &[&Migrator]) -> Database {
    use std::sync::atomic::{AtomicU64, Ordering};
    static MADE: AtomicU64 = AtomicU64::new(0);
    let url = std::env::var("FENCELINE_TEST_DATABASE_URL")
        .expect("FENCELINE_TEST_DATABASE_URL: run `deploy/local/stack test`");
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default().as_nanos();
    let schema = format!("t_{nanos:x}_{}_{}", std::process::id(), MADE.fetch_add(1, Ordering::Relaxed));
    let config = fenceline_config::PostgresConfig::at(&url, Some(&schema), 4);
    connect(&config, service, migrators).await.expect("a fresh schema")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schema_names_are_plain_identifiers() {
        assert!(SchemaName::parse("scheduler").is_ok());
        assert!(SchemaName::parse("fake_provider2").is_ok());
        for bad in ["", "Scheduler", "1abc", "a-b", "a;drop"] {
            assert!(SchemaName::parse(bad).is_err(), "{bad}");
        }
    }
}
