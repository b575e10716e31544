//! The command line: the options every command shares (where intake is, its token,
//! `--json`) and each command's own, with their environment variables.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};
use fenceline_domain::ids::TaskId;
use fenceline_domain::vocabulary::{Priority, ResolutionAction, TaskState};
use secrecy::SecretString;

const EXIT_CODES: &str = "\
Exit codes:
  0  done (watch: the task succeeded; resolve --watch: it reached the outcome chosen)
  1  anything else (an answer that could not be read)
  2  bad command line or input, or a request intake refused as malformed (400, 413, 415, 422, 431)
  3  no such task for this tenant (404)
  4  conflict (409, such as a task already finished; an Idempotency-Key reused for a different request)
  5  no valid token (401)
  6  the service is unreachable or failed (5xx, refused connection, time-out)
  7  a watched task ended otherwise, or waits for a person
  8  watch --timeout-s ran out; the task goes on";

/// `fenceline`: submit, read, follow and act on Fenceline tasks through intake's API.
#[derive(Debug, Parser)]
#[command(name = "fenceline", version, after_help = EXIT_CODES)]
pub struct Cli {
    #[command(flatten)]
    pub intake: IntakeArgs,
    /// Print the service's answers as JSON, unchanged, instead of tables.
    #[arg(long, global = true)]
    pub json: bool,
    /// Full task ids and instants in tables, instead of short ids and times ago.
    #[arg(long, global = true)]
    pub wide: bool,
    #[command(subcommand)]
    pub command: Command,
}

