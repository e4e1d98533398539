//! The trace CSV readers of the simulator (suanli-sim's `trace`): Alibaba nodes, Alibaba pods and
//! the native pod format. Property: reading never panics, and every pod read answers its
//! resource, device and constraint questions (what a replay asks) without panicking.
#![no_main]

use libfuzzer_sys::fuzz_target;
use suanli_sim::trace;

fuzz_target!(|data: &[u8]| {
    // The first byte picks the reader; it reads the rest as text.
    let Some((&which, rest)) = data.split_first() else { return };
    let Ok(text) = std::str::from_utf8(rest) else { return };
    match which % 3 {
        0 => {
            if let Ok(nodes) = trace::parse_alibaba_nodes_str("fuzz.csv", text) {
                for n in &nodes {
                    let _ = serde_json::to_string(n).expect("a node encodes");
                }
            }
        }
        kind => {
            let read = if kind == 1 {
                trace::parse_alibaba_pods_str("fuzz.csv", text)
            } else {
                trace::parse_native_pods_str("fuzz.csv", text)
            };
            let Ok(mut pods) = read else { return };
            for p in &pods {
                let _ = (p.devices(), p.resources(), p.constraints(), p.gpu_request_milli());
            }
            trace::compress_arrivals(&mut pods, 1 + u64::from(which >> 4));
        }
    }
});
