//! The Monday-morning demo against a running local stack: a weekend's backlog of
//! support tickets arrives through the upstream topic and signed webhooks (some
//! delivered twice), image jobs through the API with idempotency keys (some
//! submitted twice), the image provider throttles for a while and drops one answer
//! after doing the work, the executor is killed in the middle, two refunds wait for
//! an approval the demo then gives, and one text message to a customer is sent by a
//! provider that can neither dedupe nor be asked and whose answer is lost: its
//! outcome is unknown and stays so. It prints progress, then a table of what
//! happened and what each provider charged, judged by the providers' own ledgers,
//! and ends with the dashboard's address, where a person decides that case.

#![allow(clippy::print_stdout)]

use std::collections::{BTreeMap, HashSet};
use std::process::Command;
use std::time::{Duration, Instant};

use anyhow::{Context as _, bail};
use clap::Parser;
use fenceline_domain::vocabulary::Priority;
use fenceline_events::{Event, TaskRequest, encode_record};
use hmac::{Hmac, Mac};
use rdkafka::ClientConfig;
use rdkafka::message::{Header, OwnedHeaders};
use rdkafka::producer::{FutureProducer, FutureRecord};
use serde_json::{Value, json};
use sha2::Sha256;

#[derive(Debug, Parser)]
#[command(name = "fenceline-demo", about = "Plays the Monday-morning scenario against the local stack")]
struct Config {
    #[arg(long, env = "DEMO_INTAKE_URL", default_value = "http://127.0.0.1:58080")]
    intake: String,
    /// The demo tenant's API token.
    #[arg(long, env = "DEMO_TOKEN")]
    token: String,
    #[arg(long, env = "DEMO_KAFKA_BROKERS", default_value = "127.0.0.1:59092")]
    brokers: String,
    /// The signing secret of the `helpdesk` webhook source.
    #[arg(long, env = "DEMO_WEBHOOK_SECRET")]
    webhook_secret: String,
    /// Fake providers as name=url, comma separated.
    #[arg(long, env = "DEMO_PROVIDERS", value_delimiter = ',')]
    providers: Vec<String>,
    /// File holding the executor's process id (the demo kills it in the middle).
    #[arg(long, env = "DEMO_EXECUTOR_PIDFILE")]
    executor_pidfile: std::path::PathBuf,
    /// Command that starts whatever of the stack is not running.
    #[arg(long, env = "DEMO_RESTART", default_value = "deploy/local/stack up")]
    restart: String,
    /// Tickets over the weekend, half through the topic, half through webhooks.
    #[arg(long, env = "DEMO_TICKETS", default_value_t = 300)]
    tickets: usize,
    #[arg(long, env = "DEMO_IMAGES", default_value_t = 40)]
    images: usize,
    #[arg(long, env = "DEMO_TIMEOUT_S", default_value_t = 600)]
    timeout_s: u64,
}

fn agent() -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_global(Some(Duration::from_secs(15)))
        .build()
        .new_agent()
}

fn json_of(mut response: ureq::http::Response<ureq::Body>) -> (u16, Value) {
    let status = response.status().as_u16();
    let body = response.body_mut().read_to_string().unwrap_or_default();
    (status, serde_json::from_str(&body).unwrap_or(Value::Null))
}

struct Demo {
    config: Config,
    agent: ureq::Agent,
    run: String,
    started: time::OffsetDateTime,
}

impl Demo {
    fn api(&self, method: &str, path: &str, key: Option<&str>, body: Option<Value>) -> anyhow::Result<(u16, Value)> {
        let url = format!("{}{path}", self.config.intake);
        let mut request = ureq::http::Request::builder()
            .method(method)
            .uri(&url)
            .header("Authorization", format!("Bearer {}", self.config.token));
        if let Some(key) = key {
            request = request.header("Idempotency-Key", key);
        }
        let response = match body {
            Some(body) => self.agent.run(request.header("Content-Type", "application/json").body(body.to_string())?),
            None => self.agent.run(request.body(())?),
        }
        .with_context(|| format!("{method} {url}"))?;
        Ok(json_of(response))
    }

    fn provider(&self, name: &str) -> anyhow::Result<String> {
        self.config
            .providers
            .iter()
            .find_map(|p| p.strip_prefix(&format!("{name}=")).map(str::to_owned))
            .with_context(|| format!("no provider {name} in DEMO_PROVIDERS"))
    }

