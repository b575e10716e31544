//! Following tasks live: polls the task (or the list filtered by a label) and
//! prints a line whenever what it shows changed, until the task is final or waits
//! for a person, and says every 30 s without a change that it is still waiting.

use std::collections::BTreeMap;
use std::io::Write;
use std::time::{Duration, Instant};

use fenceline_domain::ids::TaskId;
use fenceline_domain::vocabulary::TaskState;

use crate::args::Polling;
use crate::client::{Answer, Client};
use crate::render::{self, Page, TaskView};
use crate::{Error, Exit};

/// What `watch` compares between two reads: a change in any of these is printed.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Shown {
    version: i64,
    state: TaskState,
    reason: Option<String>,
    attempt: i32,
    step: Option<String>,
    phase: Option<String>,
}

impl From<&TaskView> for Shown {
    fn from(t: &TaskView) -> Self {
        Shown {
            version: t.version,
            state: t.state,
            reason: t.reason.clone(),
            attempt: t.attempt,
            step: t.step.clone(),
            phase: t.phase.clone(),
        }
    }
}

/// Polls until `read` reports done, printing changes; rides out an unreachable or
/// failing service (it says so once) until `polling.timeout_s`.
struct Poller<'a> {
    client: &'a Client,
    polling: Polling,
    json: bool,
    started: Instant,
    seen: BTreeMap<TaskId, Shown>,
    unavailable: bool,
    /// When what a task shows last changed.
    changed_at: Instant,
    /// When what a task shows last changed, or the last "still waiting" was said.
    quiet_since: Instant,
}

/// How long a watch stays quiet before it says it is still waiting.
const STILL_WAITING_EVERY: Duration = Duration::from_secs(30);

impl<'a> Poller<'a> {
    fn new(client: &'a Client, polling: Polling, json: bool) -> Self {
        let now = Instant::now();
        Poller {
            client,
            polling,
            json,
            started: now,
            seen: BTreeMap::new(),
            unavailable: false,
            changed_at: now,
            quiet_since: now,
        }
    }

    /// Reads `path`, or `None` while the service is unavailable.
    fn read(&mut self, path: &str, query: &[(&str, String)]) -> Result<Option<Answer>, Error> {
        match self.client.get(path, query) {
            Ok(answer) => {
                if self.unavailable {
                    eprintln!("fenceline: intake answers again");
                    self.unavailable = false;
                }
                Ok(Some(answer))
            }
            Err(e) if e.exit() == Exit::Unavailable => {
                if !self.unavailable {
                    eprintln!("fenceline: {e}; trying again every {} ms", self.polling.interval_ms);
                    self.unavailable = true;
                }
                Ok(None)
            }
            Err(e) => Err(e),
        }
    }

    /// Prints the task if what it shows changed since the last read.
    fn show(&mut self, out: &mut dyn Write, task: &TaskView, raw: Option<&serde_json::Value>) -> Result<(), Error> {
        let shown = Shown::from(task);
        if self.seen.get(&task.task_id) == Some(&shown) {
            return Ok(());
        }
        self.seen.insert(task.task_id, shown);
        (self.changed_at, self.quiet_since) = (Instant::now(), Instant::now());
        match (self.json, raw) {
            (true, Some(raw)) => writeln!(out, "{raw}")?,
            _ => writeln!(out, "{}", render::change(task))?,
        }
        out.flush()?;
        Ok(())
    }

    /// Says on stderr, every [`STILL_WAITING_EVERY`] without a change, that the
    /// watch goes on and where the tasks are.
    fn still_waiting(&mut self) {
        if self.quiet_since.elapsed() < STILL_WAITING_EVERY || self.seen.is_empty() {
            return;
        }
        let waiting = self.started.elapsed().as_secs();
        let states: Vec<String> = self.seen.values().map(|s| s.state.to_string()).collect();
        let what = match states.as_slice() {
            [one] => one.clone(),
            many => format!("{} tasks ({})", many.len(), many.join(", ")),
        };
        eprintln!(
            "fenceline: still waiting after {waiting} s: {what}, no change for {} s",
            self.quiet_since.elapsed().as_secs()
        );
        self.quiet_since = Instant::now();
    }

