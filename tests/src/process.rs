//! Child processes under test: started with an environment, their JSON log lines
//! collected, stopped with SIGKILL when a test says so or when dropped.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// A running child process and the lines it wrote to stderr.
#[derive(Debug)]
pub struct Proc {
    child: Child,
    lines: Arc<Mutex<Vec<String>>>,
}

impl Proc {
    pub fn spawn(program: &str, args: &[&str], envs: &[(&str, String)]) -> Self {
        let mut command = Command::new(program);
        command.args(args).stdout(Stdio::null()).stderr(Stdio::piped());
        for (k, v) in envs {
            command.env(k, v);
        }
        Self::capture(command.spawn().unwrap_or_else(|e| panic!("spawn {program}: {e}")))
    }

    /// Collects the stderr lines of a child started with a piped stderr.
    fn capture(mut child: Child) -> Self {
        let lines = Arc::new(Mutex::new(Vec::new()));
        if let Some(stderr) = child.stderr.take() {
            let sink = lines.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                    sink.lock().unwrap_or_else(|p| p.into_inner()).push(line);
                }
            });
        }
        Self { child, lines }
    }

    /// Lines so far that contain `needle`.
    pub fn lines_with(&self, needle: &str) -> Vec<String> {
        self.lines.lock().unwrap_or_else(|p| p.into_inner()).iter().filter(|l| l.contains(needle)).cloned().collect()
    }

    /// Waits until a line contains `needle`.
    pub async fn wait_for_line(&self, needle: &str, timeout: Duration) -> bool {
        let deadline = tokio::time::Instant::now() + timeout;
        while tokio::time::Instant::now() < deadline {
            if !self.lines_with(needle).is_empty() {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        false
    }

    /// Waits for the process to exit on its own (a planned crash).
    pub async fn wait_exit(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        let deadline = tokio::time::Instant::now() + timeout;
        while tokio::time::Instant::now() < deadline {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(status);
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        None
    }

    /// Whether the process is still running (it may have crashed or exited).
    pub fn running(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends a signal by name (`STOP`, `CONT`), as a stalled machine or a long
    /// pause would stop and resume the process.
    pub fn signal(&self, name: &str) {
        let status = Command::new("kill").args([&format!("-{name}"), &self.child.id().to_string()]).status();
        assert!(status.is_ok_and(|s| s.success()), "kill -{name} failed");
    }

    pub fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    pub fn all_lines(&self) -> String {
        self.lines.lock().unwrap_or_else(|p| p.into_inner()).join("\n")
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.kill();
    }
}

/// Adds the indexes Tansu's SQLite storage lacks, as `deploy/local/stack` does
/// for its brokers (`deploy/local/broker-indexes`, docs/broker.md).
async fn index_broker_storage(database: &std::path::Path) {
    let script = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/local/broker-indexes");
    let status = tokio::process::Command::new(script).arg(database).status().await.expect("run broker-indexes");
    assert!(status.success(), "broker-indexes failed on {}: {status}", database.display());
}

/// A broker of a test's own (the stack's binary, its own folder and port), for
/// tests that stop and restart the broker.
#[derive(Debug)]
pub struct OwnBroker {
    dir: std::path::PathBuf,
    port: u16,
    proc: Option<Proc>,
}

impl OwnBroker {
    pub async fn start() -> Self {
        let scratch =
            std::env::var("FENCELINE_TEST_SCRATCH").unwrap_or_else(|_| std::env::temp_dir().display().to_string());
        let dir = std::path::Path::new(&scratch).join(format!("broker-{}", uuid::Uuid::now_v7().simple()));
        std::fs::create_dir_all(&dir).expect("broker folder");
        let port = std::net::TcpListener::bind("127.0.0.1:0").and_then(|l| l.local_addr()).expect("free port").port();
        let mut broker = Self { dir, port, proc: None };
        broker.restart().await;
        broker
    }

    pub fn brokers(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Starts the broker again on the same folder and port; topics and records survive.
    pub async fn restart(&mut self) {
        let binary =
            std::env::var("FENCELINE_TANSU_BIN").expect("FENCELINE_TANSU_BIN: run through deploy/local/stack test");
        let url = format!("tcp://127.0.0.1:{}", self.port);
        let mut command = Command::new(binary);
        command
            .current_dir(&self.dir)
            .args([
                "broker",
                "--listener-url",
                &url,
                "--advertised-listener-url",
                &url,
                "--storage-engine",
                "sqlite://tansu.db",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::piped());
        self.proc = Some(Proc::capture(command.spawn().expect("start broker")));
        let deadline = tokio::time::Instant::now() + Duration::from_secs(30);
        while tokio::net::TcpStream::connect(("127.0.0.1", self.port)).await.is_err() {
            assert!(tokio::time::Instant::now() < deadline, "broker did not listen on {}", self.port);
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        index_broker_storage(&self.dir.join("tansu.db")).await;
    }

    /// SIGKILL, as a crash would.
    pub fn kill(&mut self) {
        if let Some(mut proc) = self.proc.take() {
            proc.kill();
        }
    }
}
