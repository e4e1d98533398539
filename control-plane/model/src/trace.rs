//! W3C trace context (`traceparent`, <https://www.w3.org/TR/trace-context/>) as text. The one
//! parser and formatter of it: the server and the agent turn it into OpenTelemetry span
//! contexts, the federation stores and forwards it without depending on OpenTelemetry
//! (docs/tracing.md).

use std::fmt;

/// A parsed `traceparent`: `00-<32 hex trace id>-<16 hex span id>-<2 hex flags>`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct TraceParent {
    /// The trace id (never all zero).
    pub trace_id: [u8; 16],
    /// The parent span id (never all zero).
    pub span_id: [u8; 8],
    /// Trace flags (bit 0: sampled).
    pub flags: u8,
}

/// The longest `traceparent` accepted: version 00's 55 characters (later versions may append
/// fields after a dash; they are ignored, as the specification asks).
pub const MAX_TRACEPARENT_LEN: usize = 256;

fn hex<const N: usize>(s: &str) -> Option<[u8; N]> {
    if s.len() != 2 * N || !s.bytes().all(|c| c.is_ascii_digit() || (b'a'..=b'f').contains(&c)) {
        return None;
    }
    let mut out = [0u8; N];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(&s[2 * i..2 * i + 2], 16).ok()?;
    }
    Some(out)
}

impl TraceParent {
    /// Parses a `traceparent`; `None` when malformed, of version `ff`, or with an all-zero
    /// trace or span id. Version 00 has exactly four fields; a later version may have more.
    pub fn parse(s: &str) -> Option<TraceParent> {
        let s = s.trim();
        if s.len() > MAX_TRACEPARENT_LEN {
            return None;
        }
        let mut parts = s.split('-');
        let (version, trace, span, flags) = (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
        let [v] = hex::<1>(version)?;
        if v == 0xff || (v == 0 && parts.next().is_some()) {
            return None;
        }
        let tp = TraceParent { trace_id: hex(trace)?, span_id: hex(span)?, flags: hex::<1>(flags)?[0] };
        (tp.trace_id != [0; 16] && tp.span_id != [0; 8]).then_some(tp)
    }

    /// The trace id as 32 lowercase hex digits.
    pub fn trace_id_hex(&self) -> String {
        self.trace_id.iter().map(|b| format!("{b:02x}")).collect()
    }
}

impl fmt::Display for TraceParent {
    /// Version 00's form.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "00-{}-", self.trace_id_hex())?;
        for b in self.span_id {
            write!(f, "{b:02x}")?;
        }
        write!(f, "-{:02x}", self.flags)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_formats_version_00() {
        let s = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        let tp = TraceParent::parse(s).expect("valid");
        assert_eq!(tp.flags, 1);
        assert_eq!(tp.trace_id_hex(), "4bf92f3577b34da6a3ce929d0e0e4736");
        assert_eq!(tp.to_string(), s);
        assert_eq!(TraceParent::parse(&format!(" {s}\n")), Some(tp));
    }

    #[test]
    fn refuses_what_the_specification_refuses() {
        for bad in [
            "",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7",
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e473-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
            "0-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-1x",
        ] {
            assert_eq!(TraceParent::parse(bad), None, "{bad:?}");
        }
        // A later version may carry more fields.
        assert!(TraceParent::parse("01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-future").is_some());
    }
}