    fn provider_call(&self, name: &str, method: &str, path: &str, body: Option<Value>) -> anyhow::Result<Value> {
        let url = format!("{}{path}", self.provider(name)?);
        let request = ureq::http::Request::builder().method(method).uri(&url);
        let response = match body {
            Some(body) => self.agent.run(request.header("Content-Type", "application/json").body(body.to_string())?),
            None => self.agent.run(request.body(())?),
        }?;
        Ok(json_of(response).1)
    }

    fn webhook(&self, event_id: &str, body: &Value) -> anyhow::Result<u16> {
        let body = body.to_string();
        let timestamp = time::OffsetDateTime::now_utc().unix_timestamp().to_string();
        let mut mac = Hmac::<Sha256>::new_from_slice(self.config.webhook_secret.as_bytes())?;
        // The signature covers the event id too (docs/intake.md), so a replay under a new id is refused.
        mac.update(format!("{timestamp}.{event_id}.{body}").as_bytes());
        let signature = format!("v2={}", hex::encode(mac.finalize().into_bytes()));
        let request = ureq::http::Request::builder()
            .method("POST")
            .uri(format!("{}/v1/webhooks/helpdesk", self.config.intake))
            .header("Content-Type", "application/json")
            .header("Fenceline-Timestamp", timestamp)
            .header("Fenceline-Signature", signature)
            .header("Fenceline-Event-Id", event_id)
            .body(body)?;
        Ok(self.agent.run(request)?.status().as_u16())
    }

    /// Every task of the demo tenant accepted since the demo started.
    fn tasks(&self) -> anyhow::Result<Vec<Value>> {
        let since = self.started.format(&time::format_description::well_known::Rfc3339)?;
        let mut all = Vec::new();
        let mut cursor: Option<String> = None;
        loop {
            let mut path = format!("/v1/tasks?limit=200&since={since}");
            if let Some(c) = &cursor {
                path.push_str(&format!("&cursor={c}"));
            }
            let (status, page) = self.api("GET", &path, None, None)?;
            if status != 200 {
                bail!("listing tasks answered {status}: {page}");
            }
            all.extend(page["tasks"].as_array().cloned().unwrap_or_default());
            match page["next_cursor"].as_str() {
                Some(next) => cursor = Some(next.to_owned()),
                None => return Ok(all),
            }
        }
    }
}

fn tally(tasks: &[Value]) -> BTreeMap<String, usize> {
    let mut counts = BTreeMap::new();
    for task in tasks {
        *counts.entry(task["state"].as_str().unwrap_or("?").to_owned()).or_insert(0) += 1;
    }
    counts
}

fn line(counts: &BTreeMap<String, usize>) -> String {
    counts.iter().map(|(state, n)| format!("{state} {n}")).collect::<Vec<_>>().join(" · ")
}

const SETTLED: &[&str] = &["succeeded", "failed", "cancelled", "outcome_unknown", "needs_human"];

