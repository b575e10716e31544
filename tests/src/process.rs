//! Child processes under test: started with an environment, their log lines
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

    /// As [`Proc::spawn`], collecting what it writes to stdout too (a tool that logs
    /// there, such as Prism or stripe-mock), in the order each stream's lines arrive.
    pub fn spawn_with_stdout(program: &str, args: &[&str], envs: &[(&str, String)]) -> Self {
        let mut command = Command::new(program);
        command.args(args).stdout(Stdio::piped()).stderr(Stdio::piped());
        for (k, v) in envs {
            command.env(k, v);
        }
        Self::capture(command.spawn().unwrap_or_else(|e| panic!("spawn {program}: {e}")))
    }

    /// Collects the lines of a child's piped stderr, and of its stdout when piped.
    fn capture(mut child: Child) -> Self {
        let lines = Arc::new(Mutex::new(Vec::new()));
        let streams: [Option<Box<dyn std::io::Read + Send>>; 2] = [
            child.stderr.take().map(|s| Box::new(s) as Box<dyn std::io::Read + Send>),
            child.stdout.take().map(|s| Box::new(s) as Box<dyn std::io::Read + Send>),
        ];
        for stream in streams.into_iter().flatten() {
            let sink = lines.clone();
            std::thread::spawn(move || {
                for line in BufReader::new(stream).lines().map_while(Result::ok) {
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

/// `deploy/local/broker`, the one script that configures, formats, starts and stops
/// a local Kafka node, for the stack and the tests alike.
fn broker_script() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/local/broker")
}

/// A Kafka node of a test's own (its own folder and ports), for tests that stop and
/// restart the broker. Every other test shares the test stack's broker.
#[derive(Debug)]
pub struct OwnBroker {
    dir: std::path::PathBuf,
    port: u16,
    controller_port: u16,
}

impl OwnBroker {
    pub async fn start() -> Self {
        let scratch =
            std::env::var("FENCELINE_TEST_SCRATCH").unwrap_or_else(|_| std::env::temp_dir().display().to_string());
        let dir = std::path::Path::new(&scratch).join(format!("broker-{}", uuid::Uuid::now_v7().simple()));
        std::fs::create_dir_all(&dir).expect("broker folder");
        let broker = Self { dir, port: free_port(), controller_port: free_port() };
        broker.restart().await;
        broker
    }

    pub fn brokers(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    /// Starts the node again on the same folder and ports; topics and records
    /// survive. Returns once a metadata request succeeds.
    pub async fn restart(&self) {
        let status = tokio::process::Command::new(broker_script())
            .args(["start", &self.dir.display().to_string(), &self.port.to_string()])
            .env("FENCELINE_BROKER_CONTROLLER_PORT", self.controller_port.to_string())
            .env("FENCELINE_BROKER_HEAP", "256m")
            .status()
            .await
            .expect("run deploy/local/broker");
        assert!(status.success(), "deploy/local/broker start {} failed: {status}", self.dir.display());
        let kafka = crate::kafka_at(&self.brokers(), "");
        fenceline_bus::kafka::check_connection(&kafka, Duration::from_secs(60))
            .await
            .unwrap_or_else(|e| panic!("the broker of {} answers no metadata request: {e}", self.dir.display()));
    }

    /// SIGKILL, as a crash would.
    pub fn kill(&self) {
        self.stop("kill");
    }

    fn stop(&self, how: &str) {
        let status = Command::new(broker_script()).args([how, &self.dir.display().to_string()]).status();
        assert!(status.is_ok_and(|s| s.success()), "deploy/local/broker {how} failed");
    }
}

impl Drop for OwnBroker {
    fn drop(&mut self) {
        let _ = Command::new(broker_script()).args(["kill", &self.dir.display().to_string()]).status();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A Postgres cluster of a test's own (Debian's PostgreSQL 15, as `deploy/local/stack`
/// starts it: `initdb` and `pg_ctl` from `FENCELINE_PG_BIN`, run as the `postgres`
/// user when the test runs as root), in the test's scratch folder on a free port,
/// with a `fenceline` database; stopped and removed when dropped.
#[derive(Debug)]
pub struct OwnPostgres {
    dir: std::path::PathBuf,
    port: u16,
}

impl OwnPostgres {
    pub async fn start() -> Self {
        Self::start_with(None).await
    }

    /// As [`OwnPostgres::start`], serving TLS (`ssl=on`) with this certificate and
    /// key (PEM); connections without TLS are still accepted.
    pub async fn start_tls(certificate_pem: &str, key_pem: &str) -> Self {
        Self::start_with(Some((certificate_pem, key_pem))).await
    }

    async fn start_with(tls: Option<(&str, &str)>) -> Self {
        let scratch =
            std::env::var("FENCELINE_TEST_SCRATCH").unwrap_or_else(|_| std::env::temp_dir().display().to_string());
        let dir = std::path::Path::new(&scratch).join(format!("pg-{}", uuid::Uuid::now_v7().simple()));
        std::fs::create_dir_all(&dir).expect("postgres folder");
        let postgres = Self { dir, port: free_port() };
        let data = postgres.data().display().to_string();
        if running_as_root() {
            let status = Command::new("chown").args(["postgres:", &postgres.dir.display().to_string()]).status();
            assert!(status.is_ok_and(|s| s.success()), "chown the postgres folder");
        }
        let socket = postgres.dir.display().to_string();
        let mut options =
            format!("-p {} -k {socket} -c listen_addresses=127.0.0.1 -c max_connections=200", postgres.port);
        let log = postgres.dir.join("postgres.log").display().to_string();
        let initdb = ["initdb", "-D", &data, "-U", "fenceline", "--auth=trust", "--encoding=UTF8", "--no-instructions"];
        postgres.run(&initdb).await;
        if let Some((certificate, key)) = tls {
            // The server reads them as its own user, the key readable by it alone.
            for (name, text) in [("server.crt", certificate), ("server.key", key)] {
                let path = postgres.data().join(name);
                std::fs::write(&path, text).expect("write a TLS file");
                let mode = std::os::unix::fs::PermissionsExt::from_mode(0o600);
                std::fs::set_permissions(&path, mode).expect("TLS file mode");
                if running_as_root() {
                    let status = Command::new("chown").args(["postgres:", &path.display().to_string()]).status();
                    assert!(status.is_ok_and(|s| s.success()), "chown {name}");
                }
            }
            options.push_str(" -c ssl=on -c ssl_cert_file=server.crt -c ssl_key_file=server.key");
        }
        postgres.run(&["pg_ctl", "-D", &data, "-l", &log, "-w", "-t", "60", "-o", &options, "start"]).await;
        let admin = sqlx::postgres::PgPoolOptions::new()
            .max_connections(1)
            .connect(&format!("postgres://fenceline@127.0.0.1:{}/postgres", postgres.port))
            .await
            .expect("connect to the test's own Postgres");
        sqlx::query("CREATE DATABASE fenceline").execute(&admin).await.expect("create database");
        admin.close().await;
        postgres
    }

    /// Runs a Postgres program to its end; panics if it fails.
    async fn run(&self, step: &[&str]) {
        let step: Vec<String> = step.iter().map(|s| (*s).to_owned()).collect();
        let status = tokio::task::spawn_blocking(move || {
            let args: Vec<&str> = step.iter().map(String::as_str).collect();
            (args[0].to_owned(), pg_command(&args).stdout(std::process::Stdio::null()).status())
        })
        .await
        .expect("pg thread");
        assert!(status.1.as_ref().is_ok_and(|s| s.success()), "{} failed: {:?}", status.0, status.1);
    }

    fn data(&self) -> std::path::PathBuf {
        self.dir.join("data")
    }

    /// Restarts the cluster as a crash would (`-m immediate`: no shutdown checkpoint,
    /// recovery on start); returns once it accepts connections again.
    pub async fn restart_as_after_a_crash(&self) {
        self.control_immediately("restart").await;
    }

    /// Stops the cluster as a crash would (`-m immediate`), leaving its folder for
    /// [`OwnPostgres::restart_as_after_a_crash`] or the drop.
    pub async fn stop(&self) {
        self.control_immediately("stop").await;
    }

    /// `pg_ctl <action>` in immediate mode, waiting up to 60 s; panics if it fails.
    async fn control_immediately(&self, action: &str) {
        let data = self.data().display().to_string();
        self.run(&["pg_ctl", "-D", &data, "-m", "immediate", "-w", "-t", "60", action]).await;
    }

    /// The URL of its `fenceline` database.
    pub fn url(&self) -> String {
        format!("postgres://fenceline@127.0.0.1:{}/fenceline", self.port)
    }
}

impl Drop for OwnPostgres {
    fn drop(&mut self) {
        let data = self.data().display().to_string();
        let _ = pg_command(&["pg_ctl", "-D", &data, "-m", "immediate", "-w", "stop"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A Postgres program from `FENCELINE_PG_BIN` (or the `PATH`), as the `postgres`
/// user when running as root (`initdb` refuses root).
fn pg_command(args: &[&str]) -> Command {
    let program = std::env::var("FENCELINE_PG_BIN")
        .map(|bin| format!("{bin}/{}", args[0]))
        .unwrap_or_else(|_| args[0].to_owned());
    if running_as_root() {
        let mut command = Command::new("runuser");
        command.args(["-u", "postgres", "--", &program]).args(&args[1..]);
        command
    } else {
        let mut command = Command::new(program);
        command.args(&args[1..]);
        command
    }
}

fn running_as_root() -> bool {
    Command::new("id").arg("-u").output().is_ok_and(|o| String::from_utf8_lossy(&o.stdout).trim() == "0")
}

/// A port nobody listens on now, above the kernel's ephemeral ports (32768-60999),
/// as the test stack's own: a port the kernel hands out could be taken by another
/// process's outgoing connection between this check and the child binding it.
pub fn free_port() -> u16 {
    loop {
        let port = rand::random_range(61_100..65_500);
        if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
            return port;
        }
    }
}
