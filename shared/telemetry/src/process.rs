//! The `process_*` families of every service (the names and meanings Prometheus's
//! client libraries give them), read from Linux's `/proc/self` at each scrape;
//! elsewhere the page has none of them.

use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;

/// Clock ticks per second in `/proc`'s times: the kernel's `USER_HZ`, which is 100
/// for every user-space program on Linux whatever the kernel's own tick rate.
const TICKS_PER_SECOND: f64 = 100.0;

/// What `/proc/self` says of the process.
#[derive(Debug, Clone, Default, PartialEq)]
struct Process {
    cpu_seconds: f64,
    start_time_seconds: f64,
    resident_bytes: u64,
    virtual_bytes: u64,
    threads: u64,
    open_fds: u64,
    /// The soft limit; `None` when unlimited.
    max_fds: Option<u64>,
}

/// Encodes the process's families at each scrape.
#[derive(Debug)]
pub(crate) struct Collector;

impl prometheus_client::collector::Collector for Collector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> std::fmt::Result {
        let Some(p) = read() else { return Ok(()) };
        let cpu = ConstCounter::new(p.cpu_seconds);
        cpu.encode(encoder.encode_descriptor(
            "process_cpu_seconds",
            "User and system CPU time spent, in seconds",
            None,
            cpu.metric_type(),
        )?)?;
        let mut gauge = |name: &str, help: &str, value: f64| -> std::fmt::Result {
            let gauge = ConstGauge::new(value);
            gauge.encode(encoder.encode_descriptor(name, help, None, gauge.metric_type())?)
        };
        gauge(
            "process_start_time_seconds",
            "Start time of the process since the Unix epoch, in seconds",
            p.start_time_seconds,
        )?;
        gauge("process_resident_memory_bytes", "Resident memory size, in bytes", p.resident_bytes as f64)?;
        gauge("process_virtual_memory_bytes", "Virtual memory size, in bytes", p.virtual_bytes as f64)?;
        gauge("process_threads", "Threads of the process", p.threads as f64)?;
        gauge("process_open_fds", "Open file descriptors", p.open_fds as f64)?;
        if let Some(max) = p.max_fds {
            gauge("process_max_fds", "Most file descriptors the process may open (its soft limit)", max as f64)?;
        }
        Ok(())
    }
}

/// Reads `/proc/self`; `None` where there is no such thing (not Linux).
fn read() -> Option<Process> {
    let text = |path: &str| std::fs::read_to_string(path).ok();
    let stat = parse_stat(&text("/proc/self/stat")?)?;
    let boot_time = parse_boot_time(&text("/proc/stat")?)?;
    let resident_kib = text("/proc/self/status").and_then(|s| parse_status_kib(&s, "VmRSS:")).unwrap_or(0);
    let max_fds = text("/proc/self/limits").and_then(|l| parse_max_open_files(&l));
    // The directory's own handle, open while it is read, counts as one of them, as
    // in every client library that counts this way.
    let open_fds = std::fs::read_dir("/proc/self/fd").map_or(0, |dir| dir.count() as u64);
    Some(Process {
        cpu_seconds: (stat.utime + stat.stime) as f64 / TICKS_PER_SECOND,
        start_time_seconds: boot_time as f64 + stat.start_ticks as f64 / TICKS_PER_SECOND,
        resident_bytes: resident_kib * 1024,
        virtual_bytes: stat.virtual_bytes,
        threads: stat.threads,
        open_fds,
        max_fds,
    })
}

/// The fields of `/proc/self/stat` that the families need.
#[derive(Debug, PartialEq)]
struct Stat {
    utime: u64,
    stime: u64,
    threads: u64,
    start_ticks: u64,
    virtual_bytes: u64,
}

/// Reads `/proc/<pid>/stat` (proc(5)): the fields after the command's closing
/// parenthesis (the command itself may hold spaces and parentheses).
fn parse_stat(stat: &str) -> Option<Stat> {
    let after_command = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = after_command.split_whitespace().collect();
    // Field n of proc(5) (1-based, the state being field 3) is fields[n - 3].
    let field = |n: usize| fields.get(n - 3)?.parse::<u64>().ok();
    Some(Stat {
        utime: field(14)?,
        stime: field(15)?,
        threads: field(20)?,
        start_ticks: field(22)?,
        virtual_bytes: field(23)?,
    })
}

/// The boot time, in seconds since the epoch, from `/proc/stat`'s `btime` line.
fn parse_boot_time(stat: &str) -> Option<u64> {
    stat.lines().find_map(|line| line.strip_prefix("btime ")).and_then(|v| v.trim().parse().ok())
}

/// A `/proc/self/status` line in kB (`VmRSS:    1234 kB`).
fn parse_status_kib(status: &str, key: &str) -> Option<u64> {
    status.lines().find_map(|line| line.strip_prefix(key)).and_then(|v| v.split_whitespace().next()?.parse().ok())
}

/// The soft limit of `Max open files` in `/proc/self/limits`; `None` when unlimited.
fn parse_max_open_files(limits: &str) -> Option<u64> {
    limits
        .lines()
        .find_map(|line| line.strip_prefix("Max open files"))
        .and_then(|v| v.split_whitespace().next()?.parse().ok())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_stat_line_is_read_after_a_command_that_holds_spaces_and_parentheses() {
        let line = "4242 (fenceline (x) y) S 1 4242 4242 0 -1 4194560 2385 0 0 0 150 27 0 0 20 0 11 0 \
                    98765 1288482816 3123 18446744073709551615 1 1 0 0 0 0 0 4096 17990 0 0 0 17 1 0 0 0 0 0";
        assert_eq!(
            parse_stat(line),
            Some(Stat { utime: 150, stime: 27, threads: 11, start_ticks: 98_765, virtual_bytes: 1_288_482_816 })
        );
        assert_eq!(parse_stat("4242 (truncated"), None);
    }

    #[test]
    fn boot_time_resident_memory_and_the_descriptor_limit_are_read_from_their_lines() {
        assert_eq!(parse_boot_time("cpu  1 2 3\nintr 5\nbtime 1767225600\nprocesses 9\n"), Some(1_767_225_600));
        let status = "Name:\tfenceline\nVmSize:\t 1258284 kB\nVmRSS:\t   12492 kB\nThreads:\t11\n";
        assert_eq!(parse_status_kib(status, "VmRSS:"), Some(12_492));
        let limits = "Limit                     Soft Limit           Hard Limit           Units     \n\
                      Max processes             95000                95000                processes \n\
                      Max open files            1024                 524288               files     \n";
        assert_eq!(parse_max_open_files(limits), Some(1024));
        assert_eq!(
            parse_max_open_files("Max open files            unlimited            unlimited            files\n"),
            None
        );
    }

    #[test]
    fn this_process_reads_as_started_running_and_holding_memory() {
        if !cfg!(target_os = "linux") {
            return;
        }
        let p = read().expect("/proc/self on Linux");
        assert!(p.resident_bytes > 0 && p.virtual_bytes >= p.resident_bytes, "{p:?}");
        assert!(p.threads >= 1 && p.open_fds >= 3, "{p:?}");
        assert!(p.start_time_seconds > 1_500_000_000.0, "{p:?}");
    }
}
