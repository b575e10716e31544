//! Rolling upgrades (docs/deploy.md, "Rolling upgrades"): the previous release's
//! service binaries beside the current ones on one real stack, in the same consumer
//! groups, while tasks flow; and the check that the migrations since that release
//! only expand what it reads.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use fenceline_domain::ids::TaskId;
use fenceline_events::topics;
use fenceline_tests::read_until_quiet;
use fenceline_tests::system::{Caps, System, http_as};
use serde_json::{Value, json};

const SERVICES: [&str; 4] = ["intake", "scheduler", "executor", "reconciler"];
const TASKS: u64 = 40;

fn repository() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The previous release's revision, as deploy/previous-release names it.
fn previous_release() -> String {
    let file = repository().join("deploy/previous-release");
    std::fs::read_to_string(&file).unwrap_or_else(|e| panic!("{}: {e}", file.display())).trim().to_owned()
}

/// The folder of the previous release's binaries that `deploy/local/stack test` built
/// (`FENCELINE_PREVIOUS_RELEASE_BIN`). Missing binaries fail the test: they are the test.
fn previous_release_binaries() -> PathBuf {
    let dir = std::env::var("FENCELINE_PREVIOUS_RELEASE_BIN").expect(
        "FENCELINE_PREVIOUS_RELEASE_BIN is unset: run the suite with deploy/local/stack test, which builds the \
         previous release first",
    );
    let dir = PathBuf::from(dir);
    let built = std::fs::read_to_string(dir.join(".complete")).unwrap_or_default();
    assert_eq!(built.trim(), previous_release(), "{} does not hold the previous release's build", dir.display());
    for service in SERVICES {
        let binary = dir.join(format!("fenceline-{service}"));
        assert!(binary.is_file(), "the previous release's {} is missing", binary.display());
    }
    dir
}

/// Submits task `n` through the intake at `url`; its input carries `n` to the provider.
async fn submit(url: &str, token: &str, n: u64) -> TaskId {
    let body = json!({"kind": "image.generate", "input": {"n": n, "prompt": format!("item {n}")}});
    let (status, answer) = http_as("POST", format!("{url}/v1/tasks"), token, Some(body)).await.expect("submit");
    assert!(status == 201 || status == 202, "task {n} refused with {status}: {answer}");
    answer["task_id"].as_str().and_then(|id| id.parse().ok()).unwrap_or_else(|| panic!("no task id in {answer}"))
}

/// Counts per schema of `query`, which runs in every service's schema (`{schema}`).
async fn per_schema(system: &System, query: &str) -> BTreeMap<&'static str, i64> {
    let mut counts = BTreeMap::new();
    for schema in SERVICES {
        let count: i64 = sqlx::query_scalar(&query.replace("{schema}", schema))
            .fetch_one(&system.pool)
            .await
            .unwrap_or_else(|e| panic!("{schema}: {e}"));
        counts.insert(schema, count);
    }
    counts
}

