//! The `fenceline` command line (tools/cli, docs/cli.md) against a running system:
//! the built binary, run as a user would, with its exit codes and its JSON output
//! judged, and the system's own tables as the truth about what it did.

use std::path::Path;
use std::time::Duration;

use fenceline_tests::system::{Caps, System, cli_binary};
use serde_json::{Value, json};

/// One run of `fenceline`: its exit code, stdout and stderr.
#[derive(Debug)]
struct Run {
    code: i32,
    stdout: String,
    stderr: String,
}

impl Run {
    fn json(&self) -> Value {
        serde_json::from_str(&self.stdout).unwrap_or_else(|e| panic!("not JSON ({e}): {self:?}"))
    }
}

/// Runs `fenceline` against `intake` with `env` and nothing of the test's own environment's Fenceline settings.
async fn fenceline(intake: &str, env: &[(&str, &str)], args: &[&str]) -> Run {
    let mut command = tokio::process::Command::new(cli_binary());
    command.args(args).env("FENCELINE_URL", intake);
    for name in ["FENCELINE_TOKEN", "FENCELINE_TOKEN_FILE", "FENCELINE_RECONCILER_AUDIT_TOKEN"] {
        command.env_remove(name);
    }
    for (name, value) in env {
        command.env(name, value);
    }
    let output = tokio::time::timeout(Duration::from_secs(90), command.output())
        .await
        .expect("fenceline finished within 90 s")
        .expect("fenceline ran");
    Run {
        code: output.status.code().unwrap_or(-1),
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
    }
}

/// A run as the tenant, its token in a file.
async fn as_tenant(intake: &str, token_file: &Path, args: &[&str]) -> Run {
    let file = token_file.display().to_string();
    fenceline(intake, &[("FENCELINE_TOKEN_FILE", &file)], args).await
}

