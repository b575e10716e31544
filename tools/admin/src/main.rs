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
    /// Produces dead letters again to the topics they came from, with their original
    /// key, value and headers, once their cause is fixed: the consumer applies them
    /// as it would have (docs/operations.md, "Dead letters").
    ReplayDeadLetters {
        /// The original record, as `topic/partition/offset` (the dead letter's key and
        /// the "record rejected" log line name it); repeat for several.
        #[arg(long = "original", required_unless_present = "all")]
        originals: Vec<String>,
        /// Every dead letter on the topic (of `--consumer`, when given).
        #[arg(long, conflicts_with = "originals")]
        all: bool,
        /// Only letters of this consumer group (for example `fenceline-scheduler`).
        #[arg(long)]
        consumer: Option<String>,
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
        Command::ReplayDeadLetters { originals, all: _, consumer } => {
            let choice = fenceline_bus::replay::Choice { originals: originals.clone(), consumer };
            let done = fenceline_bus::replay::replay_dead_letters(&cli.kafka, &choice).await?;
            if !report(&done, &originals) {
                std::process::exit(1);
            }
        }
    }
    Ok(())
}

/// Prints what became of each chosen dead letter; whether every one was replayed.
#[allow(clippy::print_stdout)] // the report is the command's output
fn report(done: &[fenceline_bus::replay::Replayed], wanted: &[String]) -> bool {
    use fenceline_bus::replay::Replayed;
    let mut incomplete = 0;
    for replayed in done {
        match replayed {
            Replayed::Sent { original, reason } => println!("replayed {original} (was: {reason})"),
            Replayed::Incomplete { original } => {
                incomplete += 1;
                println!("not replayed {original}: the letter holds only the start of the original");
            }
        }
    }
    let found = |o: &String| {
        done.iter()
            .any(|r| matches!(r, Replayed::Sent { original, .. } | Replayed::Incomplete { original } if original == o))
    };
    let missing: Vec<&String> = wanted.iter().filter(|o| !found(o)).collect();
    for original in &missing {
        println!("no dead letter for {original}");
    }
    println!("{} replayed, {incomplete} not replayable, {} not found", done.len() - incomplete, missing.len());
    incomplete == 0 && missing.is_empty()
}
