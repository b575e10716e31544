//! Runs any Fenceline service by name, built with the fault points compiled in,
//! so fault tests can start, kill and restart real service processes:
//! `fenceline-host <intake|scheduler|executor|reconciler|fake-provider>`, with the
//! service's usual environment variables.

use clap::Parser as _;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let service = std::env::args().nth(1).unwrap_or_default();
    let args = std::iter::once(format!("fenceline-{service}")).chain(std::env::args().skip(2));
    let _faults = fenceline_bus::faults::setup();
    match service.as_str() {
        "scheduler" => {
            let _telemetry = fenceline_telemetry::init(fenceline_scheduler::NAME);
            let app = fenceline_scheduler::build(fenceline_scheduler::Config::parse_from(args)).await?;
            app.run_until_signalled().await;
        }
        "executor" => {
            let _telemetry = fenceline_telemetry::init(fenceline_executor::NAME);
            let app = fenceline_executor::build(fenceline_executor::Config::parse_from(args)).await?;
            app.run_until_signalled().await;
        }
        "reconciler" => {
            let _telemetry = fenceline_telemetry::init(fenceline_reconciler::NAME);
            let app = fenceline_reconciler::build(fenceline_reconciler::Config::parse_from(args)).await?;
            app.run_until_signalled().await;
        }
        "intake" => {
            let _telemetry = fenceline_telemetry::init(fenceline_intake::NAME);
            let app = fenceline_intake::build(fenceline_intake::Config::parse_from(args)).await?;
            app.run_until_signalled().await;
        }
        "fake-provider" => {
            let _telemetry = fenceline_telemetry::init(fenceline_fake_provider::NAME);
            let app = fenceline_fake_provider::App::build(fenceline_fake_provider::Config::parse_from(args))?;
            app.run_until(fenceline_runtime::shutdown_signal()).await;
        }
        other => anyhow::bail!(
            "unknown service `{other}`; expected intake, scheduler, executor, reconciler or fake-provider"
        ),
    }
    Ok(())
}
