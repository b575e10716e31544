//! The dashboard (docs/dashboard.md) in a real headless browser: Debian's chromium
//! driven by playwright-core runs `tests/ui/dashboard.cjs` against a whole running
//! system. It submits tasks and watches them move without reloading, opens a task
//! by its URL and with the keyboard, goes back and forward, decides a genuine
//! `outcome_unknown` case with the page's button and two more with a bulk action,
//! approves, rejects and cancels waiting refunds one by one and in bulk, pages a
//! queue, reads a timeline, audits every view with axe-core at desktop width and at
//! 420 px, keeps a screenshot of each, and checks that another tenant's token sees
//! none of it and that the page's Content-Security-Policy is set. The providers'
//! ledgers then judge what was charged.

use std::path::PathBuf;
use std::time::Duration;

use fenceline_tests::system::{Caps, System, http};
use serde_json::json;

fn env(name: &str) -> String {
    std::env::var(name).unwrap_or_else(|_| panic!("{name} is not set: run the tests through `deploy/local/stack test`"))
}

/// Where this run's screenshots are kept: under the build's own scratch folder, which
/// outlives the test, one folder a run.
fn artifact_dir() -> PathBuf {
    let dir =
        PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("dashboard").join(uuid::Uuid::now_v7().simple().to_string());
    std::fs::create_dir_all(&dir).expect("artifact folder");
    dir
}

/// The screenshots the browser test kept, each of a page (more than a few bytes).
fn screenshots(dir: &std::path::Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .expect("artifact folder")
        .filter_map(Result::ok)
        .filter(|e| e.metadata().is_ok_and(|m| m.len() > 5_000))
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|name| name.ends_with(".png"))
        .collect();
    names.sort();
    names
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_person_follows_decides_and_approves_in_the_browser_and_another_tenant_sees_nothing() {
    // `img` can neither dedupe nor be asked; `pay` can both.
    let mut system = System::new(&[
        ("img", Caps::default()),
        ("pay", Caps { idempotency_keys: true, lookup: true, ..Caps::default() }),
    ])
    .await;
    // The first three calls are done and charged, and their answers are a gateway's 504:
    // nobody can know whether they happened, so the tasks are outcome_unknown, not
    // retried. Each call takes 1.5 s, so the page shows a task running before it shows
    // the doubt, even where the whole way takes a fraction of a second.
    system.provider("img").rule(json!({"status_after_work": 504, "bare": true, "latency_ms": 1500, "times": 3})).await;
    system.spawn("intake", "intake", &[("FENCELINE_INTAKE_KINDS", "image.generate,ticket.triage".into())]).await;
    system.spawn_all(None).await;
    let (acme, globex) = (system.token("acme").await, system.token("globex").await);
    let intake = system.url_of("intake");

    // The headers, as any client sees them.
    let (status, _) = http("GET", format!("{intake}/ui"), None).await.expect("page");
    assert_eq!(status, 200);

    let artifacts = artifact_dir();
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("ui/dashboard.cjs");
    let started = std::time::Instant::now();
    let run = tokio::process::Command::new(std::env::var("FENCELINE_TEST_NODE").unwrap_or_else(|_| "node".into()))
        .arg(&script)
        .env("FENCELINE_UI_PLAYWRIGHT", env("FENCELINE_TEST_PLAYWRIGHT"))
        .env("FENCELINE_UI_CHROMIUM", env("FENCELINE_TEST_CHROMIUM"))
        .env("FENCELINE_UI_URL", &intake)
        .env("FENCELINE_UI_TOKEN_A", &acme)
        .env("FENCELINE_UI_TENANT_A", "acme")
        .env("FENCELINE_UI_TOKEN_B", &globex)
        .env("FENCELINE_UI_TENANT_B", "globex")
        .env("FENCELINE_UI_AXE", env("FENCELINE_TEST_AXE"))
        .env("FENCELINE_UI_ARTIFACTS", &artifacts)
        .kill_on_drop(true)
        .output();
    let output = tokio::time::timeout(Duration::from_secs(120), run)
        .await
        .expect("the browser test ended within two minutes")
        .expect("run node");
    let printed = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    eprintln!("{printed}");
    eprintln!("browser test took {:.1} s; screenshots in {}", started.elapsed().as_secs_f64(), artifacts.display());
    assert!(output.status.success(), "the browser test failed:\n{printed}\n{}", system.logs());
    assert!(printed.contains("dashboard checks passed"), "{printed}");
    // One of each view audited, at desktop width and at 420 px.
    let kept = screenshots(&artifacts);
    for view in ["sign-in", "tasks", "task", "cases", "approvals"] {
        for width in ["desktop", "420px"] {
            let name = format!("{view}-{width}.png");
            assert!(kept.contains(&name), "{name} kept in {}: {kept:?}", artifacts.display());
        }
    }

    // The ledgers: the image whose answer was lost was charged, and charged again for
    // the retry the person acknowledged; a refund for each of the two approvals that
    // were recorded, none for those rejected or cancelled.
    let charged_for = |prompt: &str, calls: &[serde_json::Value]| {
        calls.iter().filter(|c| c["input"]["task"]["prompt"] == prompt && c["charged"] == true).count()
    };
    let img = system.provider("img").calls().await;
    assert_eq!(charged_for("a red shoe", &img), 2, "the lost answer and the acknowledged retry: {img:?}");
    assert_eq!(system.provider("pay").charges().await, 2, "a refund for each approval recorded");
}
