//! `fenceline-admin`: operator commands that act on Kafka rather than on one
//! service's tables.

use clap::{Parser, Subcommand};
use fenceline_config::KafkaConfig;

#[derive(Debug, Parser)]
#[command(name = "fenceline-admin", about = "Fenceline operator commands")]
struct Cli {
    #[command(flatten)]
    kafka: KafkaConfig,
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Creates every Fenceline topic that does not exist yet (fenceline.status
    /// compacted); existing topics are left unchanged.
    EnsureTopics {
        /// Partitions of every task-keyed topic; all of them must have the same count.
        #[arg(long, env = "FENCELINE_PARTITIONS", default_value_t = 3)]
        partitions: i32,
        /// Replication factor (1 on a single-broker stack).
        #[arg(long, env = "FENCELINE_REPLICATION", default_value_t = 1)]
        replication: i32,
    },
    /// Waits until the brokers answer a metadata request; exits non-zero when they
    /// refuse the credentials or do not answer in time.
    WaitReady {
        /// How long to wait, in seconds.
        #[arg(long, default_value_t = 60)]
        timeout_s: u64,
    },
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let _telemetry = fenceline_telemetry::init("admin");
    let cli = Cli::parse();
    cli.kafka.security.validate()?;
    match cli.command {
        Command::EnsureTopics { partitions, replication } => {
            let topics = fenceline_bus::admin::fenceline_topics(&cli.kafka.topic_prefix, partitions);
            fenceline_bus::admin::ensure_topics(&cli.kafka, &topics, replication).await?;
            for topic in &topics {
                tracing::info!(topic = %topic.name, partitions = topic.partitions, compacted = topic.compacted, "topic ready");
            }
        }
        Command::WaitReady { timeout_s } => {
            fenceline_bus::kafka::check_connection(&cli.kafka, std::time::Duration::from_secs(timeout_s)).await?;
        }
    }
    Ok(())
}
