//! Typed calls to a federation (`suanli federation serve`, docs/federation.md) through the
//! same leader-following [`Connection`] as a region's: UNAVAILABLE moves on to the next listed
//! federation server or to the leader a `suanli-leader` hint names; a submission is retried
//! with the same `client_request_id`, so a retry never creates a second job.
//!
//! A federation takes client certificates only (bearer tokens are region-local).

use crate::backoff;
use crate::conn::CallChannel as Channel;
use crate::conn::{Connection, ConnectionConfig};
use crate::error::ClientError;
use std::time::Duration;
use suanli_proto::v1 as pb;
use suanli_proto::v1::federation_client::FederationClient;

/// A connection to the federation servers at `addrs` (the same [`ConnectionConfig`] as a
/// region's; give it TLS with a certificate).
pub fn connect_federation(addrs: &[String], cfg: ConnectionConfig) -> Result<Connection, ClientError> {
    Connection::new(addrs, cfg)
}

impl Connection {
    fn federation(&self, ch: Channel) -> FederationClient<Channel> {
        FederationClient::new(ch).max_decoding_message_size(self.config().max_reply_bytes)
    }

    /// `Federation.Submit`, retried on transport failures with the same request.
    pub async fn fed_submit(
        &self,
        req: pb::FedSubmitRequest,
        on_retry: impl FnMut(&ClientError, Duration),
    ) -> Result<pb::FedSubmitResponse, ClientError> {
        backoff::SUBMIT
            .retry(
                || {
                    let req = req.clone();
                    self.call(move |ch| {
                        let req = req.clone();
                        let mut c = self.federation(ch);
                        async move { c.submit(req).await }
                    })
                },
                ClientError::is_transient,
                on_retry,
            )
            .await
    }

    /// `Federation.Cancel`.
    pub async fn fed_cancel(&self, global_id: &str) -> Result<(), ClientError> {
        let req = pb::FedCancelRequest { global_id: global_id.to_owned() };
        self.call(move |ch| {
            let req = req.clone();
            let mut c = self.federation(ch);
            async move { c.cancel(req).await }
        })
        .await
        .map(|_| ())
    }

    /// `Federation.Sync` (a region leader's periodic call).
    pub async fn fed_sync(&self, req: pb::RegionSyncRequest) -> Result<pb::RegionSyncResponse, ClientError> {
        self.call(move |ch| {
            let req = req.clone();
            let mut c = self.federation(ch);
            async move { c.sync(req).await }
        })
        .await
    }

    /// `Federation.Status` (any member answers).
    pub async fn fed_status(&self) -> Result<pb::FedStatusResponse, ClientError> {
        self.call(move |ch| {
            let mut c = self.federation(ch);
            async move { c.status(pb::FedStatusRequest {}).await }
        })
        .await
    }

    /// `Federation.Regions`: the directory and the global quotas.
    pub async fn fed_regions(&self) -> Result<pb::FedRegionsResponse, ClientError> {
        self.call(move |ch| {
            let mut c = self.federation(ch);
            async move { c.regions(pb::FedRegionsRequest {}).await }
        })
        .await
    }

    /// `Federation.Cost`: the global cost roll-up, by `team` or `region`.
    pub async fn fed_cost(&self, by: &str) -> Result<pb::CostReportResponse, ClientError> {
        let by = by.to_owned();
        self.call(move |ch| {
            let mut c = self.federation(ch);
            let by = by.clone();
            async move { c.cost(pb::FedCostRequest { by }).await }
        })
        .await
    }

    /// `Federation.Jobs`, every page (up to `cap` jobs).
    pub async fn fed_jobs(
        &self,
        state: &str,
        region: &str,
        cap: Option<u32>,
    ) -> Result<Vec<pb::FedJobInfo>, ClientError> {
        let (state, region) = (state.to_owned(), region.to_owned());
        // Pages by job number (`g-<n>`: n), so tokens compare as numbers.
        self.pages(cap, move |ch, after: u64, limit| {
            let after = if after == 0 { String::new() } else { format!("g-{after}") };
            let req = pb::FedJobsRequest { state: state.clone(), region: region.clone(), limit, after };
            let mut c = self.federation(ch);
            async move {
                let r = c.jobs(req).await?;
                let (meta, r, ext) = r.into_parts();
                let next = match r.next.as_str() {
                    "" => 0,
                    n => n.strip_prefix("g-").and_then(|n| n.parse().ok()).ok_or_else(|| {
                        tonic::Status::internal(format!("the federation answered a page token {n:?} that is not g-<n>"))
                    })?,
                };
                Ok(tonic::Response::from_parts(meta, (r.jobs, next), ext))
            }
        })
        .await
    }

    /// `Federation.GetJob`.
    pub async fn fed_get_job(&self, global_id: &str) -> Result<pb::FedJobInfo, ClientError> {
        let req = pb::FedGetJobRequest { global_id: global_id.to_owned() };
        self.call(move |ch| {
            let req = req.clone();
            let mut c = self.federation(ch);
            async move { c.get_job(req).await }
        })
        .await
    }

    /// `Federation.SetQuota` (0 removes it).
    pub async fn fed_set_quota(&self, team: &str, device_model: &str, limit_milli: u64) -> Result<(), ClientError> {
        let req = pb::FedSetQuotaRequest { team: team.to_owned(), device_model: device_model.to_owned(), limit_milli };
        self.call(move |ch| {
            let req = req.clone();
            let mut c = self.federation(ch);
            async move { c.set_quota(req).await }
        })
        .await
        .map(|_| ())
    }

    /// `Federation.AddServer` (admin; the leader answers, a follower's hint is followed).
    pub async fn fed_add_server(&self, req: pb::AddServerRequest) -> Result<(), ClientError> {
        self.call(move |ch| {
            let req = req.clone();
            let mut c = self.federation(ch);
            async move { c.add_server(req).await }
        })
        .await
        .map(|_| ())
    }

    /// `Federation.RemoveServer` (admin).
    pub async fn fed_remove_server(&self, id: u64) -> Result<(), ClientError> {
        self.call(move |ch| {
            let mut c = self.federation(ch);
            async move { c.remove_server(pb::RemoveServerRequest { id }).await }
        })
        .await
        .map(|_| ())
    }
}
