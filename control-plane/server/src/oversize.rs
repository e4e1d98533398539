//! Oversized requests answer RESOURCE_EXHAUSTED, as api.proto promises.
//!
//! tonic refuses a message over a service's `max_decoding_message_size` while reading its
//! 5-byte length prefix (nothing of the body is buffered), but it answers OUT_OF_RANGE. That
//! refusal is a trailers-only response: the status is in the HTTP headers, before any handler
//! ran. This layer, around every service of the server, rewrites exactly that answer's code
//! to RESOURCE_EXHAUSTED and leaves every other response alone.
//!
//! ```text
//!   request ─▶ tonic decode: len > limit ─▶ grpc-status 11 "Error, decoded message length too large…"
//!                                              └─ this layer ─▶ grpc-status 8, same message
//! ```

use tonic::codegen::http;
use tower::util::MapResponseLayer;

/// How tonic's decoder words a message over the limit (tonic/src/codec/decode.rs).
const TONIC_TOO_LARGE: &str = "Error, decoded message length too large";

/// The response type of tonic's services.
type Resp = http::Response<tonic::body::Body>;

/// The layer, for `tonic::transport::Server::builder().layer(...)`.
pub fn layer() -> MapResponseLayer<fn(Resp) -> Resp> {
    MapResponseLayer::new(answer as fn(Resp) -> Resp)
}

/// Rewrites tonic's OUT_OF_RANGE for an oversized message to RESOURCE_EXHAUSTED.
fn answer<B>(mut r: http::Response<B>) -> http::Response<B> {
    let h = r.headers_mut();
    // Only error answers carry grpc-status in the headers; parse those (the message is
    // percent-encoded there).
    if h.contains_key(tonic::Status::GRPC_STATUS)
        && let Some(s) = tonic::Status::from_header_map(h)
        && s.code() == tonic::Code::OutOfRange
        && s.message().starts_with(TONIC_TOO_LARGE)
    {
        h.insert(tonic::Status::GRPC_STATUS, http::HeaderValue::from_static("8"));
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_decoder_refusal_is_rewritten() {
        let too_large = tonic::Status::out_of_range(format!("{TONIC_TOO_LARGE}: found 9 bytes, the limit is: 4 bytes"));
        let r = answer(too_large.into_http::<()>());
        assert_eq!(tonic::Status::from_header_map(r.headers()).map(|s| s.code()), Some(tonic::Code::ResourceExhausted));

        let other = answer(tonic::Status::out_of_range("index past the end").into_http::<()>());
        assert_eq!(tonic::Status::from_header_map(other.headers()).map(|s| s.code()), Some(tonic::Code::OutOfRange));
        let ok = answer(http::Response::new(()));
        assert!(ok.headers().get(tonic::Status::GRPC_STATUS).is_none());
    }
}
