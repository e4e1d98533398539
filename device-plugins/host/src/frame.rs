//! Frames between the agent and a `suanli plugin-host` child: a 4-byte little-endian length, then
//! that many bytes of one protobuf message (`HostHello`, `HostRequest` or `HostReply`).

use std::io::{self, Read, Write};

use prost::Message;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

/// The largest frame either side sends or accepts, in bytes (the length prefix excluded).
pub const MAX_FRAME_LEN: usize = 16 << 20;

/// Host-side reply codes (`HostReply.code`), after the plugin's own 1..=6.
pub mod code {
    /// A request the host cannot serve: unknown method, init missing or repeated, bad payload.
    pub const PROTOCOL: i32 = 100;
}

/// Why a frame could not be read.
#[derive(Debug, thiserror::Error)]
pub enum FrameError {
    /// The stream ended (cleanly between frames, or in the middle of one).
    #[error("end of stream{}", if *.0 { " in the middle of a frame" } else { "" })]
    Eof(bool),
    /// The length prefix exceeds [`MAX_FRAME_LEN`].
    #[error("frame of {0} bytes exceeds the limit of {MAX_FRAME_LEN} bytes")]
    TooLarge(usize),
    /// The bytes are not the expected message.
    #[error("frame does not decode as {what}: {source}")]
    Decode {
        /// The expected message.
        what: &'static str,
        /// The decoder's error.
        source: prost::DecodeError,
    },
    /// An I/O error.
    #[error("i/o error: {0}")]
    Io(#[from] io::Error),
}

/// Encodes `msg` as one frame (prefix included).
pub fn encode<M: Message>(msg: &M) -> io::Result<Vec<u8>> {
    let len = msg.encoded_len();
    if len > MAX_FRAME_LEN {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("frame of {len} bytes exceeds the limit of {MAX_FRAME_LEN} bytes"),
        ));
    }
    let mut buf = Vec::with_capacity(4 + len);
    buf.extend_from_slice(&(len as u32).to_le_bytes());
    msg.encode(&mut buf).map_err(|e| io::Error::other(e.to_string()))?;
    Ok(buf)
}

/// Decodes a frame body.
pub fn decode<M: Message + Default>(body: &[u8], what: &'static str) -> Result<M, FrameError> {
    M::decode(body).map_err(|source| FrameError::Decode { what, source })
}

/// Writes one frame (a single `write_all`, so frames from several threads never interleave when
/// the writer is behind a lock).
pub fn write_sync<M: Message>(w: &mut impl Write, msg: &M) -> io::Result<()> {
    w.write_all(&encode(msg)?)?;
    w.flush()
}

/// Reads one frame body.
pub fn read_sync(r: &mut impl Read) -> Result<Vec<u8>, FrameError> {
    let mut len = [0u8; 4];
    read_exact_or_eof(r, &mut len, false)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_FRAME_LEN {
        return Err(FrameError::TooLarge(len));
    }
    let mut body = vec![0u8; len];
    read_exact_or_eof(r, &mut body, true)?;
    Ok(body)
}

fn read_exact_or_eof(r: &mut impl Read, buf: &mut [u8], in_frame: bool) -> Result<(), FrameError> {
    let mut off = 0;
    while off < buf.len() {
        match r.read(&mut buf[off..]) {
            Ok(0) => return Err(FrameError::Eof(in_frame || off > 0)),
            Ok(n) => off += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// Writes one frame asynchronously.
pub async fn write_async<M: Message>(w: &mut (impl AsyncWrite + Unpin), msg: &M) -> io::Result<()> {
    w.write_all(&encode(msg)?).await?;
    w.flush().await
}

/// Reads one frame body asynchronously.
pub async fn read_async(r: &mut (impl AsyncRead + Unpin)) -> Result<Vec<u8>, FrameError> {
    let mut len = [0u8; 4];
    read_exact_async(r, &mut len, false).await?;
    let len = u32::from_le_bytes(len) as usize;
    if len > MAX_FRAME_LEN {
        return Err(FrameError::TooLarge(len));
    }
    let mut body = vec![0u8; len];
    read_exact_async(r, &mut body, true).await?;
    Ok(body)
}

async fn read_exact_async(r: &mut (impl AsyncRead + Unpin), buf: &mut [u8], in_frame: bool) -> Result<(), FrameError> {
    let mut off = 0;
    while off < buf.len() {
        match r.read(&mut buf[off..]).await {
            Ok(0) => return Err(FrameError::Eof(in_frame || off > 0)),
            Ok(n) => off += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pb;

    #[test]
    fn round_trip_and_limits() {
        let req = pb::HostRequest { id: 7, method: "stats".into(), payload: vec![1, 2, 3] };
        let bytes = encode(&req).expect("small frame");
        let body = read_sync(&mut bytes.as_slice()).expect("one frame");
        let back: pb::HostRequest = decode(&body, "HostRequest").expect("decodes");
        assert_eq!(back, req);

        // A clean end between frames and a cut one are told apart.
        assert!(matches!(read_sync(&mut [].as_slice()), Err(FrameError::Eof(false))));
        assert!(matches!(read_sync(&mut bytes[..5].as_ref()), Err(FrameError::Eof(true))));

        // An oversized length is refused before anything is allocated, naming the limit.
        let huge = ((MAX_FRAME_LEN + 1) as u32).to_le_bytes();
        let err = read_sync(&mut huge.as_slice()).expect_err("too large");
        assert!(err.to_string().contains(&MAX_FRAME_LEN.to_string()), "{err}");
    }
}
