//! A process that runs the shared consumer and outbox relay over a probe
//! projection, so tests can kill it at named fault points and restart it.
//!
//! `bus-probe consume` consumes `fenceline.status` (behind the test's prefix) into
//! the probe projection; `bus-probe relay` only publishes the outbox. Settings come
//! from `PROBE_DATABASE_URL`, `PROBE_TOPIC_PREFIX`, `PROBE_GROUP`, `PROBE_INSTANCE`.

use std::time::Duration;

use fenceline_bus::{ConsumerSpec, FencedConsumer, OutboxWriter, Relay};
use fenceline_tests::*;
use tokio_util::sync::CancellationToken;

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> anyhow::Result<()> {
    let _telemetry = fenceline_telemetry::init("bus-probe");
    let _faults = fenceline_bus::faults::setup();
    let mode = std::env::args().nth(1).unwrap_or_default();
    let var = |name: &str| std::env::var(name).map_err(|_| anyhow::anyhow!("{name} is not set"));
    let url = var("PROBE_DATABASE_URL")?;
    let prefix = var("PROBE_TOPIC_PREFIX")?;
    let kafka = kafka(&prefix);
    let database =
        fenceline_store::connect(&postgres(&url, "probe"), "probe", &[&fenceline_bus::MIGRATOR, &PROBE_MIGRATOR])
            .await?;
    let writer = OutboxWriter::new("bus-probe", prefix.clone(), outbox_config().shards);
    let shutdown = CancellationToken::new();
    let relay =
        Relay::new("probe-relay", database.pool.clone(), database.options.clone(), &kafka, outbox_config(), &writer)?;
    let relay = tokio::spawn(relay.run(shutdown.clone()));
    let consumer = match mode.as_str() {
        "consume" => Some(FencedConsumer::spawn(
            ConsumerSpec {
                group: var("PROBE_GROUP")?,
                topics: vec![fenceline_events::topics::named(&prefix, fenceline_events::topics::STATUS)],
                instance: var("PROBE_INSTANCE")?,
                drain_grace: Duration::from_secs(5),
            },
            &kafka,
            &consumer_config(),
            database.pool.clone(),
            writer,
            ProbeHandler,
            shutdown.clone(),
        )?),
        "relay" => None,
        other => anyhow::bail!("unknown mode `{other}`: consume or relay"),
    };
    tracing::info!(mode, "probe running");
    let _ = tokio::signal::ctrl_c().await;
    shutdown.cancel();
    if let Some(consumer) = consumer {
        consumer.join().await;
    }
    let _ = relay.await;
    Ok(())
}
