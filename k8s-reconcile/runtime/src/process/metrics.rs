//! The `process_*` metrics Prometheus' client libraries export (CPU, memory, descriptors, start
//! time, threads), read from `/proc/self` at each scrape. Where `/proc` cannot be read (not
//! Linux), the collector exports nothing rather than zeros that would look like data.

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric as _};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;

/// Registers the collector of this process' `process_*` metrics in `registry`.
pub fn register(registry: &mut Registry) {
    registry.register_collector(Box::new(ProcessCollector));
}

#[derive(Debug)]
struct ProcessCollector;

/// What one read of `/proc/self` gives.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Sample {
    cpu_seconds: f64,
    threads: f64,
    start_time_seconds: f64,
    virtual_bytes: f64,
    resident_bytes: f64,
    open_fds: f64,
    max_fds: f64,
}

impl Sample {
    fn read() -> Option<Self> {
        let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
        let boot_time = std::fs::read_to_string("/proc/stat")
            .ok()?
            .lines()
            .find_map(|l| l.strip_prefix("btime ")?.trim().parse::<f64>().ok())?;
        let open_fds = std::fs::read_dir("/proc/self/fd").ok()?.count();
        let max_fds = rustix::process::getrlimit(rustix::process::Resource::Nofile).current;
        #[allow(clippy::cast_precision_loss)]
        let (ticks, page) = (
            rustix::param::clock_ticks_per_second() as f64,
            rustix::param::page_size() as f64,
        );
        parse_stat(&stat, ticks, page, boot_time).map(|mut sample| {
            #[allow(clippy::cast_precision_loss)]
            {
                sample.open_fds = open_fds as f64;
                sample.max_fds = max_fds.map_or(f64::INFINITY, |m| m as f64);
            }
            sample
        })
    }
}

/// The fields of `/proc/self/stat` we export. The command name (field 2) may hold spaces and
/// parentheses, so fields are counted from the last `)`.
fn parse_stat(stat: &str, ticks_per_second: f64, page_size: f64, boot_time: f64) -> Option<Sample> {
    let after_name = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = after_name.split_whitespace().collect();
    // Field n of proc(5) is at index n - 3 here.
    let field = |n: usize| fields.get(n - 3)?.parse::<f64>().ok();
    Some(Sample {
        cpu_seconds: (field(14)? + field(15)?) / ticks_per_second,
        threads: field(20)?,
        start_time_seconds: boot_time + field(22)? / ticks_per_second,
        virtual_bytes: field(23)?,
        resident_bytes: field(24)? * page_size,
        open_fds: 0.0,
        max_fds: 0.0,
    })
}

impl Collector for ProcessCollector {
    fn encode(&self, mut encoder: DescriptorEncoder<'_>) -> Result<(), std::fmt::Error> {
        let Some(sample) = Sample::read() else {
            return Ok(());
        };
        let cpu = ConstCounter::new(sample.cpu_seconds);
        cpu.encode(encoder.encode_descriptor(
            "process_cpu_seconds",
            "Total user and system CPU time spent in seconds",
            None,
            cpu.metric_type(),
        )?)?;
        let gauges = [
            (
                "process_open_fds",
                "Number of open file descriptors",
                sample.open_fds,
            ),
            (
                "process_max_fds",
                "Maximum number of open file descriptors",
                sample.max_fds,
            ),
            (
                "process_virtual_memory_bytes",
                "Virtual memory size in bytes",
                sample.virtual_bytes,
            ),
            (
                "process_resident_memory_bytes",
                "Resident memory size in bytes",
                sample.resident_bytes,
            ),
            (
                "process_start_time_seconds",
                "Start time of the process since unix epoch in seconds",
                sample.start_time_seconds,
            ),
            (
                "process_threads",
                "Number of OS threads in the process",
                sample.threads,
            ),
        ];
        for (name, help, value) in gauges {
            let gauge = ConstGauge::new(value);
            gauge.encode(encoder.encode_descriptor(name, help, None, gauge.metric_type())?)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn a_stat_line_with_a_tricky_name_is_read_from_its_last_parenthesis() {
        // proc(5) fields 1..=24 of a process named "a) b (c".
        let stat = "42 (a) b (c) S 1 42 42 0 -1 4194560 100 0 0 0 250 150 0 0 20 0 7 0 1000 \
                    104857600 2560 18446744073709551615";
        let sample = parse_stat(stat, 100.0, 4096.0, 1_700_000_000.0).unwrap();
        assert_eq!(sample.cpu_seconds, 4.0);
        assert_eq!(sample.threads, 7.0);
        assert_eq!(sample.start_time_seconds, 1_700_000_010.0);
        assert_eq!(sample.virtual_bytes, 104_857_600.0);
        assert_eq!(sample.resident_bytes, 2560.0 * 4096.0);
        assert!(parse_stat("42 (x) S 1", 100.0, 4096.0, 0.0).is_none());
    }

    #[test]
    fn this_process_is_exported() {
        // Spend CPU until the counter (in kernel ticks, 10 ms) moves: on a busy machine a fixed
        // wall-clock spin may get less than a tick of CPU. Bounded, generously.
        let mut registry = Registry::default();
        register(&mut registry);
        let started = std::time::Instant::now();
        let mut x = 0u64;
        let text = loop {
            let busy = std::time::Instant::now();
            while busy.elapsed() < std::time::Duration::from_millis(10) {
                x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(7));
            }
            let mut text = String::new();
            prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
            let cpu = text
                .lines()
                .find_map(|l| l.strip_prefix("process_cpu_seconds_total "))
                .and_then(|v| v.parse::<f64>().ok())
                .unwrap_or(0.0);
            if cpu > 0.0 || started.elapsed() > std::time::Duration::from_secs(30) {
                break text;
            }
        };
        for name in [
            "process_cpu_seconds_total ",
            "process_open_fds ",
            "process_max_fds ",
            "process_resident_memory_bytes ",
            "process_start_time_seconds ",
        ] {
            let line = text
                .lines()
                .find(|l| l.starts_with(name))
                .unwrap_or_else(|| {
                    panic!("{name} missing:\n{text}");
                });
            let value: f64 = line[name.len()..].parse().unwrap();
            assert!(value > 0.0, "{line}");
        }
    }
}
