//! Fill reports: aggregation over seeds, table/JSON/CSV output and an SVG chart.

use crate::fill::{CURVE_POINTS, FillRun, curve_at};
use serde::Serialize;
use std::fmt::Write as _;
use suanli_scheduler::policy::Ties;

/// One policy's results over all seeds.
#[derive(Debug, Clone, Serialize)]
pub struct PolicySummary {
    /// Policy.
    pub policy: String,
    /// Seeds run.
    pub seeds: Vec<u64>,
    /// Mean allocation (%) at each 1% of arrived GPU request.
    pub mean_curve: Vec<Option<f64>>,
    /// Mean allocation at 100% arrived.
    pub alloc_at_100: f64,
    /// Mean allocation at 130% arrived (or the last point reached).
    pub alloc_at_130: f64,
    /// Standard deviation at 130% over seeds.
    pub alloc_at_130_sd: f64,
    /// Allocation at 130% per seed, in the order of `seeds` (`None` where the run did not reach
    /// it): for paired comparisons between policies run on the same seeds.
    pub alloc_at_130_by_seed: Vec<Option<f64>>,
    /// Mean offline bound given the CPU-only pods each run placed (when the runs computed it).
    pub bound_given_placed: Option<f64>,
    /// Mean failed pods.
    pub failed_pods: f64,
    /// Mean final fragmentation, % of cluster GPUs.
    pub frag: f64,
    /// Mean fragmentation as % of free GPUs.
    pub frag_of_free: f64,
    /// Mean placing time per run, seconds.
    pub seconds_per_run: f64,
    /// Mean placements per second.
    pub placements_per_s: f64,
    /// Runs whose rehearsal chose `by-kind` ties, of the runs that rehearsed (`suanli` only).
    pub rehearsed_by_kind: Option<(usize, usize)>,
    /// Mean rehearsed gain of `by-kind` over `first-fit` ties, points (`suanli` only).
    pub rehearsed_gain: Option<f64>,
}

fn mean(v: &[f64]) -> f64 {
    if v.is_empty() { 0.0 } else { v.iter().sum::<f64>() / v.len() as f64 }
}

/// Aggregates runs of one policy.
pub fn summarize(policy: &str, runs: &[FillRun]) -> PolicySummary {
    let mut mean_curve = Vec::with_capacity(CURVE_POINTS);
    for x in 0..CURVE_POINTS {
        let vals: Vec<f64> = runs.iter().filter_map(|r| r.curve[x]).collect();
        mean_curve.push((vals.len() == runs.len() && !vals.is_empty()).then(|| mean(&vals)));
    }
    let at = |x: usize| -> Vec<f64> { runs.iter().filter_map(|r| curve_at(&r.curve, x)).collect() };
    let a130 = at(130);
    let m130 = mean(&a130);
    let sd = (a130.iter().map(|v| (v - m130).powi(2)).sum::<f64>() / a130.len().max(1) as f64).sqrt();
    PolicySummary {
        policy: policy.to_owned(),
        seeds: runs.iter().map(|r| r.seed).collect(),
        mean_curve,
        alloc_at_100: mean(&at(100)),
        alloc_at_130: m130,
        alloc_at_130_sd: sd,
        alloc_at_130_by_seed: runs.iter().map(|r| curve_at(&r.curve, 130)).collect(),
        bound_given_placed: {
            let b: Vec<f64> = runs.iter().filter_map(|r| r.bound_given_placed).collect();
            (!b.is_empty() && b.len() == runs.len()).then(|| mean(&b))
        },
        failed_pods: mean(&runs.iter().map(|r| r.failed_pods as f64).collect::<Vec<_>>()),
        frag: mean(&runs.iter().map(|r| r.final_frag).collect::<Vec<_>>()),
        frag_of_free: mean(&runs.iter().map(|r| r.final_frag_of_free).collect::<Vec<_>>()),
        seconds_per_run: mean(&runs.iter().map(|r| r.place_seconds).collect::<Vec<_>>()),
        placements_per_s: mean(
            &runs.iter().map(|r| r.placements as f64 / r.place_seconds.max(1e-9)).collect::<Vec<_>>(),
        ),
        rehearsed_by_kind: {
            let r: Vec<_> = runs.iter().filter_map(|r| r.rehearsal.as_ref()).filter(|r| r.runs > 0).collect();
            (!r.is_empty()).then(|| (r.iter().filter(|r| r.ties == Ties::ByKind).count(), r.len()))
        },
        rehearsed_gain: {
            let g: Vec<f64> =
                runs.iter().filter_map(|r| r.rehearsal.as_ref()).filter(|r| r.runs > 0).map(|r| r.gain()).collect();
            (!g.is_empty()).then(|| mean(&g))
        },
    }
}

