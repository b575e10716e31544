//! Telemetry shared by every service: JSON logs, W3C trace context carried across
//! Kafka in the `traceparent` header, traces exported over OTLP/HTTP when the
//! standard `OTEL_EXPORTER_OTLP_*` variables ask for it, the Prometheus metrics
//! ([`metrics`]), and the names of span fields as constants.

pub mod metrics;
mod otlp;
mod process;

use std::collections::HashMap;

use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::EnvFilter;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;

/// Span and log field names. Dashboards and log queries depend on them: they are a
/// contract, so they are constants here and nowhere else.
pub mod fields {
    pub const SERVICE: &str = "service";
    pub const TASK_ID: &str = "task_id";
    pub const ATTEMPT: &str = "attempt";
    pub const TOPIC: &str = "topic";
    pub const PARTITION: &str = "partition";
    pub const OFFSET: &str = "offset";
    pub const EPOCH: &str = "epoch";
    pub const EVENT_ID: &str = "event_id";
    pub const EVENT_TYPE: &str = "event_type";
    pub const SHARD: &str = "shard";
    /// The W3C trace id of the span a line was written in, on every line about a task.
    pub const TRACE_ID: &str = "trace_id";
}

/// Keeps the tracer provider alive; dropping it flushes what is buffered.
#[derive(Debug)]
pub struct TelemetryGuard {
    provider: SdkTracerProvider,
}

impl Drop for TelemetryGuard {
    fn drop(&mut self) {
        // Nothing useful can be done with a flush error while shutting down.
        let _ = self.provider.shutdown();
    }
}

/// Installs the global subscriber: JSON lines on stderr, filtered by `RUST_LOG`
/// (default `info`), each line carrying the fields of its enclosing spans, so a line
/// about a task names its `task_id`, `attempt` and `trace_id`. Spans get
/// OpenTelemetry ids so that the trace can continue on the other side of a Kafka
/// topic; with `OTEL_EXPORTER_OTLP_ENDPOINT` (or `_TRACES_ENDPOINT`) set they are
/// exported in batches over OTLP/HTTP, otherwise nothing leaves the process.
///
/// Calling it twice (as tests do) keeps the first subscriber.
pub fn init(service: &'static str) -> TelemetryGuard {
    let mut builder = SdkTracerProvider::builder().with_resource(otlp::resource(service));
    let (exporter, problem) = match otlp::exporter() {
        Ok(exporter) => (exporter, None),
        Err(problem) => (None, Some(problem)),
    };
    let exporting = exporter.is_some();
    if let Some(exporter) = exporter {
        builder = builder.with_batch_exporter(exporter);
    }
    let provider = builder.build();
    let tracer = provider.tracer(service);
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let json = tracing_subscriber::fmt::layer()
        .json()
        .with_current_span(false)
        .with_span_list(true)
        .flatten_event(true)
        .with_target(true)
        .with_writer(std::io::stderr);
    let _ = tracing_subscriber::registry()
        .with(filter)
        .with(json)
        .with(tracing_opentelemetry::layer().with_tracer(tracer))
        .try_init();
    match problem {
        Some(e) => tracing::warn!(service, error = %e, "traces are not exported"),
        None => tracing::info!(service, exporting_traces = exporting, "telemetry initialised"),
    }
    TelemetryGuard { provider }
}

/// The `traceparent` of the current span, to send with an outgoing record.
pub fn current_traceparent() -> Option<String> {
    let context = tracing::Span::current().context();
    let mut carrier = HashMap::new();
    TraceContextPropagator::new().inject_context(&context, &mut carrier);
    carrier.remove("traceparent")
}

/// Makes `span` a child of the trace named by an incoming `traceparent`.
/// A missing or malformed header leaves the span a root of its own.
pub fn continue_trace(span: &tracing::Span, traceparent: Option<&str>) {
    let Some(traceparent) = traceparent else {
        return;
    };
    let carrier = HashMap::from([("traceparent".to_owned(), traceparent.to_owned())]);
    let context = TraceContextPropagator::new().extract(&carrier);
    let _ = span.set_parent(context);
    record_trace_id(span);
}

/// Writes the span's trace id into its `trace_id` field (when it declares one),
/// so that every log line written inside it names the trace.
pub fn record_trace_id(span: &tracing::Span) {
    use opentelemetry::trace::TraceContextExt as _;
    let trace_id = span.context().span().span_context().trace_id();
    if trace_id != opentelemetry::trace::TraceId::INVALID {
        span.record(fields::TRACE_ID, tracing::field::display(trace_id));
    }
}

/// The trace id of a `traceparent` header, if it is well formed.
pub fn trace_id_of(traceparent: &str) -> Option<&str> {
    let mut parts = traceparent.split('-');
    let (_version, trace_id) = (parts.next()?, parts.next()?);
    (trace_id.len() == 32 && trace_id.bytes().all(|b| b.is_ascii_hexdigit())).then_some(trace_id)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traceparent_survives_a_round_trip_through_a_header() {
        let _guard = init("telemetry-test");
        let producer_span = tracing::info_span!("produce");
        let header = producer_span.in_scope(current_traceparent).expect("a sampled span has a traceparent");
        assert!(header.starts_with("00-"), "W3C version 00: {header}");

        let consumer_span = tracing::info_span!("consume");
        continue_trace(&consumer_span, Some(&header));
        let continued = consumer_span.in_scope(current_traceparent).expect("continued span");
        let trace_id = |h: &str| h.split('-').nth(1).map(str::to_owned);
        assert_eq!(trace_id(&header), trace_id(&continued), "same trace on both sides");
        assert_ne!(header, continued, "a new span id on the consumer side");
    }
}