#[tokio::main(flavor = "current_thread")]
async fn main() -> anyhow::Result<()> {
    let config = Config::parse();
    let demo = Demo {
        run: uuid::Uuid::now_v7().simple().to_string()[20..].to_owned(),
        agent: agent(),
        started: time::OffsetDateTime::now_utc() - Duration::from_secs(1),
        config,
    };
    let clock = Instant::now();
    println!("Monday morning (run {}): the weekend's backlog arrives.\n", demo.run);

    for name in PROVIDERS {
        demo.provider_call(name, "DELETE", "/admin/rules", None)?;
    }
    // (calls, charges) each provider had before this run: the table shows this run's.
    let before: BTreeMap<&str, (usize, usize)> = PROVIDERS
        .iter()
        .map(|name| {
            let calls = demo.provider_call(name, "GET", "/admin/calls", None).unwrap_or(Value::Null);
            let ledger = demo.provider_call(name, "GET", "/admin/ledger", None).unwrap_or(Value::Null);
            (*name, (calls.as_array().map_or(0, Vec::len), ledger["charges"].as_array().map_or(0, Vec::len)))
        })
        .collect();
    // The image provider throttles for a while, and once does the work and drops the answer.
    demo.provider_call(
        "imagegen",
        "POST",
        "/admin/rules",
        Some(json!({"status": 429, "retry_after_s": 2, "times": 12})),
    )?;
    demo.provider_call("imagegen", "POST", "/admin/rules", Some(json!({"drop_after_accept": true, "times": 1})))?;
    // The text-message gateway sends the text (and charges it), then answers as a
    // gateway that timed out: nobody can know whether the customer got it.
    demo.provider_call(
        "sms",
        "POST",
        "/admin/rules",
        Some(json!({"status_after_work": 504, "bare": true, "times": 1})),
    )?;

    // Tickets through the upstream topic, 1 in 8 delivered twice.
    let producer: FutureProducer = ClientConfig::new()
        .set("bootstrap.servers", &demo.config.brokers)
        .set("enable.idempotence", "true")
        .create()?;
    let topic_tickets = demo.config.tickets / 2;
    let mut sent = 0;
    for n in 0..topic_tickets {
        let request = Event::TaskRequest(TaskRequest {
            // Configured for `demo` by `deploy/local/stack` (`add-upstream-source`).
            source: "crm".into(),
            source_event_id: format!("crm-{}-{n}", demo.run),
            tenant: "demo".into(),
            kind: "ticket.reply".into(),
            input_json: json!({"ticket": format!("CRM-{n}"), "text": "my order has not arrived"}).to_string(),
            priority: Priority::Normal,
            deadline: None,
            not_before: None,
            labels: BTreeMap::from([("demo".into(), demo.run.clone())]),
        });
        let copies = if n % 8 == 0 { 2 } else { 1 };
        for _ in 0..copies {
            let (payload, headers) = encode_record(&request, "crm")?;
            let pairs = headers.to_pairs();
            let kafka_headers = pairs
                .iter()
                .fold(OwnedHeaders::new(), |h, (k, v)| h.insert(Header { key: k, value: Some(v.as_bytes()) }));
            let key = format!("crm-{}-{n}", demo.run);
            producer
                .send(
                    FutureRecord::to("fenceline.intake.requests").key(&key).payload(&payload).headers(kafka_headers),
                    Duration::from_secs(10),
                )
                .await
                .map_err(|(e, _)| e)?;
            sent += 1;
        }
    }
    println!("  {topic_tickets} tickets on fenceline.intake.requests ({sent} records: some redelivered)");

    // Tickets through signed webhooks, 1 in 8 re-sent.
    let mut deliveries = 0;
    for n in 0..(demo.config.tickets - topic_tickets) {
        let body = json!({"ticket": format!("HD-{n}"), "text": "please help", "run": demo.run});
        let event_id = format!("hd-{}-{n}", demo.run);
        for _ in 0..(if n % 8 == 0 { 2 } else { 1 }) {
            let status = demo.webhook(&event_id, &body)?;
            if status != 202 {
                bail!("webhook answered {status}");
            }
            deliveries += 1;
        }
    }
    println!("  {} tickets through signed webhooks ({deliveries} deliveries)", demo.config.tickets - topic_tickets);

    // Image jobs through the API with idempotency keys, 1 in 4 submitted twice.
    let mut image_ids = HashSet::new();
    let mut replays = 0;
    for n in 0..demo.config.images {
        let key = format!("img-{}-{n}", demo.run);
        let body = json!({"kind": "image.generate", "input": {"prompt": format!("product shot {n}")},
                          "labels": {"demo": demo.run}});
        for _ in 0..(if n % 4 == 0 { 2 } else { 1 }) {
            let (status, answer) = demo.api("POST", "/v1/tasks", Some(&key), Some(body.clone()))?;
            if status != 202 {
                bail!("submitting an image answered {status}: {answer}");
            }
            if !image_ids.insert(answer["task_id"].as_str().unwrap_or_default().to_owned()) {
                replays += 1;
            }
        }
    }
    println!(
        "  {} image jobs through the API ({replays} submitted twice, answered with the same task)",
        image_ids.len()
    );

    // Two refunds that need a person's approval.
    let mut refunds = Vec::new();
    for n in 0..2 {
        let body = json!({"kind": "ticket.triage", "input": {"ticket": format!("REFUND-{n}"), "amount_cents": 2_500},
                          "labels": {"demo": demo.run}});
        let (status, answer) = demo.api("POST", "/v1/tasks", Some(&format!("refund-{}-{n}", demo.run)), Some(body))?;
        if status != 202 {
            bail!("submitting a refund answered {status}: {answer}");
        }
        refunds.push(answer["task_id"].as_str().unwrap_or_default().to_owned());
    }
    println!("  2 refunds that need an approval");

    // One text to a customer through a provider that can neither dedupe nor be asked.
    let body = json!({"kind": "customer.notify",
                      "input": {"to": "+15550100", "text": "Your refund for REFUND-0 is on its way."},
                      "labels": {"demo": demo.run}});
    let (status, answer) = demo.api("POST", "/v1/tasks", Some(&format!("notify-{}", demo.run)), Some(body))?;
    if status != 202 {
        bail!("submitting a text message answered {status}: {answer}");
    }
    let notify = answer["task_id"].as_str().unwrap_or_default().to_owned();
    println!("  1 text message to a customer, through a gateway that cannot be asked what it sent\n");

    let expected = demo.config.tickets + image_ids.len() + refunds.len() + 1;
    let deadline = Instant::now() + Duration::from_secs(demo.config.timeout_s);
    let mut killed = false;
    let mut approved = false;
    loop {
        let tasks = demo.tasks()?;
        let counts = tally(&tasks);
        let settled: usize = SETTLED.iter().map(|s| counts.get(*s).copied().unwrap_or(0)).sum();
        println!("  [{:>4} s] {} of {expected} accepted: {}", clock.elapsed().as_secs(), tasks.len(), line(&counts));
        if !killed && settled >= expected / 3 {
            killed = true;
            let pid = std::fs::read_to_string(&demo.config.executor_pidfile)?.trim().to_owned();
            Command::new("kill").args(["-KILL", &pid]).status()?;
            println!("  >> executor (pid {pid}) killed with SIGKILL mid-run; a new one starts 15 s later");
            // As a supervisor restarts after a back-off: meanwhile the dead member's
            // group session expires, and its leases lapse and are taken over.
            tokio::time::sleep(Duration::from_secs(15)).await;
            let mut parts = demo.config.restart.split_whitespace();
            let program = parts.next().context("restart command")?;
            let status = Command::new(program).args(parts).stdout(std::process::Stdio::null()).status()?;
            if !status.success() {
                bail!("restarting the stack failed");
            }
        }
        let waiting = tasks.iter().filter(|t| t["state"] == "awaiting_approval").count();
        if !approved && waiting == refunds.len() {
            approved = true;
            for id in &refunds {
                // A person's decision about the wait the refund is at, on record with the name and a note.
                let (status, _) = demo.api(
                    "POST",
                    &format!("/v1/tasks/{id}/approve"),
                    None,
                    Some(json!({"decided_by": "support lead", "note": "refund checked against the ticket"})),
                )?;
                println!("  >> refund {id} approved by a person ({status})");
            }
        }
        if tasks.len() >= expected && settled == expected {
            break;
        }
        if Instant::now() > deadline {
            println!("\n  the demo's time ran out; what is not settled is shown as it is");
            break;
        }
        tokio::time::sleep(Duration::from_secs(2)).await;
    }

    report(&demo, &before, clock.elapsed())?;
    play_dialects(&demo).await?;
    decide_at_the_dashboard(&demo, &notify)
}

