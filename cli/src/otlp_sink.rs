//! An in-process OTLP receiver (the collector's `TraceService` over gRPC, plaintext on
//! loopback) that counts the spans it gets: what `bench submit --compare-tracing` exports to.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use anyhow::{Context as _, Result};
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{TraceService, TraceServiceServer};
use opentelemetry_proto::tonic::collector::trace::v1::{ExportTraceServiceRequest, ExportTraceServiceResponse};

/// Counts the spans received.
#[derive(Debug, Clone, Default)]
pub struct Sink {
    spans: Arc<AtomicU64>,
}

#[tonic::async_trait]
impl TraceService for Sink {
    async fn export(
        &self,
        req: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let n: usize =
            req.get_ref().resource_spans.iter().flat_map(|r| r.scope_spans.iter()).map(|s| s.spans.len()).sum();
        self.spans.fetch_add(n as u64, Ordering::Relaxed);
        Ok(tonic::Response::new(ExportTraceServiceResponse { partial_success: None }))
    }
}

impl Sink {
    /// Starts a receiver on a loopback port (on the current runtime); it and its endpoint
    /// (`http://127.0.0.1:PORT`).
    pub async fn start() -> Result<(Sink, String)> {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.context("binding the OTLP receiver")?;
        let addr = l.local_addr().context("the OTLP receiver's address")?;
        let sink = Sink::default();
        let svc = TraceServiceServer::new(sink.clone());
        tokio::spawn(async move {
            let incoming = tonic::transport::server::TcpIncoming::from(l);
            if let Err(e) = tonic::transport::Server::builder().add_service(svc).serve_with_incoming(incoming).await {
                eprintln!("OTLP receiver: {e}");
            }
        });
        Ok((sink, format!("http://{addr}")))
    }

    /// Spans received so far.
    pub fn spans(&self) -> u64 {
        self.spans.load(Ordering::Relaxed)
    }
}
