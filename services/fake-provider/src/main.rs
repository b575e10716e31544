//! The fake provider binary.

use clap::Parser as _;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let _telemetry = fenceline_telemetry::init(fenceline_fake_provider::NAME);
    let app = fenceline_fake_provider::App::build(fenceline_fake_provider::Config::parse())?;
    app.run_until(fenceline_runtime::shutdown_signal()).await;
    Ok(())
}
