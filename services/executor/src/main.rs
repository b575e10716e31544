//! The executor binary: telemetry, configuration, build, run until a signal.

use clap::Parser as _;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let _telemetry = fenceline_telemetry::init(fenceline_executor::NAME);
    let _faults = fenceline_bus::faults::setup();
    let config = fenceline_executor::Config::parse();
    let app = fenceline_executor::build(config).await?;
    app.run_until_signalled().await;
    Ok(())
}
