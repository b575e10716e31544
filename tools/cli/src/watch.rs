//! Following tasks live: reads the task (or the list filtered by a label) again
//! whenever intake's event stream says it changed, and prints a line whenever what
//! it shows changed, until the task is final or waits for a person; says every
//! 30 s without a change that it is still waiting; polls where no stream answers.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
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

/// What intake's event stream (`GET /v1/events`) said.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Heard {
    /// This task changed.
    Task(TaskId),
    /// The stream is live, or changes may have been missed: read everything again.
    Everything,
}

/// Follows the event stream on a thread of its own, each event a wake-up; the
/// channel closes when the stream ends.
fn follow_events(client: &Client) -> Option<Receiver<Heard>> {
    let stream = client.stream("/v1/events").ok()?;
    let (tell, heard) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut event = String::new();
        for line in BufReader::new(stream).lines() {
            let Ok(line) = line else { return };
            if let Some(name) = line.strip_prefix("event:") {
                event = name.trim().to_owned();
            } else if let Some(data) = line.strip_prefix("data:") {
                let said = match event.as_str() {
                    "task" => serde_json::from_str::<serde_json::Value>(data.trim())
                        .ok()
                        .and_then(|task| task["task_id"].as_str().and_then(|id| id.parse().ok()))
                        .map(Heard::Task),
                    "ready" | "reset" => Some(Heard::Everything),
                    _ => None,
                };
                if let Some(said) = said
                    && tell.send(said).is_err()
                {
                    return;
                }
            } else if line.is_empty() {
                event.clear();
            }
        }
    });
    Some(heard)
}

/// Reads until the watch is done, printing changes: again at each event about the
/// tasks watched, or every `polling.interval_ms` where no event stream answers.
/// Rides out an unreachable or failing service (it says so once) until
/// `polling.timeout_s`.
struct Poller<'a> {
    client: &'a Client,
    polling: Polling,
    json: bool,
    started: Instant,
    seen: BTreeMap<TaskId, Shown>,
    /// Intake's event stream while it lasts.
    events: Option<Receiver<Heard>>,
    /// When the stream was last opened or tried: tried again at most every
    /// [`READ_AT_LEAST_EVERY`] while the watch polls.
    stream_tried_at: Instant,
    unavailable: bool,
    /// When what a task shows last changed.
    changed_at: Instant,
    /// When what a task shows last changed, or the last "still waiting" was said.
    quiet_since: Instant,
}

/// How long a watch stays quiet before it says it is still waiting.
const STILL_WAITING_EVERY: Duration = Duration::from_secs(30);

/// Longest a watch on the event stream goes without reading again: a change the
/// stream could not carry is seen within this.
const READ_AT_LEAST_EVERY: Duration = Duration::from_secs(15);

impl<'a> Poller<'a> {
    /// Opens the event stream before the first read, so that no change between the
    /// read and the stream goes unheard.
    fn new(client: &'a Client, polling: Polling, json: bool) -> Self {
        let now = Instant::now();
        Poller {
            client,
            polling,
            json,
            started: now,
            seen: BTreeMap::new(),
            events: follow_events(client),
            stream_tried_at: now,
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

    /// Waits until the next read: an event about `watched` (any task when `None`),
    /// or the poll interval where no stream answers. Fails once the time is up.
    fn wait(&mut self, watched: Option<TaskId>) -> Result<(), Error> {
        self.still_waiting();
        let left =
            self.polling.timeout_s.map(|limit| Duration::from_secs(limit).saturating_sub(self.started.elapsed()));
        if self.events.is_none() && self.stream_tried_at.elapsed() >= READ_AT_LEAST_EVERY {
            self.stream_tried_at = Instant::now();
            self.events = follow_events(self.client);
            if self.events.is_some() {
                // What changed while no stream was open is read first.
                return Ok(());
            }
        }
        let Some(events) = self.events.take() else {
            let interval = Duration::from_millis(self.polling.interval_ms);
            if let Some(limit) = self.polling.timeout_s
                && left.is_some_and(|left| interval > left)
            {
                return Err(Error::TimedOut(limit));
            }
            std::thread::sleep(interval);
            return Ok(());
        };
        let until = Instant::now() + READ_AT_LEAST_EVERY.min(left.unwrap_or(READ_AT_LEAST_EVERY));
        let woken = loop {
            let quiet_until = self.quiet_since + STILL_WAITING_EVERY;
            match events.recv_timeout(until.min(quiet_until).saturating_duration_since(Instant::now())) {
                Ok(Heard::Task(task)) if watched.is_some_and(|watched| watched != task) => {}
                Ok(_) => break true,
                Err(RecvTimeoutError::Timeout) if Instant::now() < until => self.still_waiting(),
                Err(RecvTimeoutError::Timeout) => break false,
                Err(RecvTimeoutError::Disconnected) => {
                    eprintln!(
                        "fenceline: intake's event stream ended; reading every {} ms instead",
                        self.polling.interval_ms
                    );
                    return Ok(());
                }
            }
        };
        if woken && watched.is_none() {
            // A list reads again at most once a second: changes that come together
            // are read together.
            std::thread::sleep(Duration::from_millis(self.polling.interval_ms.min(1_000)));
            while events.try_recv().is_ok() {}
        }
        self.events = Some(events);
        if woken {
            return Ok(());
        }
        match self.polling.timeout_s {
            Some(limit) if self.started.elapsed() >= Duration::from_secs(limit) => Err(Error::TimedOut(limit)),
            _ => Ok(()),
        }
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
        poller.wait(Some(task_id))?;
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
        poller.wait(None)?;
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
