//! Intake's and the reconciler's answers as typed values, and how each is shown to a
//! person: aligned tables without borders.

use std::collections::BTreeMap;
use std::io::Write;

use comfy_table::{ContentArrangement, Table, presets};
use fenceline_domain::ids::TaskId;
use fenceline_domain::vocabulary::TaskState;
use serde::Deserialize;

use crate::Error;
use crate::terminal::Look;

/// A task as `GET /v1/tasks/{id}` and the list show it (docs/intake.md, "Read").
///
/// The JSON form of intake's `TaskView`, read rather than imported: the intake
/// crate brings actix-web and sqlx, and a client depends on the wire form only
/// (tests/tests/cli.rs reads real answers with it).
#[derive(Debug, Clone, Deserialize)]
pub struct TaskView {
    pub task_id: TaskId,
    pub kind: String,
    pub state: TaskState,
    pub reason: Option<String>,
    pub attempt: i32,
    pub step: Option<String>,
    pub phase: Option<String>,
    pub next_attempt_at: Option<String>,
    pub result: Option<serde_json::Value>,
    pub case_id: Option<String>,
    pub updated_at: String,
    pub version: i64,
    #[serde(default)]
    pub case: Option<CaseView>,
    #[serde(default)]
    pub attempts: Option<Vec<AttemptView>>,
    /// Single reads of a task in `awaiting_approval`: the signal its step waits for.
    #[serde(default)]
    pub awaiting_signal: Option<String>,
    /// Single reads: the input the task was submitted with.
    #[serde(default)]
    pub input: Option<serde_json::Value>,
    /// Single reads: what each finished step produced.
    #[serde(default)]
    pub steps: Option<Vec<StepOutput>>,
    /// Single reads of a task in `awaiting_approval`: the card of its wait.
    #[serde(default)]
    pub approval: Option<ApprovalCard>,
    /// Single reads: the cases people resolved.
    #[serde(default)]
    pub resolved_cases: Option<Vec<ResolvedCase>>,
    /// Single reads: the decisions people made about its waits.
    #[serde(default)]
    pub decisions: Option<Vec<DecisionView>>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct StepOutput {
    pub step: String,
    pub generation: i32,
    pub output: Option<serde_json::Value>,
    #[serde(default)]
    pub artifact_uri: Option<String>,
    pub output_ref: String,
    pub sha256: String,
    pub checkpointed_at: String,
    #[serde(default)]
    pub provider: Option<String>,
    /// In the currency's minor unit; absent when unpriced.
    #[serde(default)]
    pub cost_minor: Option<serde_json::Number>,
}

/// A request as the approval card shows it.
#[derive(Debug, Clone, Deserialize)]
pub struct RequestShown {
    pub method: String,
    pub path: String,
    pub body: Option<serde_json::Value>,
}

/// `GET /v1/spend`: a tenant's spend by UTC day and provider, and its budget.
#[derive(Debug, Clone, Deserialize)]
pub struct Spend {
    pub tenant: String,
    pub since: String,
    pub until: String,
    pub calls: i64,
    pub unpriced_calls: i64,
    pub cost_minor: serde_json::Number,
    pub by_day: Vec<SpendRow>,
    pub budget: Option<SpendBudget>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct SpendRow {
    pub day: String,
    pub provider: String,
    pub calls: i64,
    pub unpriced_calls: i64,
    pub cost_minor: serde_json::Number,
}

#[derive(Debug, Clone, Deserialize)]
pub struct SpendBudget {
    pub per_day_minor: serde_json::Number,
    pub spent_today_minor: serde_json::Number,
    pub spent: bool,
}

#[derive(Debug, Clone, Deserialize)]
pub struct NextStep {
    pub step: String,
    pub provider: String,
    pub operation: String,
    /// The request the step will send, at a provider with a dialect.
    #[serde(default)]
    pub request: Option<RequestShown>,
    #[serde(default)]
    pub request_error: Option<String>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct ApprovalCard {
    pub step: String,
    pub signal: String,
    pub generation: i32,
    pub digest: String,
    pub rests_on: Vec<StepOutput>,
    pub then: Vec<NextStep>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct DecisionView {
    pub step: String,
    pub generation: i32,
    pub signal: String,
    pub decision: String,
    pub decided_by: String,
    pub token_identity: String,
    pub note: Option<String>,
    pub digest: Option<String>,
    pub rests_on: serde_json::Value,
    pub decided_at: String,
}

/// The most bytes of one value `get` shows unless asked for all (`--full`).
pub const SHOWN_BYTES: usize = 4096;

/// A JSON value as a person reads it: indented, every control character escaped
/// (nothing from a task's input or a provider's output can move the cursor or
/// colour the terminal), cut at `limit` bytes with how much was left out.
pub fn json_shown(value: &serde_json::Value, limit: Option<usize>) -> String {
    let pretty = serde_json::to_string_pretty(value).unwrap_or_default();
    let mut escaped = String::with_capacity(pretty.len());
    for c in pretty.chars() {
        if c.is_control() && c != '\n' {
            escaped.push_str(&format!("\\u{:04x}", u32::from(c)));
        } else {
            escaped.push(c);
        }
    }
    match limit {
        Some(limit) if escaped.len() > limit => {
            let mut cut = limit;
            while !escaped.is_char_boundary(cut) {
                cut -= 1;
            }
            let left = escaped.len() - cut;
            format!("{}\n… {left} more bytes (--full shows all)", &escaped[..cut])
        }
        _ => escaped,
    }
}

fn indented(text: &str) -> String {
    text.lines().map(|l| format!("    {l}")).collect::<Vec<_>>().join("\n")
}

/// One step's output: the artifact's link for a file result, else the value.
fn step_output(out: &mut dyn Write, o: &StepOutput, limit: Option<usize>) -> Result<(), Error> {
    let cost = match (&o.provider, &o.cost_minor) {
        (Some(provider), Some(cost)) => format!(", {provider}, cost {cost}"),
        (Some(provider), None) => format!(", {provider}, unpriced"),
        _ => String::new(),
    };
    writeln!(out, "  {} (generation {}, {}{cost}):", o.step, o.generation, o.checkpointed_at)?;
    match (&o.artifact_uri, &o.output) {
        (Some(uri), _) => writeln!(out, "    artifact {uri} (sha256 {})", o.sha256)?,
        (None, Some(value)) => writeln!(out, "{}", indented(&json_shown(value, limit)))?,
        (None, None) => {
            writeln!(out, "    not shown (too large to travel); at {} (sha256 {})", o.output_ref, o.sha256)?
        }
    }
    Ok(())
}

/// What a task was given, what its steps produced, the card of the wait it is
/// at and the decisions made about its waits; each value cut at `limit` bytes.
pub fn decided_on(out: &mut dyn Write, task: &TaskView, limit: Option<usize>) -> Result<(), Error> {
    if let Some(input) = &task.input {
        writeln!(out, "\ninput:\n{}", indented(&json_shown(input, limit)))?;
    }
    if let Some(steps) = task.steps.as_ref().filter(|s| !s.is_empty()) {
        writeln!(out, "\nstep outputs:")?;
        for o in steps {
            step_output(out, o, limit)?;
        }
    }
    if let Some(card) = &task.approval {
        writeln!(out, "\napproval of step {} (generation {}), signal {}:", card.step, card.generation, card.signal)?;
        if card.then.is_empty() {
            writeln!(out, "  lets the task go on; no paid step follows before the next approval")?;
        }
        for next in &card.then {
            writeln!(out, "  lets run: {} at {} ({})", next.step, next.provider, next.operation)?;
            if let Some(request) = &next.request {
                writeln!(out, "    sends {} {}", request.method, request.path)?;
                if let Some(body) = &request.body {
                    writeln!(out, "{}", indented(&indented(&json_shown(body, limit))))?;
                }
            }
            if let Some(why) = &next.request_error {
                writeln!(out, "    its request cannot be built from what is known now: {why}")?;
            }
        }
        if card.rests_on.is_empty() {
            writeln!(out, "  rests on: no earlier output")?;
        }
        for o in &card.rests_on {
            write!(out, "  rests on")?;
            step_output(out, o, limit)?;
        }
        writeln!(out, "  digest {}", card.digest)?;
        writeln!(
            out,
            "  decide: fenceline approve|reject {} --as NAME [--note TEXT] --digest {}",
            task.task_id, card.digest
        )?;
    }
    if let Some(decisions) = task.decisions.as_ref().filter(|d| !d.is_empty()) {
        writeln!(out, "\ndecisions:")?;
        for d in decisions {
            let verb = if d.decision == "reject" { "rejected" } else { "approved" };
            writeln!(
                out,
                "  {}  step {} (generation {}) {verb} by {} [{}]",
                d.decided_at, d.step, d.generation, d.decided_by, d.token_identity
            )?;
            if let Some(note) = &d.note {
                writeln!(out, "    note: {}", json_shown(&serde_json::Value::String(note.clone()), limit))?;
            }
            writeln!(out, "    made on (digest {}):", d.digest.as_deref().unwrap_or("none named"))?;
            writeln!(out, "{}", indented(&indented(&json_shown(&d.rests_on, limit))))?;
        }
    }
    if let Some(resolved) = task.resolved_cases.as_ref().filter(|r| !r.is_empty()) {
        writeln!(
            out,
            "
resolved cases:"
        )?;
        for r in resolved {
            let token = r.token_identity.as_deref().map(|t| format!(" [{t}]")).unwrap_or_default();
            writeln!(
                out,
                "  {}  case {} resolved with {} by {}{token}",
                r.decided_at, r.case_id, r.action, r.decided_by
            )?;
            if let Some(note) = &r.note {
                writeln!(out, "    note: {}", json_shown(&serde_json::Value::String(note.clone()), limit))?;
            }
            if !r.evidence.is_empty() {
                writeln!(out, "    on the evidence:")?;
            }
            for e in &r.evidence {
                writeln!(out, "      {} ({}): {}", e.source, e.observed_at, e.finding)?;
            }
        }
    }
    Ok(())
}

/// A case a person resolved, as `get` shows it.
#[derive(Debug, Clone, Deserialize)]
pub struct ResolvedCase {
    pub case_id: String,
    pub action: String,
    pub decided_by: String,
    pub token_identity: Option<String>,
    pub note: Option<String>,
    pub decided_at: String,
    #[serde(default)]
    pub evidence: Vec<EvidenceView>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct CaseView {
    pub case_id: String,
    pub evidence: Vec<EvidenceView>,
    pub resolutions: BTreeMap<String, String>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct EvidenceView {
    pub source: String,
    pub observed_at: String,
    pub finding: String,
}

#[derive(Debug, Clone, Deserialize)]
pub struct AttemptView {
    pub attempt: i32,
    pub outcome: String,
    pub error_class: Option<String>,
    pub detail: Option<String>,
    pub money_may_have_been_spent: Option<bool>,
    pub recovery: Option<String>,
    pub started_at: Option<String>,
    pub ended_at: Option<String>,
}

/// One page of `GET /v1/tasks`.
#[derive(Debug, Clone, Deserialize)]
pub struct Page {
    pub tasks: Vec<TaskView>,
    pub next_cursor: Option<String>,
}

/// The answer to a submission.
#[derive(Debug, Clone, Deserialize)]
pub struct Accepted {
    pub task_id: TaskId,
    pub status_url: String,
}

/// The answer to cancel, a signal and a resolution.
#[derive(Debug, Clone, Deserialize)]
pub struct ActionAccepted {
    pub task_id: TaskId,
    pub action: String,
    pub repeated: bool,
}

/// One finding of the reconciler's audit.
#[derive(Debug, Clone, Deserialize)]
pub struct Finding {
    pub task_id: TaskId,
    pub finding: String,
    pub state: String,
    pub detail: String,
}

#[derive(Debug, Clone, Deserialize)]
pub struct Findings {
    pub findings: Vec<Finding>,
}

/// Whether a task's state is one `watch` stops at: final, or waiting for a person.
pub fn ends_watch(state: TaskState) -> bool {
    match state {
        TaskState::Succeeded
        | TaskState::Failed
        | TaskState::Cancelled
        | TaskState::AwaitingApproval
        | TaskState::OutcomeUnknown
        | TaskState::NeedsHuman => true,
        TaskState::Queued | TaskState::Waiting | TaskState::Running => false,
    }
}

fn new_table() -> Table {
    let mut table = Table::new();
    table.load_style(presets::NOTHING).set_content_arrangement(ContentArrangement::Disabled);
    table
}

fn text(value: &Option<String>) -> &str {
    value.as_deref().unwrap_or("-")
}

fn write_table(out: &mut dyn Write, table: &Table) -> Result<(), Error> {
    for line in table.lines() {
        writeln!(out, "{}", line.trim_end())?;
    }
    Ok(())
}

/// Where the step is: `step/phase`, `step`, or `-`.
pub fn position(task: &TaskView) -> String {
    match (&task.step, &task.phase) {
        (Some(step), Some(phase)) => format!("{step}/{phase}"),
        (Some(step), None) => step.clone(),
        _ => "-".into(),
    }
}

/// A tenant's spend: the total, its budget, then one line per day and provider.
pub fn spend(out: &mut dyn Write, spend: &Spend) -> Result<(), Error> {
    writeln!(
        out,
        "{}: {} calls, cost {} (minor unit) from {} to {}",
        spend.tenant, spend.calls, spend.cost_minor, spend.since, spend.until
    )?;
    if spend.unpriced_calls > 0 {
        writeln!(out, "{} of the calls have no price in the catalogue and count nothing", spend.unpriced_calls)?;
    }
    if let Some(budget) = &spend.budget {
        let state = if budget.spent { "spent: new paid calls wait" } else { "new paid calls run" };
        writeln!(out, "budget: {} of {} today (UTC); {state}", budget.spent_today_minor, budget.per_day_minor)?;
    }
    let mut table = new_table();
    table.set_header(["DAY", "PROVIDER", "CALLS", "UNPRICED", "COST"]);
    for row in &spend.by_day {
        table.add_row([
            row.day.clone(),
            row.provider.clone(),
            row.calls.to_string(),
            row.unpriced_calls.to_string(),
            row.cost_minor.to_string(),
        ]);
    }
    write_table(out, &table)
}

/// Tasks, one line each, as `look` says: short ids and relative times unless wide,
/// states in colour on a terminal, lines cut to its width.
pub fn tasks(out: &mut dyn Write, tasks: &[TaskView], look: Look) -> Result<(), Error> {
    let now = time::OffsetDateTime::now_utc();
    let mut table = new_table();
    table.set_header(["TASK", "KIND", "STATE", "ATTEMPT", "STEP", "UPDATED", "REASON"]);
    for task in tasks {
        table.add_row([
            look.task_id(&task.task_id.to_string()),
            task.kind.clone(),
            task.state.to_string(),
            task.attempt.to_string(),
            position(task),
            look.instant(&task.updated_at, now),
            text(&task.reason).to_owned(),
        ]);
    }
    // Coloured after the table is laid out: escape sequences take no room.
    let mut lines = table.lines();
    if let Some(header) = lines.next() {
        writeln!(out, "{}", look.fit(header.trim_end()))?;
    }
    for (line, task) in lines.zip(tasks) {
        let state = task.state.as_str();
        let line = line.replacen(&format!(" {state} "), &format!(" {} ", look.state(task.state)), 1);
        writeln!(out, "{}", look.fit(line.trim_end()))?;
    }
    Ok(())
}

/// One task in full: its fields, its result, its attempts and its case.
pub fn task(out: &mut dyn Write, task: &TaskView) -> Result<(), Error> {
    let mut fields = new_table();
    let result = task.result.as_ref().map(|r| {
        format!(
            "{} (sha256 {}, {} bytes)",
            r["uri"].as_str().unwrap_or("?"),
            r["sha256"].as_str().unwrap_or("?"),
            r["size_bytes"].as_i64().map_or("?".into(), |n| n.to_string())
        )
    });
    for (name, value) in [
        ("task", task.task_id.to_string()),
        ("kind", task.kind.clone()),
        ("state", task.state.to_string()),
        ("reason", text(&task.reason).to_owned()),
        ("attempt", task.attempt.to_string()),
        ("step", position(task)),
        ("next attempt", text(&task.next_attempt_at).to_owned()),
        ("result", text(&result).to_owned()),
        ("case", text(&task.case_id).to_owned()),
        ("updated", task.updated_at.clone()),
        ("version", task.version.to_string()),
    ] {
        fields.add_row([name.to_owned(), value]);
    }
    if let Some(signal) = &task.awaiting_signal {
        fields.add_row(["awaiting signal".to_owned(), signal.clone()]);
    }
    write_table(out, &fields)?;
    if let Some(attempts) = task.attempts.as_ref().filter(|a| !a.is_empty()) {
        writeln!(out, "\nattempts:")?;
        let mut table = new_table();
        table.set_header([
            "ATTEMPT",
            "OUTCOME",
            "ERROR",
            "MONEY MAY BE SPENT",
            "RECOVERY",
            "STARTED",
            "ENDED",
            "DETAIL",
        ]);
        for a in attempts {
            table.add_row([
                a.attempt.to_string(),
                a.outcome.clone(),
                text(&a.error_class).to_owned(),
                a.money_may_have_been_spent.map_or("-".into(), |m| if m { "yes" } else { "no" }.to_owned()),
                text(&a.recovery).to_owned(),
                text(&a.started_at).to_owned(),
                text(&a.ended_at).to_owned(),
                text(&a.detail).to_owned(),
            ]);
        }
        write_table(out, &table)?;
    }
    if let Some(case) = &task.case {
        writeln!(out, "\ncase {} evidence:", case.case_id)?;
        let mut table = new_table();
        table.set_header(["OBSERVED", "SOURCE", "FINDING"]);
        for e in &case.evidence {
            table.add_row([e.observed_at.clone(), e.source.clone(), e.finding.clone()]);
        }
        write_table(out, &table)?;
        writeln!(out, "\nresolutions (fenceline resolve {} ACTION --case {}):", task.task_id, case.case_id)?;
        let mut table = new_table();
        for (action, effect) in &case.resolutions {
            table.add_row([action.replace('_', "-"), effect.clone()]);
        }
        write_table(out, &table)?;
    }
    Ok(())
}

/// The audit's findings.
pub fn findings(out: &mut dyn Write, findings: &[Finding]) -> Result<(), Error> {
    if findings.is_empty() {
        writeln!(out, "no findings")?;
        return Ok(());
    }
    let mut table = new_table();
    table.set_header(["TASK", "FINDING", "STATE", "DETAIL"]);
    for f in findings {
        table.add_row([f.task_id.to_string(), f.finding.clone(), f.state.clone(), f.detail.clone()]);
    }
    write_table(out, &table)
}

/// The line `watch` prints for a change.
pub fn change(task: &TaskView) -> String {
    format!(
        "{}  {}  {:<17}  attempt {}  {}  {}",
        task.updated_at,
        task.task_id,
        task.state.as_str(),
        task.attempt,
        position(task),
        text(&task.reason)
    )
}

/// What a person can do next with a task that waits for one, as a command line
/// that runs as printed: the signal the task awaits, the case it shows.
pub fn next_step(task: &TaskView) -> Option<String> {
    let id = task.task_id;
    match task.state {
        TaskState::AwaitingApproval => Some(match &task.awaiting_signal {
            Some(signal) => format!(
                "read what it rests on with `fenceline get {id}`, then decide: \
                 fenceline approve|reject {id} --signal {signal} --as NAME"
            ),
            // A listing does not say which signal; `approve` reads it from the task.
            None => format!(
                "read what it rests on with `fenceline get {id}`, then decide: fenceline approve|reject {id} --as NAME"
            ),
        }),
        TaskState::OutcomeUnknown | TaskState::NeedsHuman => {
            let case = task.case_id.as_deref().or(task.case.as_ref().map(|c| c.case_id.as_str()));
            Some(match case {
                Some(case) => format!(
                    "read its case with `fenceline get {id}`, then: \
                     fenceline resolve {id} accept-failed|retry-as-new|attach-result --case {case}"
                ),
                None => format!("read its case with `fenceline get {id}`: it names the case to resolve"),
            })
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn view(json: serde_json::Value) -> TaskView {
        serde_json::from_value(json).expect("a task view")
    }

    fn sample() -> serde_json::Value {
        serde_json::json!({
            "task_id": "0190e0b4-7c1c-7c44-a7a5-6a2f0b8a1f00", "kind": "image.generate", "state": "outcome_unknown",
            "reason": "no one can ask", "attempt": 1, "step": "render", "phase": "call_intent",
            "next_attempt_at": null, "result": null, "case_id": "case-1", "updated_at": "2026-12-01T12:00:00Z",
            "version": 4,
            "case": {"case_id": "case-1", "evidence": [{"source": "executor", "observed_at": "2026-12-01T12:00:00Z",
                     "finding": "last durable phase call_intent"}],
                     "resolutions": {"accept_failed": "ends it as failed", "retry_as_new": "may bill again"}},
            "attempts": [{"attempt": 1, "outcome": "lost", "error_class": null, "detail": "call_intent",
                          "money_may_have_been_spent": null, "recovery": "outcome_unknown",
                          "started_at": "2026-12-01T11:59:59Z", "ended_at": null}]
        })
    }

    #[test]
    fn a_task_shows_its_case_and_how_to_resolve_it() {
        let task = view(sample());
        let mut out = Vec::new();
        super::task(&mut out, &task).expect("written");
        let shown = String::from_utf8(out).expect("utf-8");
        assert!(shown.contains("outcome_unknown") && shown.contains("render/call_intent"), "{shown}");
        assert!(shown.contains("last durable phase call_intent"), "{shown}");
        assert!(shown.contains("retry-as-new") && shown.contains("--case case-1"), "{shown}");
        assert!(next_step(&task).is_some_and(|s| s.contains("--case case-1")));
    }

    #[test]
    fn the_next_step_names_the_signal_the_task_awaits() {
        let mut sample = sample();
        sample["state"] = "awaiting_approval".into();
        sample["awaiting_signal"] = "refund_approved".into();
        let task = view(sample.clone());
        let hint = next_step(&task).expect("a hint");
        assert!(hint.ends_with(&format!("{} --signal refund_approved --as NAME", task.task_id)), "{hint}");
        let mut out = Vec::new();
        super::task(&mut out, &task).expect("written");
        assert!(String::from_utf8(out).expect("utf-8").contains("refund_approved"), "shown by get");
        sample.as_object_mut().expect("object").remove("awaiting_signal");
        let hint = next_step(&view(sample)).expect("a hint");
        assert!(hint.ends_with(&format!("fenceline approve|reject {} --as NAME", task.task_id)), "{hint}");
    }

    #[test]
    fn what_a_person_decides_on_is_shown_escaped_and_bounded() {
        let mut sample = sample();
        sample["state"] = "awaiting_approval".into();
        sample["input"] = serde_json::json!({"ticket": "T-1\u{1b}[31mred", "amount": 12});
        sample["steps"] = serde_json::json!([
            {"step": "draft", "generation": 0, "output": {"text": "x".repeat(10_000)}, "output_ref": "r",
             "sha256": "ab", "checkpointed_at": "2026-12-01T12:00:00.123Z"},
            {"step": "render", "generation": 0, "output": {"uri": "https://f/a.png", "sha256": "cd", "size_bytes": 3},
             "artifact_uri": "https://f/a.png", "output_ref": "r2", "sha256": "cd",
             "checkpointed_at": "2026-12-01T12:00:01Z"}
        ]);
        sample["approval"] = serde_json::json!({"step": "approve", "signal": "refund_approved", "generation": 0,
            "digest": "d1", "rests_on": [], "then": [{"step": "refund", "provider": "payments", "operation": "refund",
                "request": {"method": "POST", "path": "/v1/refunds", "body": {"amount": "1250", "payment_intent": "pi_1"}}}]});
        let task = view(sample);
        let mut out = Vec::new();
        decided_on(&mut out, &task, Some(SHOWN_BYTES)).expect("written");
        let shown = String::from_utf8(out).expect("utf-8");
        assert!(!shown.contains('\u{1b}') && shown.contains("\\u001b[31mred"), "escaped: {shown}");
        assert!(shown.contains("more bytes (--full shows all)") && shown.len() < 6_000, "bounded");
        assert!(shown.contains("artifact https://f/a.png"), "{shown}");
        assert!(shown.contains("lets run: refund at payments (refund)") && shown.contains("--digest d1"), "{shown}");
        assert!(shown.contains("sends POST /v1/refunds") && shown.contains("\"amount\": \"1250\""), "{shown}");
        let mut out = Vec::new();
        decided_on(&mut out, &task, None).expect("written");
        assert!(String::from_utf8(out).expect("utf-8").contains(&"x".repeat(10_000)), "--full shows all");
    }

    #[test]
    fn watch_stops_at_final_states_and_where_a_person_must_act() {
        let stops: Vec<&str> = TaskState::ALL.iter().filter(|s| ends_watch(**s)).map(|s| s.as_str()).collect();
        assert_eq!(stops, ["succeeded", "failed", "cancelled", "awaiting_approval", "outcome_unknown", "needs_human"]);
    }

    #[test]
    fn a_list_is_one_line_per_task() {
        let mut sample = sample();
        sample.as_object_mut().expect("object").remove("case");
        let tasks = [view(sample.clone()), view(sample)];
        let mut out = Vec::new();
        super::tasks(&mut out, &tasks, Look::PLAIN).expect("written");
        assert_eq!(String::from_utf8(out).expect("utf-8").lines().count(), 3, "a header and two lines");
        let narrow = Look { colour: true, wide: false, width: Some(60) };
        let mut out = Vec::new();
        super::tasks(&mut out, &tasks, narrow).expect("written");
        let shown = String::from_utf8(out).expect("utf-8");
        let id = tasks[0].task_id.to_string();
        assert!(shown.contains(&id[id.len() - 12..]) && !shown.contains(&id), "a short id: {shown}");
        assert!(shown.contains("\u{1b}["), "the state in colour: {shown}");
        assert!(shown.lines().all(|l| l.ends_with('…') || l.chars().count() <= 60), "cut to the width: {shown}");
    }
}