/// A fixed-width table, one row per policy.
pub fn table(sums: &[PolicySummary]) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{:<14} {:>6} {:>10} {:>10} {:>7} {:>10} {:>10} {:>9} {:>12}",
        "policy", "seeds", "alloc@100", "alloc@130", "sd", "failed", "frag%", "frag/free", "s/run"
    );
    for p in sums {
        let _ = writeln!(
            s,
            "{:<14} {:>6} {:>10.2} {:>10.2} {:>7.2} {:>10.1} {:>10.2} {:>9.2} {:>12.3}",
            p.policy,
            p.seeds.len(),
            p.alloc_at_100,
            p.alloc_at_130,
            p.alloc_at_130_sd,
            p.failed_pods,
            p.frag,
            p.frag_of_free,
            p.seconds_per_run
        );
    }
    for p in sums {
        if let (Some((k, n)), Some(g)) = (p.rehearsed_by_kind, p.rehearsed_gain) {
            let _ = writeln!(
                s,
                "{}: by-kind ties on {k} of {n} runs, first-fit (FGD's) on the others (rehearsed gain of by-kind {g:+.2} points)",
                p.policy
            );
        }
    }
    s
}

/// CSV of mean curves: `policy,arrived_pct,alloc_pct`.
pub fn curves_csv(sums: &[PolicySummary]) -> String {
    let mut s = String::from("policy,arrived_pct,alloc_pct\n");
    for p in sums {
        for (x, v) in p.mean_curve.iter().enumerate() {
            if let Some(v) = v {
                let _ = writeln!(s, "{},{x},{v:.4}", p.policy);
            }
        }
    }
    s
}

/// An SVG line chart of the mean allocation curves (x: arrived %, y: allocated %).
pub fn curves_svg(title: &str, sums: &[PolicySummary]) -> String {
    const W: f64 = 760.0;
    const H: f64 = 480.0;
    const L: f64 = 60.0;
    const R: f64 = 170.0;
    const T: f64 = 40.0;
    const B: f64 = 50.0;
    let colors = ["#d62728", "#1f77b4", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"];
    let px = |x: f64| L + x / 130.0 * (W - L - R);
    let py = |y: f64| T + (1.0 - y / 100.0) * (H - T - B);
    let esc = |t: &str| t.replace('&', "&amp;").replace('<', "&lt;").replace('>', "&gt;");
    let mut s = String::new();
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<rect width="100%" height="100%" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="{}" y="22" font-size="15" text-anchor="middle">{}</text>"#,
        (W - R + L) / 2.0,
        esc(title)
    );
    for k in (0..=130).step_by(10) {
        let x = px(f64::from(k));
        let _ =
            writeln!(s, r##"<line x1="{x:.1}" y1="{:.1}" x2="{x:.1}" y2="{:.1}" stroke="#eee"/>"##, py(0.0), py(100.0));
        let _ = writeln!(s, r#"<text x="{x:.1}" y="{:.1}" text-anchor="middle">{k}</text>"#, py(0.0) + 16.0);
    }
    for k in (0..=100).step_by(10) {
        let y = py(f64::from(k));
        let _ =
            writeln!(s, r##"<line x1="{:.1}" y1="{y:.1}" x2="{:.1}" y2="{y:.1}" stroke="#eee"/>"##, px(0.0), px(130.0));
        let _ = writeln!(s, r#"<text x="{:.1}" y="{:.1}" text-anchor="end">{k}</text>"#, px(0.0) - 6.0, y + 4.0);
    }
    let _ = writeln!(
        s,
        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle">arrived GPU request (% of cluster GPUs)</text>"#,
        px(65.0),
        H - 10.0
    );
    let _ = writeln!(
        s,
        r#"<text transform="translate(16,{:.1}) rotate(-90)" text-anchor="middle">GPU allocation ratio (%)</text>"#,
        py(50.0)
    );
    for (i, p) in sums.iter().enumerate() {
        let c = colors[i % colors.len()];
        let pts: Vec<String> = p
            .mean_curve
            .iter()
            .enumerate()
            .filter_map(|(x, v)| v.map(|v| format!("{:.1},{:.1}", px(x as f64), py(v))))
            .collect();
        let _ = writeln!(s, r#"<polyline fill="none" stroke="{c}" stroke-width="1.6" points="{}"/>"#, pts.join(" "));
        let ly = T + 16.0 + i as f64 * 20.0;
        let _ = writeln!(
            s,
            r#"<line x1="{:.1}" y1="{ly:.1}" x2="{:.1}" y2="{ly:.1}" stroke="{c}" stroke-width="3"/>"#,
            W - R + 10.0,
            W - R + 30.0
        );
        let _ = writeln!(
            s,
            r#"<text x="{:.1}" y="{:.1}">{} ({:.2})</text>"#,
            W - R + 36.0,
            ly + 4.0,
            esc(&p.policy),
            p.alloc_at_130
        );
    }
    s.push_str("</svg>\n");
    s
}
