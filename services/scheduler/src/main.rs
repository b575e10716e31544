//! The scheduler binary: telemetry, configuration, build, run until a signal.

use clap::Parser as _;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let _telemetry = fenceline_telemetry::init(fenceline_scheduler::NAME);
    let _faults = fenceline_bus::faults::setup();
    let config = fenceline_scheduler::Config::parse();
    let app = fenceline_scheduler::build(config).await?;
    app.run_until_signalled().await;
    Ok(())
}
