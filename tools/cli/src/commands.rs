//! Each command: the request it makes (docs/intake.md) and what it prints.

use std::io::{Read as _, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use fenceline_domain::ids::TaskId;
use fenceline_domain::vocabulary::{ApprovalDecision, TaskState};
use secrecy::SecretString;
use serde_json::{Value, json};

use crate::args::{
    ApproveArgs, Cli, Command, IntakeAdmin, ListArgs, Resolution, ResolveArgs, SubmitArgs, TokensCommand,
};
use crate::client::Client;
use crate::render::{self, Accepted, ActionAccepted, Findings, Page, TaskView};
use crate::{Error, Exit, watch};

/// Runs the command line's command.
pub fn run(cli: Cli, out: &mut dyn Write) -> Result<Exit, Error> {
    let timeout = Duration::from_secs(cli.intake.request_timeout_s.max(1));
    let json = cli.json;
    let look = crate::terminal::Look::detect(cli.wide);
    let intake = || -> Result<Client, Error> {
        let token = token(cli.intake.token.clone(), cli.intake.token_file.as_deref())?.ok_or(Error::NoToken)?;
        Client::new(&cli.intake.url, Some(token), timeout)
    };
    match cli.command {
        Command::Submit(args) => submit(&intake()?, args, json, out),
        Command::Get { task_id, full } => {
            let answer = intake()?.get(&format!("/v1/tasks/{task_id}"), &[])?;
            if json {
                raw(out, &answer.text)?;
            } else {
                let task: TaskView = answer.parse()?;
                render::task(out, &task)?;
                render::decided_on(out, &task, (!full).then_some(render::SHOWN_BYTES))?;
            }
            Ok(Exit::Ok)
        }
        Command::List(args) => list(&intake()?, args, json, look, out),
        Command::Completions { shell } => {
            let mut command = <Cli as clap::CommandFactory>::command();
            clap_complete::generate(shell, &mut command, "fenceline", out);
            Ok(Exit::Ok)
        }
        Command::Watch(args) => match (args.task_id, args.label) {
            (Some(task_id), _) => watch::task(&intake()?, task_id, args.polling, json, out),
            (None, Some(label)) => watch::label(&intake()?, &label, args.polling, json, out),
            (None, None) => Err(Error::Usage("give a task id or --label".into())),
        },
        Command::Cancel { task_id } => {
            let answer = intake()?.post(&format!("/v1/tasks/{task_id}/cancel"), None, &[])?;
            action(out, json, &answer.text, &answer.parse()?)?;
            Ok(Exit::Ok)
        }
        Command::Spend { since, until } => {
            let query = instants([("since", since), ("until", until)])?;
            let answer = intake()?.get("/v1/spend", &query)?;
            if json {
                raw(out, &answer.text)?;
            } else {
                render::spend(out, &answer.parse()?)?;
            }
            Ok(Exit::Ok)
        }
        Command::Approve(args) => decide(&intake()?, args, ApprovalDecision::Approve, json, out),
        Command::Reject(args) => decide(&intake()?, args, ApprovalDecision::Reject, json, out),
        Command::Resolve(args) => resolve(&intake()?, args, json, out),
        Command::Audit(args) => {
            let token = token(args.audit_token, args.audit_token_file.as_deref())?;
            // Without a token: a reconciler on loopback without one of its own serves the host.
            let answer = Client::new(&args.reconciler_url, token, timeout)?.get("/v1/audit", &[])?;
            if json {
                raw(out, &answer.text)?;
            } else {
                let found: Findings = answer.parse()?;
                render::findings(out, &found.findings)?;
            }
            Ok(Exit::Ok)
        }
        Command::Tokens(TokensCommand::Check) => {
            let client = intake()?;
            client.get("/v1/tasks", &[("limit", "1".to_owned())])?;
            writeln!(out, "intake at {} accepts this token", cli.intake.url)?;
            Ok(Exit::Ok)
        }
        Command::Tokens(TokensCommand::Create { tenant, label, admin }) => {
            intake_admin(&admin, &["create-token", "--tenant", &tenant, "--label", &label])
        }
        Command::Tokens(TokensCommand::Revoke { token_id, admin }) => {
            intake_admin(&admin, &["revoke-token", "--token-id", &token_id.to_string()])
        }
    }
}

/// The token from its file (which wins) or from the flag or environment.
fn token(flag: Option<SecretString>, file: Option<&Path>) -> Result<Option<SecretString>, Error> {
    let Some(file) = file else { return Ok(flag) };
    let text = std::fs::read_to_string(file)
        .map_err(|e| Error::Usage(format!("cannot read the token file {}: {e}", file.display())))?;
    let token = text.trim_end_matches(['\n', '\r']);
    if token.is_empty() {
        return Err(Error::Usage(format!("the token file {} is empty", file.display())));
    }
    Ok(Some(SecretString::from(token)))
}

/// An answer as received, for `--json`.
fn raw(out: &mut dyn Write, text: &str) -> Result<(), Error> {
    writeln!(out, "{}", text.trim_end())?;
    Ok(())
}

/// A JSON object given on the command line.
fn json_object(what: &str, text: &str) -> Result<Value, Error> {
    let value: Value =
        serde_json::from_str(text).map_err(|e| Error::Usage(format!("{what} is not valid JSON: {e}")))?;
    if !value.is_object() {
        return Err(Error::Usage(format!("{what} must be a JSON object")));
    }
    Ok(value)
}

/// The input argument: the JSON itself, `@FILE`, or `-` for standard input.
fn read_input(arg: &str) -> Result<Value, Error> {
    let text = if arg == "-" {
        let mut text = String::new();
        std::io::stdin()
            .read_to_string(&mut text)
            .map_err(|e| Error::Usage(format!("reading the input from standard input: {e}")))?;
        text
    } else if let Some(path) = arg.strip_prefix('@') {
        std::fs::read_to_string(path).map_err(|e| Error::Usage(format!("reading the input file {path}: {e}")))?
    } else {
        arg.to_owned()
    };
    json_object("the input", &text)
}

fn submit(client: &Client, args: SubmitArgs, json: bool, out: &mut dyn Write) -> Result<Exit, Error> {
    let input = read_input(&args.input)?;
    let (key, generated) = match args.idempotency_key {
        Some(key) => (key, false),
        None => (uuid::Uuid::new_v4().to_string(), true),
    };
    let mut body = json!({ "kind": args.kind, "input": input });
    if !args.labels.is_empty() {
        body["labels"] = Value::Object(args.labels.into_iter().map(|(k, v)| (k, Value::String(v))).collect());
    }
    for (field, value) in [
        ("priority", args.priority.map(|p| p.as_str().to_owned())),
        ("deadline", args.deadline),
        ("not_before", args.not_before),
    ] {
        if let Some(value) = value {
            body[field] = Value::String(value);
        }
    }
    if generated {
        // Before the request: a time-out leaves the user the key to try again with.
        eprintln!("fenceline: idempotency key {key} (submit again with --idempotency-key {key} to repeat it safely)");
    }
    let answer = client.post("/v1/tasks", Some(&body), &[("Idempotency-Key", &key)])?;
    let accepted: Accepted = answer.parse()?;
    if json {
        raw(out, &answer.text)?;
    } else {
        let mut shown = format!("task {} accepted ({})", accepted.task_id, accepted.status_url);
        if answer.replayed {
            shown = format!("task {} already submitted with this key ({})", accepted.task_id, accepted.status_url);
        }
        writeln!(out, "{shown}")?;
    }
    if args.watch {
        out.flush()?;
        return watch::task(client, accepted.task_id, args.polling, json, out);
    }
    Ok(Exit::Ok)
}

/// The `since` and `until` of a query, spans back from now made instants.
fn instants(pairs: [(&str, Option<String>); 2]) -> Result<Vec<(&str, String)>, Error> {
    let now = time::OffsetDateTime::now_utc();
    let mut query = Vec::new();
    for (name, value) in pairs {
        if let Some(value) = value {
            let instant =
                crate::terminal::instant_arg(&value, now).map_err(|e| Error::Usage(format!("--{name}: {e}")))?;
            query.push((name, instant));
        }
    }
    Ok(query)
}

fn list(
    client: &Client,
    args: ListArgs,
    json: bool,
    look: crate::terminal::Look,
    out: &mut dyn Write,
) -> Result<Exit, Error> {
    let mut query: Vec<(&str, String)> = instants([("since", args.since), ("until", args.until)])?;
    for (name, value) in [
        ("state", args.state.map(|s| s.as_str().to_owned())),
        ("kind", args.kind),
        ("label", args.label),
        ("limit", args.limit.map(|l| l.to_string())),
    ] {
        if let Some(value) = value {
            query.push((name, value));
        }
    }
    let mut cursor = args.cursor;
    let mut tasks: Vec<TaskView> = Vec::new();
    let mut raw_tasks: Vec<Value> = Vec::new();
    loop {
        let mut page_query = query.clone();
        if let Some(cursor) = &cursor {
            page_query.push(("cursor", cursor.clone()));
        }
        let answer = client.get("/v1/tasks", &page_query)?;
        let page: Page = answer.parse()?;
        if !args.all {
            if json {
                raw(out, &answer.text)?;
            } else {
                render::tasks(out, &page.tasks, look)?;
                if let Some(next) = &page.next_cursor {
                    writeln!(out, "more: --cursor {next} (or --all)")?;
                }
            }
            return Ok(Exit::Ok);
        }
        let raw_page: Value = answer.parse()?;
        raw_tasks.extend(raw_page["tasks"].as_array().cloned().unwrap_or_default());
        tasks.extend(page.tasks);
        match page.next_cursor {
            Some(next) => cursor = Some(next),
            None => break,
        }
    }
    if json {
        writeln!(out, "{}", json!({ "tasks": raw_tasks }))?;
    } else {
        render::tasks(out, &tasks, look)?;
    }
    Ok(Exit::Ok)
}

/// Decides one wait of the task's approval step: the one it is at now, bound to
/// its card (step, generation, digest), or, given --signal or --step, a wait ahead.
fn decide(
    client: &Client,
    args: ApproveArgs,
    decision: ApprovalDecision,
    json: bool,
    out: &mut dyn Write,
) -> Result<Exit, Error> {
    let task: TaskView = client.get(&format!("/v1/tasks/{}", args.task_id), &[])?.parse()?;
    let mut body = json!({ "decided_by": args.decided_by });
    for (field, value) in [("note", &args.note), ("signal", &args.signal), ("step", &args.step)] {
        if let Some(value) = value {
            body[field] = Value::String(value.clone());
        }
    }
    let ahead = args.signal.is_some() || args.step.is_some();
    match &task.approval {
        // The wait the task is at: bound to the card as it is now, or as the person read it.
        Some(card) if args.step.as_deref().is_none_or(|s| s == card.step) => {
            body["step"] = Value::String(card.step.clone());
            body["generation"] = Value::from(card.generation);
            body["digest"] = Value::String(args.digest.clone().unwrap_or_else(|| card.digest.clone()));
            if !json {
                writeln!(
                    out,
                    "{} the wait of step {} (generation {}) of {}:",
                    verb(decision),
                    card.step,
                    card.generation,
                    task.task_id
                )?;
                let shown = TaskView { input: None, steps: None, decisions: None, ..task.clone() };
                render::decided_on(out, &shown, Some(render::SHOWN_BYTES))?;
            }
        }
        _ if ahead => {
            if let Some(digest) = &args.digest {
                body["digest"] = Value::String(digest.clone());
            }
        }
        _ => body["signal"] = Value::String(awaited_signal(&task, decision)?),
    }
    let path = format!("/v1/tasks/{}/{}", args.task_id, decision.as_str());
    let answer = client.post(&path, Some(&body), &[])?;
    action(out, json, &answer.text, &answer.parse()?)?;
    if !args.watch {
        return Ok(Exit::Ok);
    }
    let expected = match decision {
        ApprovalDecision::Approve => TaskState::Succeeded,
        ApprovalDecision::Reject => TaskState::Failed,
    };
    watch::task_after(client, args.task_id, Some(task.version), expected, args.polling, json, out)
}

fn verb(decision: ApprovalDecision) -> &'static str {
    match decision {
        ApprovalDecision::Approve => "approving",
        ApprovalDecision::Reject => "rejecting",
    }
}