fn task_id(run: &Run) -> String {
    run.json()["task_id"].as_str().unwrap_or_else(|| panic!("no task id: {run:?}")).to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_command_line_submits_follows_and_acts_on_tasks_with_exit_codes_scripts_can_test() {
    // `img` renders and triages; `refunds` pays the approved refunds; `payments`
    // does every refund and answers a gateway's 504, and can neither dedupe nor be
    // asked: its refunds end in outcome_unknown.
    let mut system =
        System::new(&[("img", Caps::default()), ("payments", Caps::default()), ("refunds", Caps::default())]).await;
    system.set_kinds(json!({
        "image.generate": {"steps": [{"name": "render", "provider": "img"}], "max_attempts": 4, "attempt_budget_ms": 60_000},
        "ticket.triage": {"steps": [
            {"name": "classify", "provider": "img"},
            {"name": "approve", "approval_signal": "refund_approved"},
            {"name": "refund", "provider": "refunds"}
        ], "max_attempts": 4, "attempt_budget_ms": 60_000},
        "payments.refund": {"steps": [{"name": "refund", "provider": "payments", "operation": "refund"}],
                            "max_attempts": 4, "attempt_budget_ms": 60_000}
    }));
    system.provider("payments").rule(json!({"operation": "refund", "status_after_work": 504, "bare": true})).await;
    system
        .spawn("intake", "intake", &[("FENCELINE_INTAKE_KINDS", "image.generate,ticket.triage,payments.refund".into())])
        .await;
    system.spawn("scheduler", "scheduler", &[]).await;
    system.spawn("reconciler", "reconciler", &[("FENCELINE_RECONCILER_AUDIT_TOKEN", "audit-secret".into())]).await;
    system.spawn("executor", "executor", &[]).await;
    let intake = system.url_of("intake");
    let token = system.token("acme").await;
    let token_file = system.dir.join("token");
    std::fs::write(&token_file, format!("{token}\n")).expect("token file");
    let run = |args: &'static [&'static str]| as_tenant(&intake, &token_file, args);

    // Submitted with a key: the same key and request give the same task.
    let input = r#"{"prompt":"a red shoe"}"#;
    let first = as_tenant(
        &intake,
        &token_file,
        &["submit", "image.generate", input, "-k", "cli-1", "--label", "batch=cli", "--json"],
    )
    .await;
    assert_eq!(first.code, 0, "{first:?}");
    let image = task_id(&first);
    let again =
        as_tenant(&intake, &token_file, &["submit", "image.generate", input, "-k", "cli-1", "--label", "batch=cli"])
            .await;
    assert_eq!(again.code, 0, "{again:?}");
    assert!(again.stdout.contains(&image) && again.stdout.contains("already submitted"), "{again:?}");
    // The same key for another request is a conflict.
    let reused =
        as_tenant(&intake, &token_file, &["submit", "image.generate", r#"{"prompt":"blue"}"#, "-k", "cli-1"]).await;
    assert_eq!(reused.code, 4, "{reused:?}");
    assert!(reused.stderr.contains("/problems/idempotency-key-reused"), "{reused:?}");

    // Without a key one is generated and printed; repeating with it gives the same task.
    let input_file = system.dir.join("input.json");
    std::fs::write(&input_file, r#"{"prompt":"a green hat"}"#).expect("input file");
    let at_file = format!("@{}", input_file.display());
    let keyless = as_tenant(&intake, &token_file, &["submit", "image.generate", &at_file, "--json"]).await;
    assert_eq!(keyless.code, 0, "{keyless:?}");
    let key = keyless
        .stderr
        .split_whitespace()
        .skip_while(|w| *w != "key")
        .nth(1)
        .unwrap_or_else(|| panic!("no key printed: {keyless:?}"))
        .to_owned();
    let repeated = as_tenant(&intake, &token_file, &["submit", "image.generate", &at_file, "-k", &key, "--json"]).await;
    assert_eq!(task_id(&repeated), task_id(&keyless), "the printed key names the same submission");
    let tasks: i64 =
        sqlx::query_scalar("SELECT count(*) FROM intake.tasks").fetch_one(&system.pool).await.expect("count");
    assert_eq!(tasks, 2, "four submissions, two tasks");

    // The other tasks, submitted before anything is awaited so that they run meanwhile.
    let later = as_tenant(
        &intake,
        &token_file,
        &["submit", "image.generate", "{}", "--not-before", "2099-01-01T00:00:00Z", "--json"],
    )
    .await;
    let later = task_id(&later);
    let ticket =
        task_id(&as_tenant(&intake, &token_file, &["submit", "ticket.triage", r#"{"ticket":"t-1"}"#, "--json"]).await);
    let refund = task_id(
        &as_tenant(&intake, &token_file, &["submit", "payments.refund", r#"{"amount_cents":1200}"#, "--json"]).await,
    );

    // Watched until it succeeded: exit 0, each change a line.
    let watched =
        as_tenant(&intake, &token_file, &["watch", &image, "--interval-ms", "200", "--timeout-s", "60"]).await;
    assert_eq!(watched.code, 0, "{watched:?}");
    assert!(watched.stdout.lines().last().is_some_and(|l| l.contains("succeeded")), "{watched:?}");
    // Followed on intake's event stream, not by polling: a task due in two seconds is
    // watched to its end although one poll interval is longer than the whole watch
    // (a polling watch would give up at its first wait, exit 8).
    let soon = (time::OffsetDateTime::now_utc() + Duration::from_secs(2))
        .format(&time::format_description::well_known::Rfc3339)
        .expect("an instant");
    let due_soon = task_id(
        &as_tenant(&intake, &token_file, &["submit", "image.generate", "{}", "--not-before", &soon, "--json"]).await,
    );
    let followed = as_tenant(
        &intake,
        &token_file,
        &["watch", &due_soon, "--interval-ms", "600000", "--timeout-s", "60", "--json"],
    )
    .await;
    assert_eq!(followed.code, 0, "{followed:?}");
    let states: Vec<String> = followed
        .stdout
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter_map(|t| t["state"].as_str().map(str::to_owned))
        .collect();
    assert!(
        states.first().is_some_and(|s| s != "succeeded") && states.last().is_some_and(|s| s == "succeeded"),
        "from waiting to succeeded, a line per change: {followed:?}"
    );
    let got = as_tenant(&intake, &token_file, &["get", &image, "--json"]).await;
    assert_eq!((got.code, got.json()["state"].as_str()), (0, Some("succeeded")), "{got:?}");
    let shown = as_tenant(&intake, &token_file, &["get", &image]).await;
    assert!(shown.stdout.contains("succeeded") && shown.stdout.contains("attempts:"), "{shown:?}");

    // Listed with intake's filters, as JSON.
    let listed = run(&["list", "--label", "batch=cli", "--json"]).await;
    let ids: Vec<Value> =
        listed.json()["tasks"].as_array().into_iter().flatten().map(|t| t["task_id"].clone()).collect();
    assert_eq!(ids, [json!(image)], "{listed:?}");
    let succeeded = run(&["list", "--state", "succeeded", "--all", "--json"]).await;
    assert!(succeeded.stdout.contains(&image) && !succeeded.stdout.contains(&later), "{succeeded:?}");
    let table = run(&["list"]).await;
    assert_eq!(table.stdout.lines().count(), 7, "a header and six tasks: {table:?}");
    // Piped, the full ids a script reads; spans back from now name instants.
    assert!(table.stdout.contains(&image), "piped: full ids: {table:?}");
    let recent = run(&["list", "--since", "1h", "--json"]).await;
    assert!(recent.code == 0 && recent.stdout.contains(&image), "{recent:?}");
    let future = run(&["list", "--until", "1h", "--json"]).await;
    assert!(future.code == 0 && !future.stdout.contains(&image), "nothing accepted before an hour ago: {future:?}");
    let bad = run(&["list", "--since", "yesterday"]).await;
    assert!(bad.code == 2 && bad.stderr.contains("span back from now"), "{bad:?}");
    let completions = run(&["completions", "bash"]).await;
    assert!(completions.code == 0 && completions.stdout.contains("_fenceline()"), "{completions:?}");

    // Cancelled while it waits; its watch ends with 7, not 0.
    let cancelled = as_tenant(&intake, &token_file, &["cancel", &later]).await;
    assert!(cancelled.code == 0 && cancelled.stdout.contains("sent"), "{cancelled:?}");
    let twice = as_tenant(&intake, &token_file, &["cancel", &later, "--json"]).await;
    assert_eq!(twice.json()["repeated"], json!(true), "{twice:?}");
    let watched =
        as_tenant(&intake, &token_file, &["watch", &later, "--interval-ms", "200", "--timeout-s", "60"]).await;
    assert!(watched.code == 7 && watched.stdout.contains("cancelled"), "{watched:?}");

    // A refund that waits for its approval; approved, it runs to the end.
    let waiting =
        as_tenant(&intake, &token_file, &["watch", &ticket, "--interval-ms", "200", "--timeout-s", "60"]).await;
    assert!(waiting.code == 7 && waiting.stdout.contains("awaiting_approval"), "{waiting:?}");
    assert!(waiting.stderr.contains("fenceline approve"), "it says what to do next: {waiting:?}");
    // Followed past the wait it ends (a plain watch right away may still read awaiting_approval).
    let approved = as_tenant(
        &intake,
        &token_file,
        &[
            "approve",
            &ticket,
            "--signal",
            "refund_approved",
            "--as",
            "Ana",
            "--watch",
            "--interval-ms",
            "200",
            "--timeout-s",
            "60",
        ],
    )
    .await;
    assert!(approved.code == 0 && approved.stdout.contains("sent"), "{approved:?}");
    assert!(approved.stdout.lines().last().is_some_and(|l| l.contains("succeeded")), "{approved:?}");
    assert_eq!(system.provider("refunds").charges().await, 1, "the approved refund was paid once");

    // A refund that may have been paid: outcome_unknown, resolved by naming its case.
    let unknown =
        as_tenant(&intake, &token_file, &["watch", &refund, "--interval-ms", "200", "--timeout-s", "60"]).await;
    assert!(unknown.code == 7 && unknown.stdout.contains("outcome_unknown"), "{unknown:?}");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
    let case = loop {
        let read = as_tenant(&intake, &token_file, &["get", &refund, "--json"]).await;
        if let Some(case) = read.json()["case"]["case_id"].as_str() {
            break case.to_owned();
        }
        assert!(tokio::time::Instant::now() < deadline, "intake never showed the case: {read:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let unacknowledged = as_tenant(&intake, &token_file, &["resolve", &refund, "retry-as-new", "--case", &case]).await;
    assert!(
        unacknowledged.code == 2 && unacknowledged.stderr.contains("--i-accept-a-second-charge"),
        "{unacknowledged:?}"
    );
    let stale = as_tenant(&intake, &token_file, &["resolve", &refund, "accept-failed", "--case", "not-the-case"]).await;
    assert!(stale.code == 4 && stale.stderr.contains("/problems/case-changed"), "{stale:?}");
    let resolved = as_tenant(
        &intake,
        &token_file,
        &["resolve", &refund, "accept-failed", "--case", &case, "--watch", "--interval-ms", "200", "--timeout-s", "60"],
    )
    .await;
    let last = resolved.stdout.lines().last().unwrap_or_default();
    assert!(resolved.code == 0 && last.contains("failed"), "failed, as the person chose: {resolved:?}");
    let repeated = as_tenant(&intake, &token_file, &["resolve", &refund, "accept-failed", "--case", &case]).await;
    assert!(repeated.code == 0 && repeated.stdout.contains("before"), "{repeated:?}");
    let other = as_tenant(
        &intake,
        &token_file,
        &["resolve", &refund, "retry-as-new", "--case", &case, "--i-accept-a-second-charge"],
    )
    .await;
    assert!(other.code == 4 && other.stderr.contains("/problems/already-resolved"), "{other:?}");
    assert_eq!(system.provider("payments").charges().await, 1, "accepted as failed: no second refund");

    // Not found, a bad token, no token: each its own exit code.
    let missing = as_tenant(&intake, &token_file, &["get", &uuid::Uuid::now_v7().to_string()]).await;
    assert!(missing.code == 3 && missing.stderr.contains("/problems/task-not-found"), "{missing:?}");
    let refused = fenceline(&intake, &[("FENCELINE_TOKEN", "fl_not_a_token")], &["get", &image]).await;
    assert!(refused.code == 5 && refused.stderr.contains("/problems/unauthorized"), "{refused:?}");
    assert!(!refused.stderr.contains("fl_not_a_token"), "the token is never printed: {refused:?}");
    let checked = fenceline(&intake, &[("FENCELINE_TOKEN", "fl_not_a_token")], &["tokens", "check"]).await;
    assert_eq!(checked.code, 5, "{checked:?}");
    assert_eq!(run(&["tokens", "check"]).await.code, 0);
    let tokenless = fenceline(&intake, &[], &["list"]).await;
    assert_eq!(tokenless.code, 2, "{tokenless:?}");
    let usage = as_tenant(&intake, &token_file, &["get", "not-a-task-id"]).await;
    assert_eq!(usage.code, 2, "{usage:?}");
    let unreachable = fenceline("http://127.0.0.1:1", &[("FENCELINE_TOKEN", "x")], &["list"]).await;
    assert_eq!(unreachable.code, 6, "{unreachable:?}");

    // The reconciler's audit, behind its own token.
    let reconciler = system.url_of("reconciler");
    let audit = fenceline(
        &intake,
        &[("FENCELINE_RECONCILER_AUDIT_TOKEN", "audit-secret")],
        &["audit", "--reconciler-url", &reconciler, "--json"],
    )
    .await;
    assert!(audit.code == 0 && audit.json()["findings"].is_array(), "{audit:?}");
    let unaudited = fenceline(&intake, &[], &["audit", "--reconciler-url", &reconciler]).await;
    assert_eq!(unaudited.code, 5, "{unaudited:?}");
    let all_output: String =
        [&first, &keyless, &watched, &shown, &listed].iter().map(|r| format!("{}{}", r.stdout, r.stderr)).collect();
    assert!(!all_output.contains(&token), "the tenant's token is never printed");
}

/// A system whose `ticket.triage` waits for `refund_approved` between its calls,
/// and a token file for the tenant `acme`.
async fn approving_system() -> (System, String, std::path::PathBuf) {
    let mut system = System::new(&[("img", Caps::default()), ("refunds", Caps::default())]).await;
    system.spawn("intake", "intake", &[]).await;
    system.spawn("scheduler", "scheduler", &[]).await;
    system.spawn("executor", "executor", &[]).await;
    let intake = system.url_of("intake");
    let token_file = system.dir.join("token");
    std::fs::write(&token_file, system.token("acme").await).expect("token file");
    (system, intake, token_file)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn approve_without_a_signal_sends_the_one_the_task_awaits_and_the_hint_names_it() {
    let (system, intake, token_file) = approving_system().await;
    let submit = |extra: &'static [&'static str]| {
        let args = [&["submit", "ticket.triage", r#"{"ticket":"t-1"}"#, "--json"][..], extra].concat();
        let (intake, token_file) = (intake.clone(), token_file.clone());
        async move { task_id(&as_tenant(&intake, &token_file, &args).await) }
    };
    let ticket = submit(&[]).await;
    let later = submit(&["--not-before", "2099-01-01T00:00:00Z"]).await;

    // A task that awaits nothing yet: approve cannot guess, and says how to name one.
    let guessed = as_tenant(&intake, &token_file, &["approve", &later, "--as", "Ana"]).await;
    assert!(guessed.code == 2 && guessed.stderr.contains("awaits no signal now"), "{guessed:?}");
    assert!(guessed.stderr.contains(&format!("fenceline approve {later} --signal NAME --as NAME")), "{guessed:?}");

    // The hint is the command to run, with the signal the task awaits.
    let waiting =
        as_tenant(&intake, &token_file, &["watch", &ticket, "--interval-ms", "200", "--timeout-s", "60"]).await;
    assert!(waiting.code == 7 && waiting.stdout.contains("awaiting_approval"), "{waiting:?}");
    let hint = format!("fenceline approve|reject {ticket} --signal refund_approved --as NAME");
    assert!(waiting.stderr.contains(&hint), "{waiting:?}");
    let shown = as_tenant(&intake, &token_file, &["get", &ticket]).await;
    assert!(shown.stdout.contains("awaiting signal") && shown.stdout.contains("refund_approved"), "{shown:?}");

    let approved = as_tenant(
        &intake,
        &token_file,
        &["approve", &ticket, "--as", "Ana", "--watch", "--interval-ms", "200", "--timeout-s", "60"],
    )
    .await;
    assert!(approved.code == 0 && approved.stdout.contains("approve:approve"), "{approved:?}");
    assert!(approved.stdout.lines().last().is_some_and(|l| l.contains("succeeded")), "{approved:?}");
    assert_eq!(system.provider("refunds").charges().await, 1, "the approved refund was paid once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_action_intake_refuses_exits_non_zero_with_its_reason() {
    let (_system, intake, token_file) = approving_system().await;
    let image = task_id(
        &as_tenant(&intake, &token_file, &["submit", "image.generate", r#"{"prompt":"a hat"}"#, "--json"]).await,
    );
    let later = task_id(
        &as_tenant(
            &intake,
            &token_file,
            &["submit", "ticket.triage", "{}", "--not-before", "2099-01-01T00:00:00Z", "--json"],
        )
        .await,
    );

    // A signal no step of the task's kind waits for: refused, naming those it takes.
    let unknown = as_tenant(&intake, &token_file, &["approve", &later, "--signal", "approve", "--as", "Ana"]).await;
    assert!(unknown.code == 2 && unknown.stderr.contains("/problems/unknown-signal"), "{unknown:?}");
    assert!(unknown.stderr.contains("it takes `refund_approved`"), "{unknown:?}");
    let none =
        as_tenant(&intake, &token_file, &["approve", &image, "--signal", "refund_approved", "--as", "Ana"]).await;
    assert!(none.code == 2 && none.stderr.contains("wait for no signal"), "{none:?}");

    // Finished tasks: a new cancel, signal or resolution is refused, naming the state.
    let succeeded =
        as_tenant(&intake, &token_file, &["watch", &image, "--interval-ms", "200", "--timeout-s", "60"]).await;
    assert_eq!(succeeded.code, 0, "{succeeded:?}");
    let cancel = as_tenant(&intake, &token_file, &["cancel", &image]).await;
    assert!(cancel.code == 4 && cancel.stderr.contains("/problems/task-finished"), "{cancel:?}");
    assert!(cancel.stderr.contains(&format!("task {image} is already succeeded; nothing to cancel")), "{cancel:?}");
    let approve = as_tenant(&intake, &token_file, &["approve", &image, "--as", "Ana"]).await;
    assert!(approve.code == 4 && approve.stderr.contains("is already succeeded; nothing to approve"), "{approve:?}");

    assert_eq!(as_tenant(&intake, &token_file, &["cancel", &later]).await.code, 0);
    let cancelled =
        as_tenant(&intake, &token_file, &["watch", &later, "--interval-ms", "200", "--timeout-s", "60"]).await;
    assert!(cancelled.code == 7 && cancelled.stdout.contains("cancelled"), "{cancelled:?}");
    let signal =
        as_tenant(&intake, &token_file, &["approve", &later, "--signal", "refund_approved", "--as", "Ana"]).await;
    assert!(signal.code == 4 && signal.stderr.contains("is already cancelled; nothing to approve"), "{signal:?}");
    let resolve = as_tenant(&intake, &token_file, &["resolve", &later, "accept-failed", "--case", "c"]).await;
    assert!(resolve.code == 4 && resolve.stderr.contains("is already cancelled; nothing to resolve"), "{resolve:?}");
}
