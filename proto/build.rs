//! Generates the tonic/prost code from `proto/suanli/v1/*.proto`.
//!
//! protoc comes from `protoc-bin-vendored` (nothing to install) unless `PROTOC` names another.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto");
    println!("cargo:rerun-if-env-changed=PROTOC");
    let protoc = match std::env::var_os("PROTOC") {
        Some(p) => PathBuf::from(p),
        None => protoc_bin_vendored::protoc_bin_path()?,
    };
    let mut config = prost_build::Config::new();
    config.protoc_executable(protoc);
    config.bytes([
        ".suanli.v1.RaftMessage.body",
        ".suanli.v1.SnapshotChunk.data",
        ".suanli.v1.ProposeRequest.command_json",
        ".suanli.v1.ProposeResponse.response_json",
        ".suanli.v1.FedProposeRequest.command_json",
        ".suanli.v1.FedProposeResponse.response_json",
    ]);
    // device.proto's messages are generated once, by `suanli-device-proto` (prost alone, so a
    // device plugin links no tonic); the code generated here refers to them there, and lib.rs
    // re-exports them in `v1`. Every top-level message of the file is mapped.
    let device = std::fs::read_to_string("proto/suanli/v1/device.proto")?;
    for line in device.lines() {
        if let Some(name) = line.strip_prefix("message ").and_then(|r| r.split_whitespace().next()) {
            config.extern_path(format!(".suanli.v1.{name}"), format!("::suanli_device_proto::v1::{name}"));
        }
    }
    // Ordered maps: whatever prints or hashes a map sees its keys in order.
    config.btree_map(["."]);
    // JSON through serde for clients (`--output json`): field names as in the .proto files.
    config.type_attribute(".", "#[derive(serde::Serialize)]");
    for f in [
        ".suanli.v1.RaftMessage.body",
        ".suanli.v1.SnapshotChunk.data",
        ".suanli.v1.ProposeRequest.command_json",
        ".suanli.v1.ProposeResponse.response_json",
        ".suanli.v1.FedProposeRequest.command_json",
        ".suanli.v1.FedProposeResponse.response_json",
    ] {
        config.field_attribute(f, "#[serde(skip)]");
    }
    config.field_attribute(".suanli.v1.NodeInfo.mode", "#[serde(serialize_with = \"crate::json::node_mode\")]");
    config.field_attribute(
        ".suanli.v1.FedJobInfo.spec_json",
        "#[serde(rename = \"spec\", serialize_with = \"crate::json::embedded\")]",
    );
    config.field_attribute(
        ".suanli.v1.JobInfo.spec_json",
        "#[serde(rename = \"spec\", serialize_with = \"crate::json::embedded\")]",
    );
    // The descriptors of every file, for gRPC server reflection (`FILE_DESCRIPTOR_SET`).
    let out = PathBuf::from(std::env::var_os("OUT_DIR").ok_or("OUT_DIR is not set")?);
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .file_descriptor_set_path(out.join("suanli_descriptor.bin"))
        .compile_with_config(
            config,
            &[
                "proto/suanli/v1/types.proto",
                "proto/suanli/v1/api.proto",
                "proto/suanli/v1/access.proto",
                "proto/suanli/v1/agent.proto",
                "proto/suanli/v1/raft.proto",
                "proto/suanli/v1/internal.proto",
                "proto/suanli/v1/device.proto",
                "proto/suanli/v1/federation.proto",
                "proto/suanli/v1/cost.proto",
            ],
            &["proto"],
        )?;
    Ok(())
}