/// The signal a task awaits now, or why there is no wait to decide.
fn awaited_signal(task: &TaskView, decision: ApprovalDecision) -> Result<String, Error> {
    if let Some(signal) = &task.awaiting_signal {
        return Ok(signal.clone());
    }
    let id = task.task_id;
    if task.state.is_final() {
        return Err(Error::Conflict(format!("task {id} is already {}; nothing to {decision}", task.state)));
    }
    Err(Error::Usage(format!(
        "task {id} is {} and awaits no signal now; to decide a wait ahead of it, name it: \
         fenceline {decision} {id} --signal NAME --as NAME",
        task.state
    )))
}

fn resolve(client: &Client, args: ResolveArgs, json: bool, out: &mut dyn Write) -> Result<Exit, Error> {
    if args.action == Resolution::RetryAsNew && !args.i_accept_a_second_charge {
        return Err(Error::Usage(
            "retry-as-new starts a new operation that the provider may charge a second time; \
             add --i-accept-a-second-charge to confirm"
                .into(),
        ));
    }
    let mut body = json!({
        "case_id": args.case_id,
        "action": args.action.action().as_str(),
        "acknowledge_possible_charge": args.action == Resolution::RetryAsNew,
    });
    if let Some(name) = &args.decided_by {
        body["decided_by"] = json!(name);
    }
    if let Some(note) = &args.note {
        body["note"] = json!(note);
    }
    if args.action == Resolution::AttachResult {
        body["result"] = json!({ "uri": args.uri, "sha256": args.sha256, "size_bytes": args.size_bytes });
    } else if args.uri.is_some() || args.sha256.is_some() || args.size_bytes.is_some() {
        return Err(Error::Usage("--uri, --sha256 and --size-bytes belong to attach-result".into()));
    }
    let before = if args.watch { Some(version(client, args.task_id)?) } else { None };
    let answer = client.post(&format!("/v1/tasks/{}/resolution", args.task_id), Some(&body), &[])?;
    action(out, json, &answer.text, &answer.parse()?)?;
    match before {
        Some(before) => {
            watch::task_after(client, args.task_id, Some(before), args.action.outcome(), args.polling, json, out)
        }
        None => Ok(Exit::Ok),
    }
}

