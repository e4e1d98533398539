//! Generates the prost messages of `proto/proto/suanli/v1/device.proto` (messages only: the
//! file has no services, and this crate has no gRPC dependency).
//!
//! protoc comes from `protoc-bin-vendored` (nothing to install) unless `PROTOC` names another.

use std::path::PathBuf;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let dir = PathBuf::from("../../proto/proto");
    let file = dir.join("suanli/v1/device.proto");
    println!("cargo:rerun-if-changed={}", file.display());
    println!("cargo:rerun-if-env-changed=PROTOC");
    let protoc = match std::env::var_os("PROTOC") {
        Some(p) => PathBuf::from(p),
        None => protoc_bin_vendored::protoc_bin_path()?,
    };
    let mut config = prost_build::Config::new();
    config.protoc_executable(&protoc);
    // As in suanli-proto, which re-exports these messages: ordered maps, and serde::Serialize
    // for clients' JSON output (NodeInfo.stats carries DeviceStats).
    config.btree_map(["."]);
    config.type_attribute(".", "#[derive(serde::Serialize)]");
    config.compile_protos(&[file], std::slice::from_ref(&dir))?;

    // Descriptor sets of device.proto and of the C vendors' proto2 copy of it
    // (device-plugins/abi/include/suanli_device.proto), which the unit test `c_schema` compares.
    let out = PathBuf::from(std::env::var_os("OUT_DIR").ok_or("OUT_DIR is not set")?);
    let c_dir = PathBuf::from("../abi/include");
    println!("cargo:rerun-if-changed={}", c_dir.join("suanli_device.proto").display());
    for (desc, include, name) in
        [("device_proto3.desc", &dir, "suanli/v1/device.proto"), ("device_c.desc", &c_dir, "suanli_device.proto")]
    {
        let st = std::process::Command::new(&protoc)
            .arg(format!("--descriptor_set_out={}", out.join(desc).display()))
            .arg("-I")
            .arg(include)
            .arg(name)
            .status()?;
        if !st.success() {
            return Err(format!("protoc {name}: {st}").into());
        }
    }
    Ok(())
}
