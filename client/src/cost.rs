//! Typed calls of the `Cost` service (docs/cost.md).

use crate::conn::CallChannel as Channel;
use crate::conn::Connection;
use crate::error::ClientError;
use suanli_proto::v1 as pb;

impl Connection {
    fn cost(&self, ch: Channel) -> pb::cost_client::CostClient<Channel> {
        pb::cost_client::CostClient::new(ch).max_decoding_message_size(self.config().max_reply_bytes)
    }

    /// Replaces the price catalog (admin); answers the log index. Safe to retry.
    pub async fn set_prices(&self, catalog: pb::PriceCatalogInfo) -> Result<u64, ClientError> {
        self.call(|ch| {
            let req = pb::SetPricesRequest { catalog: Some(catalog.clone()) };
            let mut c = self.cost(ch);
            async move { c.set_prices(req).await }
        })
        .await
        .map(|r| r.revision)
    }

    /// The price catalog and the device models without a price.
    pub async fn get_prices(&self) -> Result<pb::GetPricesResponse, ClientError> {
        self.call(|ch| {
            let mut c = self.cost(ch);
            async move { c.get_prices(pb::GetPricesRequest {}).await }
        })
        .await
    }

    /// A cost report grouped `by` team, queue, job or pool over `[since, until)` (seconds
    /// since the epoch; 0: open).
    pub async fn cost_report(&self, by: &str, since: u64, until: u64) -> Result<pb::CostReportResponse, ClientError> {
        self.call(|ch| {
            let req = pb::CostReportRequest { by: by.to_owned(), since, until };
            let mut c = self.cost(ch);
            async move { c.report(req).await }
        })
        .await
    }
}
