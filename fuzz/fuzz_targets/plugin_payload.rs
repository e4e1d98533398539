//! The payloads a device plugin returns across the C ABI (protobuf, `device.proto`), as the
//! plugin host decodes them, and the checks the agent and `suanli plugin check` run on them
//! (suanli-device-host's `check::validate_*`). Properties: decoding and validating never panic;
//! a payload that decodes re-encodes to bytes that decode and re-encode to the same bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use prost::Message;
use std::collections::BTreeSet;
use suanli_device_host::check;
use suanli_device_host::pb;

/// Compared as bytes: a `double` field may hold NaN, which no value equals.
fn round_trip<M: Message + Default>(m: &M) {
    let once = m.encode_to_vec();
    let back = M::decode(once.as_slice()).expect("a re-encoded payload decodes");
    assert_eq!(back.encode_to_vec(), once, "the encoding is stable");
}

fuzz_target!(|data: &[u8]| {
    // The first byte picks the message; it decodes the rest.
    let Some((&which, rest)) = data.split_first() else { return };
    match which % 6 {
        0 => {
            let Ok(inv) = pb::Inventory::decode(rest) else { return };
            round_trip(&inv);
            let problems = check::validate_inventory(&inv);
            if problems.is_empty() {
                let known: BTreeSet<&str> = inv.devices.iter().map(|d| d.id.as_str()).collect();
                let _ = check::validate_stats(Some(&known), &[], &pb::StatsResponse::default());
            }
        }
        1 => {
            let Ok(r) = pb::Reservation::decode(rest) else { return };
            round_trip(&r);
            let _ = check::validate_reservation(&pb::PluginDevice::default(), &r);
        }
        2 => {
            let Ok(s) = pb::StatsResponse::decode(rest) else { return };
            round_trip(&s);
            let _ = check::validate_stats(None, &[], &s);
            let ids: Vec<String> = s.devices.iter().map(|d| d.id.clone()).collect();
            let known: BTreeSet<&str> = ids.iter().map(String::as_str).collect();
            let _ = check::validate_stats(Some(&known), &ids, &s);
        }
        3 => {
            let Ok(ev) = pb::HealthEvents::decode(rest) else { return };
            round_trip(&ev);
            let _ = check::validate_health(None, &ev);
        }
        4 => {
            let Ok(c) = pb::PluginConfig::decode(rest) else { return };
            round_trip(&c);
        }
        _ => {
            let Ok(r) = pb::ReserveRequest::decode(rest) else { return };
            round_trip(&r);
        }
    }
});