/// Where intake is and the token that names the tenant.
#[derive(Debug, Args)]
pub struct IntakeArgs {
    /// Intake's base URL.
    #[arg(long, env = "FENCELINE_URL", default_value = "http://127.0.0.1:58080", global = true)]
    pub url: String,
    /// The tenant's API token (`fenceline-intake create-token`); never printed.
    /// Prefer --token-file: a flag shows in the process list.
    #[arg(long, env = "FENCELINE_TOKEN", hide_env_values = true, value_parser = parse_secret, global = true)]
    pub token: Option<SecretString>,
    /// A file holding the token (its trailing newline is dropped); wins over --token.
    #[arg(long, env = "FENCELINE_TOKEN_FILE", global = true)]
    pub token_file: Option<PathBuf>,
    /// How long one HTTP exchange may take, in seconds.
    #[arg(long, default_value_t = 30, global = true)]
    pub request_timeout_s: u64,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Submits a task, once per idempotency key; prints its id.
    ///
    /// Without --idempotency-key a key is generated and printed (on stderr): submit
    /// again with that key to be sure the task is created once, for example after a
    /// time-out. The same key with a different request is refused (exit 4).
    Submit(SubmitArgs),
    /// Reads one task: its state and why, its input and its steps' outputs, the
    /// card of the approval it waits for, the decisions made, its attempts, its
    /// result, its case. Each value is cut at 4 KiB unless --full.
    Get {
        task_id: TaskId,
        /// Show every value whole, however long.
        #[arg(long)]
        full: bool,
    },
    /// Lists the tenant's tasks, newest first, with intake's filters.
    List(ListArgs),
    /// Follows one task, or every task with a label, printing each change until it
    /// succeeds, fails, is cancelled or waits for a person.
    ///
    /// Intake offers neither an event stream nor ETags, so watch polls
    /// `GET /v1/tasks/{id}` (or, for a label, `GET /v1/tasks?label=`) every
    /// --interval-ms and prints a line whenever the task's status version, state,
    /// reason, attempt, step or phase changed. Exit 0 when the task (every task with
    /// the label) succeeded, 7 when one ended otherwise or waits for a person, 8
    /// when --timeout-s ran out. While intake is unreachable it keeps trying.
    Watch(WatchArgs),
    /// Asks for a task to be cancelled: at once if nothing runs, cooperatively if
    /// an attempt runs. Asking again changes nothing.
    Cancel { task_id: TaskId },
    /// Approves one wait of a task's approval step, as a named person, bound to
    /// the card `get` shows (the step, the generation and the digest of what it
    /// rests on).
    ///
    /// Without --signal or --step, the wait the task is at now; a task that awaits
    /// none is refused here (exit 2, or 4 if it finished). Given ahead of its wait
    /// (--signal or --step), the approval is kept for that wait only. A card that
    /// changed since it was read (--digest) is refused, naming what changed (exit 4).
    Approve(ApproveArgs),
    /// Rejects one wait of a task's approval step, as `approve` names it: the task
    /// ends failed, rejected by a person, and no step after the wait runs.
    Reject(ApproveArgs),
    /// Resolves the case of a task in outcome_unknown or needs_human, naming the
    /// case that `get` showed.
    ///
    /// With --watch, exit 0 when the task reaches the outcome chosen (accept-failed:
    /// failed; retry-as-new and attach-result: succeeded), 7 when it stops otherwise.
    Resolve(ResolveArgs),
    /// What the tenant's paid calls cost, by UTC day and provider, and its daily
    /// budget (`GET /v1/spend`); amounts in the currency's minor unit.
    Spend {
        /// Calls checkpointed at or after this instant: RFC 3339, or a span back from now
        /// (`1h`, `7d`; default: the last 30 UTC days).
        #[arg(long)]
        since: Option<String>,
        /// Calls checkpointed before this instant: RFC 3339, or a span back from now (default: now).
        #[arg(long)]
        until: Option<String>,
    },
    /// Prints a completion script for SHELL: `fenceline completions bash >
    /// /etc/bash_completion.d/fenceline`, or `source <(fenceline completions zsh)`.
    Completions {
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
    /// Lists what the reconciler's audit found: tasks without progress or without a
    /// live expectation (`GET /v1/audit`, with the audit token).
    Audit(AuditArgs),
    /// API tokens: check the one configured; create and revoke through
    /// `fenceline-intake` (intake has no token endpoint: tokens live in its database).
    #[command(subcommand)]
    Tokens(TokensCommand),
}

#[derive(Debug, Args)]
pub struct SubmitArgs {
    /// The task kind, such as image.generate.
    pub kind: String,
    /// The input, a JSON object: the text itself, `@FILE`, or `-` for standard input.
    pub input: String,
    /// A label, KEY=VALUE; repeat for more.
    #[arg(long = "label", value_parser = parse_label)]
    pub labels: Vec<(String, String)>,
    /// high, normal (intake's default) or low.
    #[arg(long)]
    pub priority: Option<Priority>,
    /// No attempt starts after this instant (RFC 3339).
    #[arg(long)]
    pub deadline: Option<String>,
    /// No attempt starts before this instant (RFC 3339).
    #[arg(long)]
    pub not_before: Option<String>,
    /// The submission's identity: 1 to 255 visible ASCII characters. Generated
    /// (and printed) when not given.
    #[arg(long, short = 'k', value_parser = parse_key)]
    pub idempotency_key: Option<String>,
    /// Then follow the task as `watch` does (and exit as it does).
    #[arg(long)]
    pub watch: bool,
    #[command(flatten)]
    pub polling: Polling,
}

#[derive(Debug, Args)]
pub struct ListArgs {
    /// Only tasks in this state.
    #[arg(long)]
    pub state: Option<TaskState>,
    /// Only tasks of this kind.
    #[arg(long)]
    pub kind: Option<String>,
    /// Only tasks with this label, KEY=VALUE.
    #[arg(long, value_parser = parse_label_filter)]
    pub label: Option<String>,
    /// Accepted at or after this instant: RFC 3339, or a span back from now (`30m`, `1h`, `2d`).
    #[arg(long)]
    pub since: Option<String>,
    /// Accepted before this instant: RFC 3339, or a span back from now.
    #[arg(long)]
    pub until: Option<String>,
    /// Tasks per page, 1 to 200 (intake's default is 50).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=200))]
    pub limit: Option<u32>,
    /// Start at this page (`next_cursor` of the previous one).
    #[arg(long, conflicts_with = "all")]
    pub cursor: Option<String>,
    /// Follow the cursors and list every page.
    #[arg(long)]
    pub all: bool,
}

#[derive(Debug, Args)]
#[group(id = "target", required = true, multiple = false, args = ["task_id", "label"])]
pub struct WatchArgs {
    /// The task to follow.
    pub task_id: Option<TaskId>,
    /// Follow every task with this label, KEY=VALUE, until each has ended.
    #[arg(long, value_parser = parse_label_filter)]
    pub label: Option<String>,
    #[command(flatten)]
    pub polling: Polling,
}

/// How `watch` reads: at each change intake's event stream announces, else by polling.
#[derive(Debug, Clone, Copy, Args)]
pub struct Polling {
    /// Time between two reads where intake's event stream does not answer, in
    /// milliseconds (at least 100); a label's tasks are read at most this often.
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u64).range(100..))]
    pub interval_ms: u64,
    /// Stop watching after this many seconds (exit 8); the task goes on.
    #[arg(long)]
    pub timeout_s: Option<u64>,
}