    /// Sleeps until the next read, or fails once the time is up.
    fn wait(&mut self) -> Result<(), Error> {
        self.still_waiting();
        let interval = Duration::from_millis(self.polling.interval_ms);
        if let Some(limit) = self.polling.timeout_s
            && self.started.elapsed() + interval > Duration::from_secs(limit)
        {
            return Err(Error::TimedOut(limit));
        }
        std::thread::sleep(interval);
        Ok(())
    }
}

/// How a watch ends for a task where a watch stops: 0 only when it reached the
/// state that was wanted (`succeeded`, or the outcome a resolution chose).
fn verdict(task: &TaskView, wanted: TaskState) -> Exit {
    if task.state == wanted {
        return Exit::Ok;
    }
    if let Some(next) = render::next_step(task) {
        eprintln!("fenceline: task {} is {}; {next}", task.task_id, task.state);
    }
    Exit::NotSucceeded
}

/// Follows one task until it ends or waits for a person; 0 when it succeeded.
pub fn task(
    client: &Client,
    task_id: TaskId,
    polling: Polling,
    json: bool,
    out: &mut dyn Write,
) -> Result<Exit, Error> {
    task_after(client, task_id, None, TaskState::Succeeded, polling, json, out)
}

/// As [`task`], but 0 when the task stops in `wanted`, and a state of status
/// version `past` or older does not end the watch: after an approval or a
/// resolution, the task still shows the wait the action ends until the scheduler
/// has applied it.
pub fn task_after(
    client: &Client,
    task_id: TaskId,
    past: Option<i64>,
    wanted: TaskState,
    polling: Polling,
    json: bool,
    out: &mut dyn Write,
) -> Result<Exit, Error> {
    let mut poller = Poller::new(client, polling, json);
    let path = format!("/v1/tasks/{task_id}");
    loop {
        if let Some(answer) = poller.read(&path, &[])? {
            let raw: serde_json::Value = answer.parse()?;
            let task: TaskView = answer.parse()?;
            poller.show(out, &task, Some(&raw))?;
            if render::ends_watch(task.state) && past.is_none_or(|version| task.version > version) {
                return Ok(verdict(&task, wanted));
            }
        }
        poller.wait()?;
    }
}

/// Follows every task with a label (`key:value`) until each has ended or waits for
/// a person; 0 when all of them succeeded.
pub fn label(client: &Client, label: &str, polling: Polling, json: bool, out: &mut dyn Write) -> Result<Exit, Error> {
    let mut poller = Poller::new(client, polling, json);
    loop {
        if let Some(tasks) = every_page(&mut poller, label)? {
            for (task, raw) in tasks.iter().rev() {
                poller.show(out, task, Some(raw))?;
            }
            if !tasks.is_empty() && tasks.iter().all(|(t, _)| render::ends_watch(t.state)) {
                let verdicts: Vec<Exit> = tasks.iter().rev().map(|(t, _)| verdict(t, TaskState::Succeeded)).collect();
                return Ok(if verdicts.iter().all(|v| *v == Exit::Ok) { Exit::Ok } else { Exit::NotSucceeded });
            }
        }
        poller.wait()?;
    }
}

/// Every task with the label, each typed and as received; `None` while intake is unavailable.
fn every_page(poller: &mut Poller<'_>, label: &str) -> Result<Option<Vec<(TaskView, serde_json::Value)>>, Error> {
    let mut tasks = Vec::new();
    let mut cursor: Option<String> = None;
    loop {
        let mut query = vec![("label", label.to_owned()), ("limit", "200".to_owned())];
        if let Some(cursor) = &cursor {
            query.push(("cursor", cursor.clone()));
        }
        let Some(answer) = poller.read("/v1/tasks", &query)? else { return Ok(None) };
        let page: Page = answer.parse()?;
        let raw: serde_json::Value = answer.parse()?;
        let raws = raw["tasks"].as_array().cloned().unwrap_or_default();
        tasks.extend(page.tasks.into_iter().zip(raws));
        match page.next_cursor {
            Some(next) => cursor = Some(next),
            None => return Ok(Some(tasks)),
        }
    }
}
