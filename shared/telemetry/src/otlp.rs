//! Trace export over OTLP/HTTP, configured by the standard OpenTelemetry variables
//! (`OTEL_EXPORTER_OTLP_ENDPOINT`, `_TRACES_ENDPOINT`, `_PROTOCOL`, `_HEADERS`,
//! `_TIMEOUT`, `OTEL_SERVICE_NAME`, `OTEL_TRACES_SAMPLER`, `OTEL_BSP_*`). The
//! exporter sends through `ureq`, the HTTP client the workspace already has; the
//! batch processor calls it from a thread of its own, never from the runtime.

use std::time::Duration;

use opentelemetry_http::{Bytes, HttpClient, HttpError, Request, Response};
use opentelemetry_otlp::{Protocol, SpanExporter, WithExportConfig as _, WithHttpConfig as _};
use opentelemetry_sdk::Resource;

/// The process's resource: `service.name` is the service's unless
/// `OTEL_SERVICE_NAME` (or `OTEL_RESOURCE_ATTRIBUTES`) says otherwise.
pub(crate) fn resource(service: &'static str) -> Resource {
    let builder = Resource::builder();
    let named = std::env::var("OTEL_SERVICE_NAME").is_ok_and(|v| !v.is_empty())
        || std::env::var("OTEL_RESOURCE_ATTRIBUTES").is_ok_and(|v| v.contains("service.name="));
    if named { builder.build() } else { builder.with_service_name(service).build() }
}

fn variable(names: &[&str]) -> Option<String> {
    names.iter().find_map(|name| std::env::var(name).ok().filter(|v| !v.trim().is_empty()))
}

/// The exporter the environment asks for: none without an endpoint (or with
/// `OTEL_TRACES_EXPORTER=none`); an error for a protocol this build does not speak.
pub(crate) fn exporter() -> Result<Option<SpanExporter>, String> {
    if variable(&["OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"]).is_none()
        || variable(&["OTEL_TRACES_EXPORTER"]).is_some_and(|v| v == "none")
        || variable(&["OTEL_SDK_DISABLED"]).is_some_and(|v| v.eq_ignore_ascii_case("true"))
    {
        return Ok(None);
    }
    let protocol = match variable(&["OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"]).as_deref() {
        None | Some("http/protobuf") => Protocol::HttpBinary,
        Some("http/json") => Protocol::HttpJson,
        Some(other) => {
            return Err(format!(
                "OTEL_EXPORTER_OTLP_PROTOCOL={other} is not supported: use http/protobuf (the default) or http/json"
            ));
        }
    };
    let timeout = variable(&["OTEL_EXPORTER_OTLP_TRACES_TIMEOUT", "OTEL_EXPORTER_OTLP_TIMEOUT"])
        .and_then(|ms| ms.parse::<u64>().ok())
        .map_or(Duration::from_secs(10), Duration::from_millis);
    SpanExporter::builder()
        .with_http()
        .with_protocol(protocol)
        .with_http_client(UreqClient::new(timeout))
        .build()
        .map(Some)
        .map_err(|e| format!("building the OTLP exporter: {e}"))
}

/// The OTLP exporter's HTTP client.
#[derive(Debug)]
struct UreqClient(ureq::Agent);

impl UreqClient {
    fn new(timeout: Duration) -> Self {
        let agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(timeout))
            .max_redirects(0)
            .build()
            .new_agent();
        Self(agent)
    }
}

#[async_trait::async_trait]
impl HttpClient for UreqClient {
    async fn send_bytes(&self, request: Request<Bytes>) -> Result<Response<Bytes>, HttpError> {
        let (parts, body) = request.into_parts();
        let mut response = self.0.run(Request::from_parts(parts, body.to_vec()))?;
        let status = response.status();
        let body = response.body_mut().read_to_vec()?;
        Ok(Response::builder().status(status).body(Bytes::from(body))?)
    }
}
