//! The checkpoint manifest a task writes (suanli-model's `CheckpointManifest::decode`), which the
//! agent reads from a directory the task controls. Properties: decoding never panics; a manifest
//! that decodes passes the path check, and its JSON encoding decodes to the same manifest.
#![no_main]

use libfuzzer_sys::fuzz_target;
use suanli_model::checkpoint::{CheckpointManifest, check_checkpoint_path};

/// The agent's default `max_manifest_bytes` is 64 KiB; a smaller limit is exercised too.
const LIMITS: [u64; 2] = [64 * 1024, 64];

fuzz_target!(|data: &[u8]| {
    for limit in LIMITS {
        let Ok(m) = CheckpointManifest::decode(data, limit) else { continue };
        assert!(data.len() as u64 <= limit);
        check_checkpoint_path(&m.path).expect("a decoded manifest's path is valid");
        let text = serde_json::to_vec(&m).expect("a manifest encodes");
        let back = CheckpointManifest::decode(&text, u64::MAX).expect("an encoded manifest decodes");
        assert_eq!(back, m);
    }
});
