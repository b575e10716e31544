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
use fenceline_tests::system::{Caps, System, api_agent, submit_over_api};
use fenceline_tests::{PARTITIONS, read_topic, read_until_quiet};
use serde_json::{Value, json};
use sqlparser::ast::{AlterColumnOperation, AlterTableOperation, ColumnOption, ObjectType, Statement};
use sqlparser::dialect::PostgreSqlDialect;
use sqlparser::parser::Parser;
use sqlparser::tokenizer::{Token, Tokenizer, Whitespace};

const SERVICES: [&str; 4] = ["intake", "scheduler", "executor", "reconciler"];
/// Tasks submitted while both builds run (at least), and after the previous one stopped.
const MIN_TASKS_PER_PHASE: u64 = 20;

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

/// Submits task `n` through the intake at `url`, as a client would; its input carries
/// `n` to the provider.
async fn submit(url: &str, token: &str, n: u64) -> TaskId {
    let body = json!({"kind": "image.generate", "input": {"n": n, "prompt": format!("item {n}")}});
    let (url, token) = (url.to_owned(), token.to_owned());
    let answer = tokio::task::spawn_blocking(move || {
        submit_over_api(&api_agent(), &url, &token, &format!("upgrade-{n}"), &body)
    })
    .await
    .expect("submitter")
    .unwrap_or_else(|e| panic!("task {n} not submitted: {e}"));
    assert!(answer.status == 201 || answer.status == 202, "task {n} refused with {}: {}", answer.status, answer.body);
    answer.task_id().and_then(|id| id.parse().ok()).unwrap_or_else(|| panic!("no task id in {}", answer.body))
}

