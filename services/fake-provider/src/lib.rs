//! The fake provider: a real HTTP service that speaks Fenceline's provider
//! protocol, records every call it receives and keeps a billing ledger, so tests
//! can count what was charged. It misbehaves on request.

use actix_web::dev::{Server, ServerHandle};
use fenceline_config::HttpConfig;
use fenceline_runtime::{Error, Readiness, health_routes, serve};

pub const NAME: &str = "fake-provider";

/// Configuration, from environment variables or flags (`--help` lists them).
#[derive(Debug, Clone, clap::Parser)]
#[command(name = "fenceline-fake-provider")]
pub struct Config {
    #[command(flatten)]
    pub http: HttpConfig,
}

/// The running fake provider.
pub struct App {
    server: Server,
    port: u16,
    readiness: Readiness,
}

impl std::fmt::Debug for App {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("App").field("port", &self.port).finish_non_exhaustive()
    }
}

impl App {
    pub fn build(config: Config) -> Result<Self, Error> {
        let readiness = Readiness::default();
        let (server, port) = serve(&config.http, health_routes(NAME, readiness.clone(), None))?;
        tracing::info!(service = NAME, port, "listening");
        Ok(Self { server, port, readiness })
    }

    pub fn port(&self) -> u16 {
        self.port
    }

    /// Serves until `shutdown` resolves.
    pub async fn run_until(self, shutdown: impl Future<Output = ()>) {
        let handle: ServerHandle = self.server.handle();
        let server = tokio::spawn(self.server);
        self.readiness.set(true);
        shutdown.await;
        self.readiness.set(false);
        handle.stop(true).await;
        let _ = server.await;
    }
}
