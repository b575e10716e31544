//! A process that runs the shared consumer and outbox relay over a probe
//! projection, so tests can kill it at named fault points and restart it.
//!
//! `bus-probe consume` consumes `fenceline.status` (behind the test's prefix) into
//! the probe projection; `bus-probe relay` only publishes the outbox. Settings come
//! from `PROBE_DATABASE_URL`, `PROBE_TOPIC_PREFIX`, `PROBE_GROUP`, `PROBE_INSTANCE`.

use fenceline_bus::OutboxWriter;
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
    start_relay("probe-relay", &database, &kafka, &writer, &shutdown);
    let consumer = match mode.as_str() {
        "consume" => Some(spawn_probe_consumer(
            &database,
            &prefix,
            &var("PROBE_GROUP")?,
            &var("PROBE_INSTANCE")?,
            writer,
            &shutdown,
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
    Ok(())
}
