//! The intake binary: `serve` (the default) runs the service; `create-token` and
//! `revoke-token` administer API tokens, `add-webhook-secret` webhook senders and
//! `add-upstream-source`/`remove-upstream-source` the upstream topic's sources.

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(name = "fenceline-intake")]
struct Cli {
    #[command(flatten)]
    config: fenceline_intake::Config,
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Runs the service (the default).
    Serve,
    /// Creates a tenant if needed and an API token for it; prints the token once.
    CreateToken {
        #[arg(long)]
        tenant: String,
        #[arg(long, default_value = "")]
        label: String,
    },
    /// Configures a webhook source (its tenant and task kind) and prints a new
    /// signing secret once; the two newest secrets stay active, for rotation.
    AddWebhookSecret {
        #[arg(long)]
        source: String,
        #[arg(long)]
        tenant: String,
        #[arg(long)]
        kind: String,
    },
    /// Deduplicates a webhook source's deliveries by a body field (a JSON pointer
    /// such as `/ticket/id`) instead of by event id; `--by-event-id` goes back.
    SetWebhookDedupeField {
        #[arg(long)]
        source: String,
        #[arg(long, required_unless_present = "by_event_id")]
        field: Option<String>,
        #[arg(long, conflicts_with = "field")]
        by_event_id: bool,
    },
    /// Lets a source submit tasks for a tenant through the upstream topic
    /// (creating the tenant if needed); records naming another tenant are refused.
    AddUpstreamSource {
        #[arg(long)]
        source: String,
        #[arg(long)]
        tenant: String,
    },
    /// Stops a source submitting tasks for a tenant through the upstream topic.
    RemoveUpstreamSource {
        #[arg(long)]
        source: String,
        #[arg(long)]
        tenant: String,
    },
    /// Lists the tasks accepted longer ago than `--unscheduled-after-minutes` that
    /// never reached the scheduler (exit status 1 if there are any).
    Unscheduled,
    /// Revokes a token by its id.
    RevokeToken {
        #[arg(long)]
        token_id: uuid::Uuid,
    },
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let _telemetry = fenceline_telemetry::init(fenceline_intake::NAME);
    let _faults = fenceline_bus::faults::setup();
    let cli = Cli::parse();
    match cli.command.unwrap_or(Command::Serve) {
        Command::Serve => {
            let app = fenceline_intake::build(cli.config).await?;
            app.run_until_signalled().await;
        }
        Command::CreateToken { tenant, label } => {
            let tenant = fenceline_intake::auth::Tenant::parse(&tenant).map_err(anyhow::Error::msg)?;
            let pool = admin_pool(&cli.config).await?;
            let (id, token) = fenceline_intake::auth::create_token(&pool, &tenant, &label).await?;
            #[allow(clippy::print_stdout)]
            {
                println!("tenant={} token_id={id} token={token}", tenant.as_str());
            }
        }
        Command::AddWebhookSecret { source, tenant, kind } => {
            let tenant = fenceline_intake::auth::Tenant::parse(&tenant).map_err(anyhow::Error::msg)?;
            let keys = cli.config.intake.sealing_keys()?;
            let pool = admin_pool(&cli.config).await?;
            fenceline_intake::webhooks::check_keys(&pool, keys.as_ref()).await?;
            let (id, secret) =
                fenceline_intake::webhooks::add_secret(&pool, &source, &tenant, &kind, keys.as_ref()).await?;
            #[allow(clippy::print_stdout)]
            {
                println!("source={source} secret_id={id} secret={secret}");
            }
        }
        Command::SetWebhookDedupeField { source, field, by_event_id: _ } => {
            if let Some(field) = &field {
                anyhow::ensure!(field.starts_with('/'), "--field is a JSON pointer such as /ticket/id");
            }
            let pool = admin_pool(&cli.config).await?;
            anyhow::ensure!(
                fenceline_intake::webhooks::set_dedupe_field(&pool, &source, field.as_deref()).await?,
                "no webhook source {source}: add it with add-webhook-secret first"
            );
        }
        Command::AddUpstreamSource { source, tenant } => {
            let tenant = fenceline_intake::auth::Tenant::parse(&tenant).map_err(anyhow::Error::msg)?;
            let pool = admin_pool(&cli.config).await?;
            let added = fenceline_intake::upstream::add_source(&pool, &source, &tenant).await?;
            #[allow(clippy::print_stdout)]
            {
                let was = if added { "configured" } else { "already configured" };
                println!("source={source} tenant={} {was}", tenant.as_str());
            }
        }
        Command::RemoveUpstreamSource { source, tenant } => {
            let tenant = fenceline_intake::auth::Tenant::parse(&tenant).map_err(anyhow::Error::msg)?;
            let pool = admin_pool(&cli.config).await?;
            anyhow::ensure!(
                fenceline_intake::upstream::remove_source(&pool, &source, &tenant).await?,
                "source {source} was not configured for tenant {}",
                tenant.as_str()
            );
        }
        Command::Unscheduled => {
            let pool = admin_pool(&cli.config).await?;
            let (found, count) =
                fenceline_intake::tasks::unscheduled(&pool, cli.config.intake.unscheduled_after(), 1000).await?;
            #[allow(clippy::print_stdout)]
            for task in &found {
                println!("{}\t{}\t{}", task.task_id, task.tenant, task.accepted_at);
            }
            anyhow::ensure!(count == 0, "{count} tasks never reached the scheduler");
        }
        Command::RevokeToken { token_id } => {
            let pool = admin_pool(&cli.config).await?;
            anyhow::ensure!(fenceline_intake::auth::revoke_token(&pool, token_id).await?, "no active token {token_id}");
        }
    }
    Ok(())
}

async fn admin_pool(config: &fenceline_intake::Config) -> anyhow::Result<sqlx::PgPool> {
    let database = fenceline_store::connect(
        &config.service.postgres,
        fenceline_intake::NAME,
        &[&fenceline_bus::MIGRATOR, &fenceline_intake::MIGRATOR],
    )
    .await?;
    Ok(database.pool)
}
