//! The generated types encode and decode, and the services are generated.

use prost::Message;
use suanli_proto::v1;

#[test]
fn messages_round_trip() {
    let req = v1::SubmitJobRequest {
        global: false,
        team: String::new(),
        client_request_id: "r-1".into(),
        spec_json: "{}".into(),
        retry: Some(v1::RetryPolicy { max_attempts: 3, backoff_base_s: 10, backoff_max_s: 60 }),
    };
    let bytes = req.encode_to_vec();
    assert_eq!(v1::SubmitJobRequest::decode(bytes.as_slice()).expect("decodes"), req);

    let chunk = v1::SnapshotChunk {
        group: "region".into(),
        offset: 7,
        data: vec![0u8, 255].into(),
        done: true,
        ..Default::default()
    };
    let back = v1::SnapshotChunk::decode(chunk.encode_to_vec().as_slice()).expect("decodes");
    assert_eq!(back.data.as_ref(), &[0u8, 255]);
    assert!(v1::RaftMessage::decode(&b"\xff\xff"[..]).is_err(), "garbage is an error, not a panic");
}

#[test]
fn services_are_generated() {
    // Naming the generated client and server types is enough to prove they exist.
    fn _clients(_: Option<v1::jobs_client::JobsClient<tonic::transport::Channel>>) {}
    fn _agent(_: Option<v1::agent_client::AgentClient<tonic::transport::Channel>>) {}
    fn _raft(_: Option<v1::raft_transport_client::RaftTransportClient<tonic::transport::Channel>>) {}
    assert_eq!(v1::NodeMode::Draining.as_str_name(), "NODE_MODE_DRAINING");
    assert_eq!(v1::AllocReport::from_str_name("ALLOC_REPORT_FAILED"), Some(v1::AllocReport::Failed));
}