#[derive(Debug, Args)]
pub struct ApproveArgs {
    pub task_id: TaskId,
    /// The signal the wait takes, such as refund_approved; by default the one the task awaits.
    #[arg(long)]
    pub signal: Option<String>,
    /// The approval step whose wait this decides; by default the one the task is at.
    #[arg(long)]
    pub step: Option<String>,
    /// Who decides: the person's name, recorded beside the token's identity.
    #[arg(long = "as", value_name = "NAME")]
    pub decided_by: String,
    /// Why, in the person's words; kept with the decision.
    #[arg(long)]
    pub note: Option<String>,
    /// The digest of the approval card the person read (`get` prints it); by
    /// default the card's digest as it is now, which this command prints.
    #[arg(long)]
    pub digest: Option<String>,
    /// Then follow the task as `watch` does, past the wait this decision ends.
    #[arg(long)]
    pub watch: bool,
    #[command(flatten)]
    pub polling: Polling,
}

#[derive(Debug, Args)]
pub struct ResolveArgs {
    pub task_id: TaskId,
    /// What to do with the case.
    #[arg(value_enum)]
    pub action: Resolution,
    /// The case being resolved: `case_id` as `get` shows it. If the task shows
    /// another case by now, intake refuses (exit 4): read it again.
    #[arg(long = "case")]
    pub case_id: String,
    /// Required for retry-as-new: the new operation may be charged by the provider
    /// a second time.
    #[arg(long)]
    pub i_accept_a_second_charge: bool,
    /// attach-result: where the result found elsewhere is.
    #[arg(long, required_if_eq("action", "attach-result"))]
    pub uri: Option<String>,
    /// attach-result: its sha256, lower-case hex.
    #[arg(long, required_if_eq("action", "attach-result"))]
    pub sha256: Option<String>,
    /// attach-result: its size in bytes.
    #[arg(long, required_if_eq("action", "attach-result"))]
    pub size_bytes: Option<u64>,
    /// Who decides: a person's name, recorded beside the token's identity.
    #[arg(long = "as", value_name = "NAME")]
    pub decided_by: Option<String>,
    /// Why, in your words; kept with the resolution.
    #[arg(long)]
    pub note: Option<String>,
    /// Then follow the task as `watch` does, past the case this resolves.
    #[arg(long)]
    pub watch: bool,
    #[command(flatten)]
    pub polling: Polling,
}

/// The resolutions intake offers (docs/intake.md, "Act").
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Resolution {
    /// Run the step in doubt again: under its own key at a provider that dedupes (work
    /// already done is not billed again), elsewhere as a new operation the provider
    /// may bill again.
    RetryAsNew,
    /// Accept the task as failed; nothing runs again.
    AcceptFailed,
    /// Finish the task with a result found elsewhere (--uri, --sha256, --size-bytes).
    AttachResult,
}

impl Resolution {
    pub fn action(self) -> ResolutionAction {
        match self {
            Resolution::RetryAsNew => ResolutionAction::RetryAsNew,
            Resolution::AcceptFailed => ResolutionAction::AcceptFailed,
            Resolution::AttachResult => ResolutionAction::AttachResult,
        }
    }

    /// The final state the person chose: what `resolve --watch` waits to see.
    pub fn outcome(self) -> TaskState {
        match self {
            Resolution::AcceptFailed => TaskState::Failed,
            Resolution::RetryAsNew | Resolution::AttachResult => TaskState::Succeeded,
        }
    }
}

#[derive(Debug, Args)]
pub struct AuditArgs {
    /// The reconciler's base URL.
    #[arg(long, env = "FENCELINE_RECONCILER_URL", default_value = "http://127.0.0.1:58083")]
    pub reconciler_url: String,
    /// The reconciler's audit token (`FENCELINE_RECONCILER_AUDIT_TOKEN` of the
    /// reconciler); never printed. Not needed for a reconciler on loopback without one.
    #[arg(long, env = "FENCELINE_RECONCILER_AUDIT_TOKEN", hide_env_values = true, value_parser = parse_secret)]
    pub audit_token: Option<SecretString>,
    /// A file holding that token; wins over --audit-token.
    #[arg(long, env = "FENCELINE_RECONCILER_AUDIT_TOKEN_FILE")]
    pub audit_token_file: Option<PathBuf>,
}