/// The current services start first and migrate; the previous release's join their
/// groups against that schema while tasks arrive through both intakes; then the
/// previous release's stop, as the last old pods of a roll do. Every task succeeds,
/// nothing is dead-lettered, and no task is charged twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_previous_release_and_the_current_one_share_the_work_of_a_rolling_upgrade() {
    let previous = previous_release_binaries();
    let mut system = System::new(&[("img", Caps::default())]).await;
    system.provider("img").rule(json!({"latency_ms": 150})).await;
    let kinds = [("FENCELINE_INTAKE_KINDS", "image.generate,ticket.triage".to_owned())];
    let extra = |service: &str, host: &str| {
        let mut extra = vec![("HOSTNAME", host.to_owned())];
        if service == "intake" {
            extra.extend(kinds.iter().cloned());
        }
        extra
    };
    for service in SERVICES {
        system.spawn(service, service, &extra(service, "current")).await;
    }
    for service in SERVICES {
        let binary = previous.join(format!("fenceline-{service}")).display().to_string();
        system.spawn_program(&format!("previous-{service}"), &binary, &[], &extra(service, "previous")).await;
    }
    let token = system.token("acme").await;
    let intakes = [system.url_of("intake"), system.url_of("previous-intake")];

    let mut tasks = Vec::new();
    for n in 0..TASKS / 2 {
        tasks.push(submit(&intakes[(n % 2) as usize], &token, n).await);
    }
    // Wait for some of the work to be done by each build's executor before the old ones go.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    let workers = loop {
        let workers: BTreeMap<String, i64> = sqlx::query_as(
            "SELECT split_part(worker, ':', 1), count(*) FROM executor.executions WHERE worker IS NOT NULL GROUP BY 1",
        )
        .fetch_all(&system.pool)
        .await
        .expect("executions")
        .into_iter()
        .collect();
        if workers.len() == 2 || tokio::time::Instant::now() >= deadline {
            break workers;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    for service in SERVICES {
        system.service(&format!("previous-{service}")).signal("TERM");
    }
    for n in TASKS / 2..TASKS {
        tasks.push(submit(&intakes[0], &token, n).await);
    }
    for task in &tasks {
        system.wait_state(*task, &["succeeded"], Duration::from_secs(30)).await;
    }
    assert!(
        workers.get("current").is_some_and(|n| *n > 0) && workers.get("previous").is_some_and(|n| *n > 0),
        "both builds' executors ran executions: {workers:?}"
    );
    for service in SERVICES {
        let id = format!("previous-{service}");
        let exit = system.service(&id).wait_exit(Duration::from_secs(15)).await;
        assert!(exit.is_some_and(|status| status.success()), "{id} did not drain and exit cleanly: {exit:?}");
    }

    // Nothing dead-lettered: no dead letter on the topic, none in any outbox, no
    // outbox row refused.
    let letters = read_until_quiet(
        &system.brokers,
        &topics::named(&system.prefix, topics::DEADLETTER),
        Duration::from_secs(2),
        Duration::from_secs(5),
    );
    assert!(letters.is_empty(), "{} records were dead-lettered:\n{}", letters.len(), system.logs());
    let in_outboxes = per_schema(
        &system,
        "SELECT count(*) FROM {schema}.outbox WHERE event_type = 'DeadLetter' OR refused_at IS NOT NULL",
    )
    .await;
    assert!(in_outboxes.values().all(|n| *n == 0), "dead letters or refused rows in the outboxes: {in_outboxes:?}");
    let held = system.count_lines("holding a record this build cannot read yet");
    assert_eq!(held, 0, "a consumer held a record it could not read:\n{}", system.logs());

    // No charge twice: the provider's ledger has exactly one charge per task.
    let mut charged: BTreeMap<u64, usize> = BTreeMap::new();
    for call in system.provider("img").calls().await {
        if call["charged"] == Value::Bool(true) {
            let n = call["input"]["task"]["n"].as_u64().expect("the call carries the task's n");
            *charged.entry(n).or_default() += 1;
        }
    }
    let wrong: Vec<_> =
        (0..TASKS).map(|n| (n, charged.get(&n).copied().unwrap_or(0))).filter(|(_, c)| *c != 1).collect();
    assert!(wrong.is_empty(), "tasks not charged exactly once (task, charges): {wrong:?}");
    assert_eq!(system.provider("img").charges().await, TASKS as usize, "the ledger's charges");
}

/// A statement a migration since the previous release may not make while that
/// release still runs (expand, then contract: docs/deploy.md), or `None`.
fn contracting(statement: &str) -> Option<&'static str> {
    let words: Vec<String> = statement.split_whitespace().map(|w| w.to_ascii_uppercase()).collect();
    let has = |phrase: &str| {
        let phrase: Vec<&str> = phrase.split(' ').collect();
        words
            .windows(phrase.len())
            .any(|w| w.iter().zip(&phrase).all(|(a, b)| a.trim_matches(|c| c == ',' || c == '(') == *b))
    };
    let altering = words.len() > 1 && words[0] == "ALTER" && words[1] == "TABLE";
    if has("DROP TABLE") {
        Some("DROP TABLE")
    } else if has("DROP COLUMN") {
        Some("DROP COLUMN")
    } else if words.iter().any(|w| w == "RENAME") {
        Some("RENAME")
    } else if altering && has("TYPE") {
        Some("ALTER ... TYPE")
    } else if altering && has("SET NOT NULL") {
        Some("SET NOT NULL (the previous release's inserts may leave it out)")
    } else if altering && has("ADD COLUMN") && has("NOT NULL") && !has("DEFAULT") {
        Some("ADD COLUMN ... NOT NULL without a DEFAULT (the previous release's inserts leave it out)")
    } else {
        None
    }
}

/// The statements of a migration, each with the comment lines right above it.
fn statements(sql: &str) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let (mut comments, mut statement) = (String::new(), String::new());
    for line in sql.lines() {
        let trimmed = line.trim();
        if let Some(comment) = trimmed.strip_prefix("--") {
            if statement.trim().is_empty() {
                comments.push_str(comment);
                comments.push('\n');
            }
            continue;
        }
        let code = trimmed.split("--").next().unwrap_or_default();
        statement.push_str(code);
        statement.push(' ');
        if code.trim_end().ends_with(';') {
            out.push((std::mem::take(&mut comments), std::mem::take(&mut statement)));
        }
    }
    if !statement.trim().is_empty() {
        out.push((comments, statement));
    }
    out
}

