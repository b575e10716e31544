//! The reconciler binary: telemetry, configuration, build, run until a signal.

use clap::Parser as _;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let _telemetry = fenceline_telemetry::init(fenceline_reconciler::NAME);
    let _faults = fenceline_bus::faults::setup();
    let config = fenceline_reconciler::Config::parse();
    let app = fenceline_reconciler::build(config).await?;
    app.run_until(fenceline_runtime::shutdown_signal()).await;
    Ok(())
}