#[derive(Debug, Subcommand)]
pub enum TokensCommand {
    /// Checks that intake accepts the configured token (exit 0), or not (exit 5).
    Check,
    /// Creates a token for a tenant (and the tenant if needed) by running
    /// `fenceline-intake create-token` against intake's database
    /// (FENCELINE_DATABASE_URL); prints it once.
    Create {
        #[arg(long)]
        tenant: String,
        #[arg(long, default_value = "")]
        label: String,
        #[command(flatten)]
        admin: IntakeAdmin,
    },
    /// Revokes a token by its id, through `fenceline-intake revoke-token`.
    Revoke {
        #[arg(long)]
        token_id: uuid::Uuid,
        #[command(flatten)]
        admin: IntakeAdmin,
    },
}

/// The intake binary that administers tokens.
#[derive(Debug, Args)]
pub struct IntakeAdmin {
    /// `fenceline-intake`: by default the one beside this program, else on PATH.
    #[arg(long, env = "FENCELINE_INTAKE_BIN")]
    pub intake_bin: Option<PathBuf>,
}

fn parse_secret(raw: &str) -> Result<SecretString, String> {
    if raw.is_empty() {
        return Err("a token may not be empty".into());
    }
    Ok(SecretString::from(raw))
}

/// An idempotency key as intake takes it: 1 to 255 visible ASCII characters.
pub fn parse_key(raw: &str) -> Result<String, String> {
    if raw.is_empty() || raw.len() > 255 || !raw.bytes().all(|b| b.is_ascii_graphic()) {
        return Err("a key is 1 to 255 visible ASCII characters".into());
    }
    Ok(raw.to_owned())
}

fn parse_label(raw: &str) -> Result<(String, String), String> {
    let (key, value) = raw.split_once('=').ok_or("expected KEY=VALUE")?;
    if key.is_empty() {
        return Err("a label's key may not be empty".into());
    }
    Ok((key.to_owned(), value.to_owned()))
}

/// A label filter, KEY=VALUE, in intake's `key:value` form.
fn parse_label_filter(raw: &str) -> Result<String, String> {
    let (key, value) = parse_label(raw)?;
    if key.contains(':') {
        return Err("a label filter's key may not contain `:`".into());
    }
    Ok(format!("{key}:{value}"))
}

#[cfg(test)]
mod tests {
    use clap::Parser as _;

    use super::*;

    #[test]
    fn the_command_line_is_consistent() {
        use clap::CommandFactory as _;
        Cli::command().debug_assert();
    }

    #[test]
    fn labels_and_filters_parse() {
        assert_eq!(parse_label("team=growth=2"), Ok(("team".into(), "growth=2".into())));
        assert!(parse_label("=x").is_err() && parse_label("nolabel").is_err());
        assert_eq!(parse_label_filter("team=growth"), Ok("team:growth".into()));
        assert!(parse_label_filter("a:b=c").is_err());
    }

    #[test]
    fn keys_are_visible_ascii() {
        assert!(parse_key("order-1/v2").is_ok());
        for bad in ["", "with space", "ü", &"k".repeat(256)] {
            assert!(parse_key(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn retry_as_new_and_attach_result_take_their_flags() {
        let id = TaskId::new_v7().to_string();
        let parsed = Cli::try_parse_from(["fenceline", "resolve", &id, "attach-result", "--case", "c"]);
        assert!(parsed.is_err(), "attach-result needs its result");
        let parsed = Cli::try_parse_from([
            "fenceline",
            "resolve",
            &id,
            "retry-as-new",
            "--case",
            "c",
            "--i-accept-a-second-charge",
        ])
        .expect("parses");
        let Command::Resolve(resolve) = parsed.command else { panic!("resolve") };
        assert!(resolve.i_accept_a_second_charge);
        assert_eq!(resolve.action.action(), ResolutionAction::RetryAsNew);
    }

    #[test]
    fn each_resolution_is_watched_for_the_outcome_it_chooses() {
        assert_eq!(Resolution::AcceptFailed.outcome(), TaskState::Failed);
        assert_eq!(Resolution::RetryAsNew.outcome(), TaskState::Succeeded);
        assert_eq!(Resolution::AttachResult.outcome(), TaskState::Succeeded);
    }
}