/// The task's status version now, before an action that a watch must see applied.
fn version(client: &Client, task_id: TaskId) -> Result<i64, Error> {
    let task: TaskView = client.get(&format!("/v1/tasks/{task_id}"), &[])?.parse()?;
    Ok(task.version)
}

/// Prints what an action's answer says.
fn action(out: &mut dyn Write, json: bool, text: &str, accepted: &ActionAccepted) -> Result<(), Error> {
    if json {
        raw(out, text)?;
    } else if accepted.repeated {
        writeln!(out, "{} of task {}: asked before; nothing sent again", accepted.action, accepted.task_id)?;
    } else {
        writeln!(out, "{} of task {}: sent", accepted.action, accepted.task_id)?;
    }
    out.flush()?;
    Ok(())
}

/// Runs `fenceline-intake` with `args` (it reads FENCELINE_DATABASE_URL), passing on
/// its output and its failure.
fn intake_admin(admin: &IntakeAdmin, args: &[&str]) -> Result<Exit, Error> {
    let program = admin.intake_bin.clone().unwrap_or_else(|| {
        let beside = std::env::current_exe().ok().and_then(|exe| exe.parent().map(|d| d.join("fenceline-intake")));
        beside.filter(|p| p.exists()).unwrap_or_else(|| PathBuf::from("fenceline-intake"))
    });
    let status = std::process::Command::new(&program)
        .args(args)
        .status()
        .map_err(|e| Error::Usage(format!("cannot run {} (see --intake-bin): {e}", program.display())))?;
    if status.success() {
        Ok(Exit::Ok)
    } else {
        eprintln!("fenceline: {} {} failed ({status})", program.display(), args[0]);
        Ok(Exit::Failed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn input_is_a_json_object_from_text_or_a_file() {
        assert_eq!(read_input(r#"{"a":1}"#).expect("text"), json!({"a": 1}));
        let file = std::env::temp_dir().join(format!("fenceline-input-{}.json", uuid::Uuid::new_v4()));
        std::fs::write(&file, r#"{"prompt":"a red shoe"}"#).expect("write");
        let read = read_input(&format!("@{}", file.display()));
        let _ = std::fs::remove_file(&file);
        assert_eq!(read.expect("file"), json!({"prompt": "a red shoe"}));
        assert!(matches!(read_input("[1]"), Err(Error::Usage(_))));
        assert!(matches!(read_input("{nope"), Err(Error::Usage(_))));
        assert!(matches!(read_input("@/nonexistent/input.json"), Err(Error::Usage(_))));
    }

    #[test]
    fn approve_sends_the_signal_the_task_awaits_or_says_why_there_is_none() {
        let task = |state: &str, signal: Option<&str>| -> TaskView {
            serde_json::from_value(json!({
                "task_id": "0190e0b4-7c1c-7c44-a7a5-6a2f0b8a1f00", "kind": "ticket.triage", "state": state,
                "reason": null, "attempt": 1, "step": "approve", "phase": null, "next_attempt_at": null,
                "result": null, "case_id": null, "updated_at": "2026-12-01T12:00:00Z", "version": 3,
                "awaiting_signal": signal
            }))
            .expect("a task view")
        };
        let awaited = awaited_signal(&task("awaiting_approval", Some("refund_approved")), ApprovalDecision::Approve);
        assert_eq!(awaited.expect("awaited"), "refund_approved");
        let running = awaited_signal(&task("running", None), ApprovalDecision::Approve).expect_err("awaits none");
        assert_eq!(running.exit(), Exit::Usage);
        assert!(running.to_string().contains("awaits no signal now"), "{running}");
        let finished = awaited_signal(&task("succeeded", None), ApprovalDecision::Reject).expect_err("finished");
        assert_eq!(finished.exit(), Exit::Conflict);
        assert!(finished.to_string().contains("is already succeeded; nothing to reject"), "{finished}");
    }

    #[test]
    fn a_token_file_wins_and_loses_its_newline() {
        use secrecy::ExposeSecret as _;
        let file = std::env::temp_dir().join(format!("fenceline-token-{}", uuid::Uuid::new_v4()));
        std::fs::write(&file, "fl_from_file\n").expect("write");
        let read = token(Some(SecretString::from("fl_flag")), Some(&file));
        let _ = std::fs::remove_file(&file);
        assert_eq!(read.expect("read").expect("a token").expose_secret(), "fl_from_file");
        assert_eq!(token(None, None).expect("nothing").map(|t| t.expose_secret().to_owned()), None);
    }
}