/// Executions that a worker of each build claimed, by the `HOSTNAME` each build's
/// executor runs with (`current`, `previous`).
async fn executions_per_build(system: &System) -> BTreeMap<String, i64> {
    sqlx::query_as(
        "SELECT split_part(worker, ':', 1), count(*) FROM executor.executions WHERE worker IS NOT NULL GROUP BY 1",
    )
    .fetch_all(&system.pool)
    .await
    .expect("executions")
    .into_iter()
    .collect()
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

/// Writes an undecodable upstream record to every partition of the upstream topic,
/// which both intakes share, and reads the `RequestRejected` answers: the previous
/// release writes the version before the current one (docs/wire.md, "Versions"), and
/// every answer decodes with the current types. A joining intake gets its upstream
/// partitions a cooperative rebalance round after it joined, so a round of records
/// is written every second until both builds have answered one (or 45 s passed).
/// Returns how many answers were written with the current schema and how many with
/// an earlier one.
async fn rejections_from_both_intakes(system: &System) -> (usize, usize) {
    use rdkafka::producer::{FutureProducer, FutureRecord};
    let requests = topics::named(&system.prefix, topics::INTAKE_REQUESTS);
    let producer: FutureProducer =
        rdkafka::ClientConfig::new().set("bootstrap.servers", &system.brokers).create().expect("producer");
    let (_, current) = fenceline_events::registry().current("RequestRejected").expect("a current schema");
    let rejected = topics::named(&system.prefix, topics::INTAKE_REJECTED);
    let deadline = tokio::time::Instant::now() + Duration::from_secs(45);
    let (mut round, mut written) = (0, 0);
    loop {
        for partition in 0..PARTITIONS {
            let key = format!("garbage-{round}-{partition}");
            let record = FutureRecord::to(&requests).partition(partition).key(&key).payload(b"\x00garbage".as_slice());
            producer.send(record, Duration::from_secs(10)).await.map_err(|(e, _)| e).expect("upstream record written");
        }
        round += 1;
        written += PARTITIONS as usize;
        let (brokers, rejected) = (system.brokers.clone(), rejected.clone());
        let records =
            tokio::task::spawn_blocking(move || read_topic(&brokers, &rejected, written, Duration::from_secs(20)))
                .await
                .expect("reader");
        assert_eq!(records.len(), written, "one answer per refused record:\n{}", system.logs());
        let mut by_version = (0, 0);
        for record in &records {
            let payload = rdkafka::message::Message::payload(record).expect("a value");
            match fenceline_events::decode(payload) {
                Ok(fenceline_events::Event::RequestRejected(r)) => assert_eq!(r.problem_type, "invalid-record"),
                other => panic!("not a readable RequestRejected: {other:?}"),
            }
            if payload[2..10] == current {
                by_version.0 += 1;
            } else {
                by_version.1 += 1;
            }
        }
        if (by_version.0 > 0 && by_version.1 > 0) || tokio::time::Instant::now() >= deadline {
            return by_version;
        }
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// A roll in the order docs/deploy.md gives for the event types this release changes
/// ("Events: consumers first"): `StepCheckpointed` gained the step's output, so its
/// consumers (scheduler, reconciler, intake) roll before its producer, the executor.
/// The current consumers start first and migrate; the previous release's four join
/// their groups against that schema while tasks arrive through both intakes; the
/// previous consumers stop as the end of their roll; the current executor joins the
/// previous one and both run tasks; then the previous executor stops. Every task
/// succeeds, nothing is dead-lettered or held, and no task is charged twice.
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
    // The services that read the types this release changes, and so roll first.
    const CONSUMERS_FIRST: [&str; 3] = ["intake", "scheduler", "reconciler"];
    for service in CONSUMERS_FIRST {
        system.spawn(service, service, &extra(service, "current")).await;
    }
    for service in SERVICES {
        let binary = previous.join(format!("fenceline-{service}")).display().to_string();
        system.spawn_program(&format!("previous-{service}"), &binary, &[], &extra(service, "previous")).await;
    }
    let token = system.token("acme").await;
    let intakes = [system.url_of("intake"), system.url_of("previous-intake")];

    // The consumers' roll: tasks through both intakes, run by the previous executor.
    let mut tasks = Vec::new();
    for n in 0..MIN_TASKS_PER_PHASE {
        tasks.push(submit(&intakes[(n % 2) as usize], &token, n).await);
    }
    let (current_rejected, previous_rejected) = rejections_from_both_intakes(&system).await;
    for service in CONSUMERS_FIRST {
        system.service(&format!("previous-{service}")).signal("TERM");
    }

    // The executor's roll: both builds' executors share the work. A joining consumer's
    // first cooperative assignment is empty and its share of the dispatch partitions
    // comes a rebalance round later, so the flow goes on until both have run some
    // tasks, or the deadline says they never did.
    system.spawn("executor", "executor", &extra("executor", "current")).await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(45);
    let started = tasks.len() as u64;
    let workers = loop {
        let n = tasks.len() as u64;
        tasks.push(submit(&intakes[0], &token, n).await);
        let workers = executions_per_build(&system).await;
        let both = workers.get("current").is_some_and(|c| *c > 0) && workers.get("previous").is_some_and(|p| *p > 0);
        if (both && n + 1 >= started + MIN_TASKS_PER_PHASE) || tokio::time::Instant::now() >= deadline {
            break workers;
        }
        tokio::time::sleep(Duration::from_millis(if both { 20 } else { 100 })).await;
    };
    system.service("previous-executor").signal("TERM");
    let first_phase = tasks.len() as u64;
    for n in first_phase..first_phase + MIN_TASKS_PER_PHASE {
        tasks.push(submit(&intakes[0], &token, n).await);
    }
    let submitted = tasks.len() as u64;
    for task in &tasks {
        system.wait_state(*task, &["succeeded"], Duration::from_secs(30)).await;
    }
    assert!(
        workers.get("current").is_some_and(|n| *n > 0) && workers.get("previous").is_some_and(|n| *n > 0),
        "both builds' executors ran executions: {workers:?}"
    );
    assert!(
        current_rejected > 0 && previous_rejected > 0,
        "RequestRejected written by both intakes, one schema version apart: {current_rejected} with the current \
         schema, {previous_rejected} with the one before"
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
        (0..submitted).map(|n| (n, charged.get(&n).copied().unwrap_or(0))).filter(|(_, c)| *c != 1).collect();
    assert!(wrong.is_empty(), "tasks not charged exactly once (task, charges): {wrong:?}");
    assert_eq!(system.provider("img").charges().await, submitted as usize, "the ledger's charges");
}

/// What `operation` of an `ALTER TABLE` takes away from the previous release while
/// it still runs (expand, then contract: docs/deploy.md), or `None`.
fn contracting_operation(operation: &AlterTableOperation) -> Option<&'static str> {
    match operation {
        AlterTableOperation::DropColumn { .. } => Some("DROP COLUMN"),
        AlterTableOperation::DropConstraint { .. }
        | AlterTableOperation::DropPrimaryKey { .. }
        | AlterTableOperation::DropForeignKey { .. } => {
            Some("DROP CONSTRAINT (the previous release's ON CONFLICT may name it)")
        }
        AlterTableOperation::RenameColumn { .. }
        | AlterTableOperation::RenameTable { .. }
        | AlterTableOperation::RenameConstraint { .. } => Some("RENAME"),
        AlterTableOperation::ChangeColumn { .. } | AlterTableOperation::ModifyColumn { .. } => Some("ALTER ... TYPE"),
        AlterTableOperation::AlterColumn { op, .. } => match op {
            AlterColumnOperation::SetDataType { .. } => Some("ALTER ... TYPE"),
            AlterColumnOperation::SetNotNull => Some("SET NOT NULL (the previous release's inserts may leave it out)"),
            AlterColumnOperation::DropDefault => Some("DROP DEFAULT (the previous release's inserts may leave it out)"),
            _ => None,
        },
        AlterTableOperation::AddColumn { column_def, .. } => {
            let options = || column_def.options.iter().map(|o| &o.option);
            let not_null = options().any(|o| matches!(o, ColumnOption::NotNull));
            let filled = options().any(|o| {
                matches!(o, ColumnOption::Default(_) | ColumnOption::Generated { .. } | ColumnOption::Identity(_))
            });
            (not_null && !filled)
                .then_some("ADD COLUMN ... NOT NULL without a DEFAULT (the previous release's inserts leave it out)")
        }
        _ => None,
    }
}

/// What `statement` takes away from the previous release while it still runs, or
/// `None`: dropping anything but an index, a rename, a type change, a new obligation
/// on the previous release's inserts.
fn contracting(statement: &Statement) -> Option<String> {
    match statement {
        Statement::Drop { object_type: ObjectType::Index, .. } => None,
        Statement::Drop { object_type, .. } => Some(format!("DROP {object_type}")),
        Statement::RenameTable(_) => Some("RENAME".to_owned()),
        Statement::AlterTable(alter) => alter.operations.iter().find_map(contracting_operation).map(str::to_owned),
        _ => None,
    }
}

/// The statements of a migration, each as its tokens with the comment lines above it
/// (since the statement before), split at the semicolons between statements.
fn statements(sql: &str) -> Result<Vec<(String, Vec<Token>)>, String> {
    let tokens = Tokenizer::new(&PostgreSqlDialect {}, sql).tokenize().map_err(|e| e.to_string())?;
    let mut out = Vec::new();
    let (mut comments, mut statement) = (String::new(), Vec::new());
    let is_code = |token: &Token| !matches!(token, Token::Whitespace(_));
    for token in tokens {
        match token {
            Token::SemiColon => {
                if statement.iter().any(is_code) {
                    out.push((std::mem::take(&mut comments), std::mem::take(&mut statement)));
                }
                statement.clear();
            }
            Token::Whitespace(
                Whitespace::SingleLineComment { comment, .. } | Whitespace::MultiLineComment(comment),
            ) if !statement.iter().any(is_code) => {
                comments.push_str(comment.trim_end());
                comments.push('\n');
            }
            token => statement.push(token),
        }
    }
    if statement.iter().any(is_code) {
        out.push((comments, statement));
    }
    Ok(out)
}

fn git(args: &[&str]) -> (bool, String) {
    let output = Command::new("git").current_dir(repository()).args(args).output().expect("git runs");
    (output.status.success(), String::from_utf8_lossy(&output.stdout).into_owned())
}

/// What is wrong with the migration at `path` (new since `previous`): each contract
/// step must be marked `-- contract: <revision>` naming the release that stopped
/// reading what it removes, at or before the previous release.
fn contract_problems(path: &str, sql: &str, previous: &str) -> Vec<String> {
    let statements = match statements(sql) {
        Ok(statements) => statements,
        Err(e) => return vec![format!("{path}: the SQL does not tokenize: {e}")],
    };
    let mut problems = Vec::new();
    for (comments, tokens) in statements {
        let text = tokens.iter().map(Token::to_string).collect::<String>();
        let text = text.split_whitespace().collect::<Vec<_>>().join(" ");
        let marked = comments.lines().find_map(|l| l.trim().strip_prefix("contract:")).map(|r| {
            r.split_whitespace()
                .next()
                .unwrap_or_default()
                .trim_end_matches(|c: char| !c.is_ascii_alphanumeric())
                .to_owned()
        });
        let what = match Parser::new(&PostgreSqlDialect {}).with_tokens(tokens).parse_statement() {
            Ok(statement) => contracting(&statement),
            // What the check cannot read, it cannot vouch for: a contract step unless marked.
            Err(e) => Some(format!("a statement the check cannot parse ({e})")),
        };
        let Some(what) = what else { continue };
        match marked {
            None => problems.push(format!("{path}: {what} without a `-- contract: <release>` mark: {text}")),
            Some(release) if !git(&["merge-base", "--is-ancestor", &release, previous]).0 => problems.push(format!(
                "{path}: {what} marked as a contract step of {release}, which is not at or before the previous \
                 release {previous}: that release may still read it: {text}"
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

/// The check itself: it catches each contracting statement, whatever its layout, and
/// lets what expands and a marked contract step pass.
#[test]
fn the_migration_check_refuses_what_contracts_and_passes_what_expands() {
    let previous = previous_release();
    let expanding = "-- a new table\nCREATE TABLE t (a int, type text NOT NULL);\n\
        ALTER TABLE t ADD COLUMN b text, ADD COLUMN c int NOT NULL DEFAULT 0; CREATE INDEX t_b ON t (b);\n\
        ALTER TABLE t ADD COLUMN type_name text, ALTER COLUMN a DROP NOT NULL, ALTER COLUMN b SET DEFAULT 'x';\n\
        ALTER TABLE t ADD COLUMN d bigint GENERATED ALWAYS AS IDENTITY;\n\
        DROP INDEX IF EXISTS t_b;\nALTER TABLE t ADD COLUMN e text -- no semicolon at the end\n";
    let passed = contract_problems("expand.sql", expanding, &previous);
    assert!(passed.is_empty(), "refused what only expands: {passed:?}");
    for bad in [
        "ALTER TABLE tasks DROP COLUMN labels;",
        "ALTER TABLE tasks DROP labels",
        "DROP TABLE early_grant_facts;",
        "drop table if exists early_grant_facts cascade;",
        "ALTER TABLE tasks RENAME COLUMN kind TO task_kind;",
        "ALTER TABLE tasks RENAME TO jobs;",
        "ALTER TABLE tasks ALTER COLUMN version TYPE bigint;",
        "ALTER TABLE tasks ALTER version SET DATA TYPE bigint USING version::bigint;",
        "ALTER TABLE tasks ALTER COLUMN tenant SET NOT NULL;",
        "ALTER TABLE tasks ALTER COLUMN tenant SET NOT NULL",
        "ALTER TABLE tasks ALTER COLUMN state DROP DEFAULT;",
        "ALTER TABLE tasks ADD COLUMN owner text NOT NULL;",
        "ALTER TABLE tasks ADD COLUMN owner text NOT NULL, ADD COLUMN note text DEFAULT '';",
        "ALTER TABLE tasks DROP CONSTRAINT tasks_tenant_key;",
        "CREATE TABLE t (a int); ALTER TABLE\n  tasks\n  DROP COLUMN\n  labels;",
    ] {
        let refused = contract_problems("bad.sql", bad, &previous);
        assert_eq!(refused.len(), 1, "not refused exactly once: {bad}: {refused:?}");
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
    let mark_above_another =
        format!("-- contract: {previous}\nALTER TABLE tasks DROP COLUMN labels;\nALTER TABLE tasks DROP COLUMN kind;");
    assert_eq!(
        contract_problems("two.sql", &mark_above_another, &previous).len(),
        1,
        "a mark covers only the statement right below it"
    );
}
