//! The reconciler binary: telemetry, configuration, build, run until a signal.

use clap::Parser as _;

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let _telemetry = fenceline_telemetry::init(fenceline_reconciler::NAME);
    let _faults = fenceline_bus::faults::setup();
    let config = fenceline_reconciler::Config::parse();
    if let Some(fenceline_reconciler::Command::Audit) = config.command {
        let found = fenceline_reconciler::audit_now(&config).await?;
        #[allow(clippy::print_stdout)]
        for f in &found {
            println!("{}\t{}\t{}\t{}", f.finding, f.task_id, f.state, f.detail);
        }
        anyhow::ensure!(found.is_empty(), "{} findings", found.len());
        return Ok(());
    }
    let app = fenceline_reconciler::build(config).await?;
    app.run_until_signalled().await;
    Ok(())
}