fn git(args: &[&str]) -> (bool, String) {
    let output = Command::new("git").current_dir(repository()).args(args).output().expect("git runs");
    (output.status.success(), String::from_utf8_lossy(&output.stdout).into_owned())
}

/// What is wrong with the migration at `path` (new since `previous`): each contract
/// step must be marked `-- contract: <revision>` naming the release that stopped
/// reading what it removes, at or before the previous release.
fn contract_problems(path: &str, sql: &str, previous: &str) -> Vec<String> {
    let mut problems = Vec::new();
    for (comments, statement) in statements(sql) {
        let Some(what) = contracting(&statement) else { continue };
        let marked = comments.lines().find_map(|l| l.trim().strip_prefix("contract:")).map(|r| {
            r.split_whitespace()
                .next()
                .unwrap_or_default()
                .trim_end_matches(|c: char| !c.is_ascii_alphanumeric())
                .to_owned()
        });
        let statement = statement.split_whitespace().collect::<Vec<_>>().join(" ");
        match marked {
            None => problems.push(format!("{path}: {what} without a `-- contract: <release>` mark: {statement}")),
            Some(release) if !git(&["merge-base", "--is-ancestor", &release, previous]).0 => problems.push(format!(
                "{path}: {what} marked as a contract step of {release}, which is not at or before the previous \
                 release {previous}: that release may still read it: {statement}"
            )),
            Some(_) => {}
        }
    }
    problems
}

/// Migrations since the previous release only expand (docs/deploy.md, "Rolling
/// upgrades"): no migration the previous release has is changed, and a new one drops,
/// renames or retypes nothing unless it is a marked contract step.
#[test]
fn migrations_since_the_previous_release_only_expand() {
    let previous = previous_release();
    assert!(git(&["cat-file", "-e", &format!("{previous}^{{commit}}")]).0, "{previous} is not in this clone");
    let (_, changed) = git(&["diff", "--name-status", "--no-renames", &previous, "--", "*/migrations/*.sql"]);
    let mut problems = Vec::new();
    for line in changed.lines() {
        let (status, path) = line.split_once('\t').expect("status and path");
        match status {
            "A" => {
                let sql = std::fs::read_to_string(repository().join(path)).expect("migration");
                problems.extend(contract_problems(path, &sql, &previous));
            }
            _ => problems.push(format!(
                "{path}: {status} a migration the previous release has (an applied migration never changes)"
            )),
        }
    }
    assert!(
        problems.is_empty(),
        "migrations since {previous} that the previous release cannot run beside:\n{}",
        problems.join("\n")
    );
}

/// The check itself: it catches each contracting statement, and lets a marked one pass.
#[test]
fn the_migration_check_refuses_what_contracts_and_passes_what_expands() {
    let previous = previous_release();
    let expanding = "-- a new table\nCREATE TABLE t (a int);\nALTER TABLE t ADD COLUMN b text, ADD COLUMN c int NOT NULL DEFAULT 0;\nCREATE INDEX t_b ON t (b);";
    assert!(contract_problems("expand.sql", expanding, &previous).is_empty());
    for bad in [
        "ALTER TABLE tasks DROP COLUMN labels;",
        "DROP TABLE early_grant_facts;",
        "ALTER TABLE tasks RENAME COLUMN kind TO task_kind;",
        "ALTER TABLE tasks RENAME TO jobs;",
        "ALTER TABLE tasks ALTER COLUMN version TYPE bigint;",
        "ALTER TABLE tasks ALTER COLUMN tenant SET NOT NULL;",
        "ALTER TABLE tasks ADD COLUMN owner text NOT NULL;",
    ] {
        assert_eq!(contract_problems("bad.sql", bad, &previous).len(), 1, "not refused: {bad}");
    }
    let marked = format!(
        "-- The previous release no longer reads it.\n-- contract: {previous}\nALTER TABLE tasks DROP COLUMN labels;"
    );
    assert!(contract_problems("contract.sql", &marked, &previous).is_empty(), "a marked contract step");
    let head = git(&["rev-parse", "HEAD"]).1;
    let too_new = format!("-- contract: {}\nALTER TABLE tasks DROP COLUMN labels;", head.trim());
    if head.trim() != previous {
        assert_eq!(contract_problems("new.sql", &too_new, &previous).len(), 1, "a release after the previous one");
    }
}
