//! Logging and tracing set-up, and the W3C `traceparent` that ties a request, its operation and
//! every model or tool call of that operation into one trace.
//!
//! Invariant kept here: logs and spans carry ids, kinds, classes, counts and timings; never job
//! inputs, prompts, model outputs, API tokens or secrets. Spans are exported over OTLP only when
//! `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set; without it no
//! exporter exists and nothing runs in the background.

use std::collections::HashMap;

use opentelemetry::propagation::TextMapPropagator;
use opentelemetry::trace::{TraceContextExt, TracerProvider as _};
use opentelemetry_otlp::{Protocol, WithExportConfig};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing::{Level, Metadata};
use tracing_opentelemetry::OpenTelemetrySpanExt;
use tracing_subscriber::filter::{EnvFilter, filter_fn};
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{Layer, fmt};

/// The W3C Trace Context header (HTTP requests and AMQP pointer messages).
pub const TRACEPARENT: &str = "traceparent";

/// The installed telemetry. Call [`Telemetry::shutdown`] when the process ends so the spans of
/// its last moments are exported.
#[must_use = "call shutdown() at exit so buffered spans are exported"]
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
}

impl Telemetry {
    /// True when spans are exported over OTLP.
    pub fn exporting(&self) -> bool {
        self.provider.is_some()
    }

    /// Exports the spans still buffered and stops the exporter. Call it outside the async
    /// runtime (the exporter's blocking HTTP client must not be dropped inside it).
    pub fn shutdown(self) {
        if let Some(provider) = self.provider
            && let Err(e) = provider.shutdown()
        {
            eprintln!("warning: flushing trace spans failed: {e}");
        }
    }
}

/// Installs the global subscriber: logs human-readable by default, JSON with
/// `AGENTQ_LOG_FORMAT=json`, filtered by `RUST_LOG` (default `info`), on stderr so `--json`
/// output on stdout stays clean; and, with an OTLP endpoint configured, a span exporter.
///
/// The exporter sends agentq's own spans (and the log events inside them) at `info` and above,
/// whatever `RUST_LOG` says, so a debug log level never turns library internals into spans.
/// `OTEL_EXPORTER_OTLP_PROTOCOL` picks `http/protobuf` (default) or `http/json`.
pub fn init() -> Telemetry {
    let filter = EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| EnvFilter::new("info,sqlx=warn,lapin=warn"));
    let json = std::env::var("AGENTQ_LOG_FORMAT").is_ok_and(|v| v == "json");
    let human = (!json).then(|| fmt::layer().with_writer(std::io::stderr));
    let machine = json.then(|| fmt::layer().json().with_writer(std::io::stderr));
    let logs = human.with_filter(filter.clone()).boxed();
    let logs_json = machine.with_filter(filter).boxed();

    let (provider, setup_error) = match exporter_configured() {
        false => (None, None),
        true => match build_provider() {
            Ok(p) => (Some(p), None),
            Err(e) => (None, Some(e)),
        },
    };
    let spans = provider.as_ref().map(|p| {
        tracing_opentelemetry::layer()
            .with_tracer(p.tracer("agentq"))
            .with_filter(filter_fn(exported))
    });
    let _ = tracing_subscriber::registry()
        .with(logs)
        .with(logs_json)
        .with(spans)
        .try_init();
    if let Some(e) = setup_error {
        tracing::warn!(error = %e, "OTLP trace export is configured but could not start; no spans are exported");
    }
    Telemetry { provider }
}

fn exporter_configured() -> bool {
    [
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    ]
    .iter()
    .any(|k| std::env::var(k).is_ok_and(|v| !v.trim().is_empty()))
}

/// Only agentq's spans and events at `info` or above are exported.
fn exported(meta: &Metadata<'_>) -> bool {
    meta.target().starts_with("agentq") && *meta.level() <= Level::INFO
}

fn build_provider() -> Result<SdkTracerProvider, String> {
    let protocol = match std::env::var("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")
        .or_else(|_| std::env::var("OTEL_EXPORTER_OTLP_PROTOCOL"))
        .as_deref()
        .map(str::trim)
    {
        Ok("http/json") => Protocol::HttpJson,
        Ok("http/protobuf") | Ok("") | Err(_) => Protocol::HttpBinary,
        Ok(other) => {
            return Err(format!(
                "OTEL_EXPORTER_OTLP_PROTOCOL={other:?} is not supported; use http/protobuf or http/json"
            ));
        }
    };
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_protocol(protocol)
        .build()
        .map_err(|e| e.to_string())?;
    let mut resource = opentelemetry_sdk::Resource::builder();
    if std::env::var("OTEL_SERVICE_NAME").is_err() {
        resource = resource.with_service_name("agentq");
    }
    Ok(SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(resource.build())
        .build())
}

/// The `traceparent` of `span` (its trace id and its own span id), if it is part of a trace:
/// what a producer stores on an operation so the worker's span becomes its child.
pub fn traceparent_of(span: &tracing::Span) -> Option<String> {
    let cx = span.context();
    if !cx.span().span_context().is_valid() {
        return None;
    }
    let mut carrier = HashMap::new();
    TraceContextPropagator::new().inject_context(&cx, &mut carrier);
    carrier.remove(TRACEPARENT)
}

/// [`traceparent_of`] the current span.
pub fn current_traceparent() -> Option<String> {
    traceparent_of(&tracing::Span::current())
}

/// Makes `span` a child of the remote span `traceparent` names (an incoming HTTP header, or
/// the one stored on an operation). Call it before the span is first entered. An absent or
/// malformed value leaves the span where it is (a new trace if it has no parent).
pub fn set_parent(span: &tracing::Span, traceparent: Option<&str>) {
    if let Some(cx) = traceparent.and_then(remote_context) {
        let _ = span.set_parent(cx);
    }
}

/// `value` if it is a well-formed W3C `traceparent` (normalized), else `None`.
pub fn valid_traceparent(value: &str) -> Option<String> {
    let cx = remote_context(value)?;
    let mut carrier = HashMap::new();
    TraceContextPropagator::new().inject_context(&cx, &mut carrier);
    carrier.remove(TRACEPARENT)
}

fn remote_context(traceparent: &str) -> Option<opentelemetry::Context> {
    let traceparent = traceparent.trim();
    // version-trace_id-parent_id-flags: 2, 32, 16 and 2 lowercase hex digits (W3C Trace Context).
    let parts: Vec<&str> = traceparent.split('-').collect();
    let well_formed = parts.len() == 4
        && parts.iter().zip([2, 32, 16, 2]).all(|(p, n)| {
            p.len() == n
                && p.bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        });
    if !well_formed {
        return None;
    }
    let carrier = HashMap::from([(TRACEPARENT.to_string(), traceparent.to_string())]);
    let cx = TraceContextPropagator::new().extract(&carrier);
    cx.span().span_context().is_valid().then_some(cx)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traceparent_validation() {
        let ok = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        assert_eq!(valid_traceparent(ok).as_deref(), Some(ok));
        for bad in [
            "",
            "garbage",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
        ] {
            assert_eq!(valid_traceparent(bad), None, "{bad:?}");
        }
    }
}
