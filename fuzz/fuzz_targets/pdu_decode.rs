//! The NVMe/TCP PDU decoder on arbitrary bytes, in both directions and with every digest setting: it never
//! panics, never claims more bytes than it was given, and what it decodes re-encodes to a PDU that decodes
//! to the same thing.
#![no_main]

use libfuzzer_sys::fuzz_target;
use nvpoll_wire::pdu::{self, DecodeConfig, Decoded, Digests, Direction};

fuzz_target!(|data: &[u8]| {
    let Some((&sel, bytes)) = data.split_first() else { return };
    let direction = if sel & 1 == 0 { Direction::ToHost } else { Direction::ToController };
    let digests = Digests { header: sel & 2 != 0, data: sel & 4 != 0 };
    let cfg = DecodeConfig::new(direction, digests, 64 * 1024);
    // Walk the stream as a receive loop would: one PDU after another until the bytes run out or one is bad.
    let mut off = 0;
    while off < bytes.len() {
        match pdu::decode(&bytes[off..], &cfg) {
            Ok(Decoded::Incomplete { need }) => {
                assert!(need > bytes.len() - off, "Incomplete although {need} bytes are there");
                break;
            }
            Ok(Decoded::Pdu { pdu, len }) => {
                assert!(len > 0 && len <= bytes.len() - off);
                let mut out = Vec::new();
                pdu::encode(&mut out, &pdu, digests, 0);
                match pdu::decode(&out, &cfg) {
                    Ok(Decoded::Pdu { pdu: again, len: l2 }) => {
                        assert_eq!(l2, out.len());
                        assert_eq!(again, pdu, "re-encoding changed the PDU");
                    }
                    other => panic!("our own encoding does not decode: {other:?}"),
                }
                off += len;
            }
            Err(e) => {
                // Data digest errors say how far to skip; everything else ends the stream.
                match e.skip_len() {
                    Some(len) if len > 0 && len <= bytes.len() - off => off += len,
                    Some(len) => panic!("skip length {len} with {} bytes left", bytes.len() - off),
                    None => break,
                }
            }
        }
    }
});