/// The paid APIs the stack's catalogue reaches through the dialects Fenceline ships
/// (deploy/dialects; `deploy/local/stack` names each `demo.<provider>`, against the
/// fake provider speaking that vendor's API), with an input for one task each.
fn dialect_tasks() -> [(&'static str, Value); 5] {
    let ask = json!([{"role": "user", "content": "Draft one line of apology for a parcel that is late."}]);
    [
        ("openai", json!({"model": "gpt-4o-mini", "messages": ask})),
        ("anthropic", json!({"model": "claude-sonnet-4-5", "max_tokens": 256, "messages": ask})),
        (
            "replicate",
            json!({"version": "5c7d5dc6dd8bf75c1acaa8565735e7986bc5b66206b55cca93cb72c9bf15ccaa",
                             "input": {"prompt": "a desk lamp on a white table"}}),
        ),
        ("stripe", json!({"payment_intent": "pi_3MtwBwLkdIwHu7ix28a3tqPa", "amount": 2500})),
        ("twilio", json!({"to": "+15550100", "from": "+15550199", "body": "Your refund is on its way."})),
    ]
}

/// One task through each shipped dialect: its final state and what the API answered.
async fn play_dialects(demo: &Demo) -> anyhow::Result<()> {
    println!(
        "
One task through each paid API's dialect (deploy/dialects), against the fake speaking it:\n"
    );
    let mut ids = Vec::new();
    for (provider, input) in dialect_tasks() {
        let body = json!({"kind": format!("demo.{provider}"), "input": input});
        let key = format!("dialect-{provider}-{}", demo.run);
        let (status, answer) = demo.api("POST", "/v1/tasks", Some(&key), Some(body))?;
        if status != 202 {
            bail!("submitting a task of demo.{provider} answered {status}: {answer}");
        }
        ids.push((provider, answer["task_id"].as_str().unwrap_or_default().to_owned()));
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    for (provider, id) in ids {
        let task = loop {
            let (_, task) = demo.api("GET", &format!("/v1/tasks/{id}"), None, None)?;
            if SETTLED.contains(&task["state"].as_str().unwrap_or_default()) || Instant::now() > deadline {
                break task;
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        };
        let output = task["steps"].as_array().and_then(|s| s.last()).map(|s| s["output"].to_string());
        let mut shown = output.unwrap_or_else(|| "(no output)".to_owned());
        if shown.chars().count() > 90 {
            shown = format!("{}…", shown.chars().take(90).collect::<String>());
        }
        println!("  {provider:<10} {:<16} {shown}", task["state"].as_str().unwrap_or("?"));
    }
    Ok(())
}

/// The fake providers of the local stack.
const PROVIDERS: [&str; 4] = ["imagegen", "llm", "payments", "sms"];

/// Ends with the case that only a person can decide: its evidence, and where to decide it.
fn decide_at_the_dashboard(demo: &Demo, task_id: &str) -> anyhow::Result<()> {
    let (_, task) = demo.api("GET", &format!("/v1/tasks/{task_id}"), None, None)?;
    println!(
        "\nOne case waits for a person: task {task_id} ({}) is {}.",
        task["kind"].as_str().unwrap_or("?"),
        task["state"].as_str().unwrap_or("?")
    );
    if let Some(reason) = task["reason"].as_str() {
        println!("  why: {reason}");
    }
    for evidence in task["case"]["evidence"].as_array().into_iter().flatten() {
        println!(
            "  evidence ({}): {}",
            evidence["source"].as_str().unwrap_or("?"),
            evidence["finding"].as_str().unwrap_or("")
        );
    }
    println!("\nDecide it on the dashboard: {}/ui", demo.config.intake);
    println!("  sign in with the demo tenant's token (`deploy/local/stack status` prints it); under");
    println!("  \"Waiting for a person\" the case shows its evidence and the three ways out: retry as new");
    println!("  (only after ticking that the provider may charge again), accept as failed, attach a result.");
    Ok(())
}

fn report(demo: &Demo, before: &BTreeMap<&str, (usize, usize)>, took: Duration) -> anyhow::Result<()> {
    let tasks = demo.tasks()?;
    let counts = tally(&tasks);
    println!("\nAfter {} s, {} tasks:\n", took.as_secs(), tasks.len());
    println!("  {:<20} {:>6}", "state", "tasks");
    for (state, n) in &counts {
        println!("  {state:<20} {n:>6}");
    }
    let retried = tasks.iter().filter(|t| t["attempt"].as_i64().unwrap_or(0) > 1).count();
    println!("\n  retried: {retried} tasks needed more than one attempt; what the providers saw:");
    for name in PROVIDERS {
        let calls = demo.provider_call(name, "GET", "/admin/calls", None)?;
        let mut outcomes: BTreeMap<String, usize> = BTreeMap::new();
        for call in calls.as_array().into_iter().flatten().skip(before.get(name).map_or(0, |b| b.0)) {
            let outcome = call["outcome"].as_str().unwrap_or("?").to_owned();
            *outcomes.entry(outcome).or_insert(0) += 1;
        }
        let described: Vec<String> = outcomes.iter().map(|(o, n)| format!("{o} {n}")).collect();
        println!("    {name:<10} {}", described.join(" · "));
    }
    for state in ["outcome_unknown", "needs_human", "failed"] {
        for task in tasks.iter().filter(|t| t["state"] == state) {
            println!("  {state}: {} — {}", task["task_id"], task["reason"].as_str().unwrap_or(""));
        }
    }
    let by_kind = |kind: &str| tasks.iter().filter(|t| t["kind"] == kind).count();
    println!("\n  {:<10} {:>8} {:>14}   judged by the provider's own ledger", "provider", "charges", "for tasks");
    let rows = [
        ("imagegen", by_kind("image.generate"), "image.generate × 1 call"),
        ("llm", 2 * (by_kind("ticket.reply") + by_kind("ticket.triage")), "tickets × 2 calls"),
        ("payments", by_kind("ticket.triage"), "refunds × 1 call"),
        ("sms", by_kind("customer.notify"), "texts × 1 call"),
    ];
    for (name, owed, what) in rows {
        let ledger = demo.provider_call(name, "GET", "/admin/ledger", None)?;
        let charges =
            ledger["charges"].as_array().map_or(0, Vec::len).saturating_sub(before.get(name).map_or(0, |b| b.1));
        println!("  {name:<10} {charges:>8} {owed:>14}   {what}");
    }
    println!("\nWhere to look next:");
    println!("  the dashboard     {}/ui (live; sign in with the token)", demo.config.intake);
    println!(
        "  the task API      curl -H 'Authorization: Bearer <token>' {}/v1/tasks?state=succeeded",
        demo.config.intake
    );
    println!("  the status topic  fenceline.status on {} (compacted, one snapshot per task)", demo.config.brokers);
    println!("  the logs          deploy/local/stack logs [service]");
    Ok(())
}
