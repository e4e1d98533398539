//! The `Cost` service: the price catalog and cost reports over the replicated ledger
//! ([`suanli_state::cost`], docs/cost.md).
//!
//! ```text
//!  SetPrices ─▶ parse decimals (field named on error) ─▶ SetPrices{catalog} ─▶ committed
//!  GetPrices, Report ─▶ linearizable reads of the ledger at the state's clock
//! ```

use crate::core::Core;
use crate::status::invalid;
use std::collections::BTreeSet;
use std::sync::Arc;
use suanli_proto::v1 as pb;
use suanli_proto::v1::cost_server::Cost;
use suanli_state::Command;
use suanli_state::cost::{
    Amounts, BASE_PER_MICRO, DevicePrice, PriceCatalog, ReportBy, SetPrices, format_amount, format_micro, parse_price,
};
use tonic::{Request, Status};

type Resp<T> = Result<tonic::Response<T>, Status>;

/// Most rows in one report; the rest are summed into one `(more)` row.
pub const MAX_REPORT_ROWS: usize = 5000;

/// The `Cost` service.
#[derive(Clone)]
pub struct CostApi(pub Arc<Core>);

/// A catalog from its wire form: every price is a decimal with at most 6 fractional digits.
pub fn catalog_from(c: &pb::PriceCatalogInfo) -> Result<PriceCatalog, Status> {
    let price = |field: &str, v: &str| -> Result<u64, Status> {
        if v.is_empty() {
            return Ok(0);
        }
        parse_price(field, v).map_err(|e| invalid(field, e))
    };
    let mut devices = Vec::with_capacity(c.devices.len().min(suanli_state::cost::MAX_DEVICE_PRICES + 1));
    for (i, d) in c.devices.iter().enumerate() {
        let field = format!("catalog.devices[{i}].per_hour");
        devices.push(DevicePrice {
            model: d.model.clone(),
            pool: d.pool.clone(),
            region: d.region.clone(),
            micro_per_hour: price(&field, &d.per_hour)?,
        });
    }
    let cat = PriceCatalog {
        currency: c.currency.clone(),
        devices,
        cpu_core_hour_micro: price("catalog.cpu_core_hour", &c.cpu_core_hour)?,
        memory_gib_hour_micro: price("catalog.memory_gib_hour", &c.memory_gib_hour)?,
    };
    cat.validate().map_err(|e| crate::status::rejection(&e))?;
    Ok(cat)
}

/// A catalog in its wire form.
pub fn catalog_info(c: &PriceCatalog) -> pb::PriceCatalogInfo {
    pb::PriceCatalogInfo {
        currency: c.currency.clone(),
        devices: c
            .devices
            .iter()
            .map(|d| pb::DevicePriceInfo {
                model: d.model.clone(),
                pool: d.pool.clone(),
                region: d.region.clone(),
                per_hour: format_micro(d.micro_per_hour),
            })
            .collect(),
        cpu_core_hour: format_micro(c.cpu_core_hour_micro),
        memory_gib_hour: format_micro(c.memory_gib_hour_micro),
    }
}

fn amounts(a: &Amounts, f: impl Fn(i128) -> String) -> pb::CostAmounts {
    pb::CostAmounts {
        useful: f(a.useful),
        lost_preemption: f(a.lost_preemption),
        lost_failure: f(a.lost_failure),
        running: f(a.running),
        idle: f(a.idle),
        total: f(a.total()),
    }
}

fn row(key: String, a: &Amounts) -> pb::CostRow {
    pb::CostRow { key, amounts: Some(amounts(a, format_amount)), base: Some(amounts(a, |v| v.to_string())) }
}

/// A report in its wire form.
pub fn report_info(by: &str, currency: &str, r: &suanli_state::cost::Report) -> pb::CostReportResponse {
    let mut rows = Vec::with_capacity(r.rows.len().min(MAX_REPORT_ROWS + 1));
    let mut more = Amounts::default();
    for (i, (k, a)) in r.rows.iter().enumerate() {
        if i < MAX_REPORT_ROWS {
            rows.push(row(k.clone(), a));
        } else {
            more.merge(a);
        }
    }
    if r.rows.len() > MAX_REPORT_ROWS {
        rows.push(row("(more)".into(), &more));
    }
    pb::CostReportResponse {
        by: by.to_owned(),
        since: r.since,
        until: r.until,
        horizon: r.horizon,
        currency: currency.to_owned(),
        rows,
        total: Some(row("total".into(), &r.total)),
        capacity: format_amount(r.capacity),
        capacity_base: r.capacity.to_string(),
        conserved: r.total.total() == r.capacity,
        base_per_micro: BASE_PER_MICRO.to_string(),
    }
}

#[tonic::async_trait]
impl Cost for CostApi {
    async fn set_prices(&self, req: Request<pb::SetPricesRequest>) -> Resp<pb::SetPricesResponse> {
        let r = req.into_inner();
        let catalog = catalog_from(&r.catalog.unwrap_or_default())?;
        let (_, revision) = self.0.propose(Command::SetPrices(SetPrices { catalog, now: 0 })).await?;
        tracing::info!("prices set");
        Ok(tonic::Response::new(pb::SetPricesResponse { revision }))
    }

    async fn get_prices(&self, _req: Request<pb::GetPricesRequest>) -> Resp<pb::GetPricesResponse> {
        let r = self
            .0
            .read(false, |s| {
                let prices = &s.ledger().prices;
                let mut unpriced = BTreeSet::new();
                for n in s.nodes().values() {
                    for d in &n.node.devices {
                        if prices.device_price(&d.model, n.node.pool.as_str(), &n.node.region).is_none() {
                            unpriced.insert(d.model.clone());
                        }
                    }
                }
                pb::GetPricesResponse {
                    catalog: Some(catalog_info(prices)),
                    unpriced_models: unpriced.into_iter().collect(),
                }
            })
            .await?;
        Ok(tonic::Response::new(r))
    }

    async fn report(&self, req: Request<pb::CostReportRequest>) -> Resp<pb::CostReportResponse> {
        let r = req.into_inner();
        let by: ReportBy = r.by.parse().map_err(|e: String| invalid("by", e))?;
        if r.until != 0 && r.until < r.since {
            return Err(invalid("until", format!("{} is before since ({})", r.until, r.since)));
        }
        // Up to this server's clock: the replicated clock only moves when a command carries
        // a time, so an idle region's capacity would otherwise stop accruing at its last command.
        let now = self.0.now_s();
        let resp = self
            .0
            .read(false, |s| {
                let rep = s.ledger().report(by, r.since, r.until, now.max(s.clock()));
                report_info(&r.by, &s.ledger().prices.currency, &rep)
            })
            .await?;
        Ok(tonic::Response::new(resp))
    }
}
