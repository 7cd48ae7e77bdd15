//! Client and server handshakes reading arbitrary bytes (optionally after a genuine ClientHello, for the
//! server, and optionally after a KeyUpdate in the clear, which no handshake may take), split in two reads:
//! never panic, never consume more than given, once failed stay failed with the same error, and a KeyUpdate
//! before the handshake has ended fails it at once.
#![no_main]

use libfuzzer_sys::fuzz_target;
use nvpoll_tls::{
    ClientConfig, Group, Handshake, HandshakeState, HashAlg, Psk, ServerConfig,
};

const ID: &str = "NVMe0R01 nqn.fuzz-host nqn.fuzz-subsys";

fuzz_target!(|data: &[u8]| {
    let Some((&sel, rest)) = data.split_first() else {
        return;
    };
    let Some((&sel2, rest)) = rest.split_first() else {
        return;
    };
    let hash = if sel & 2 == 0 { HashAlg::Sha256 } else { HashAlg::Sha384 };
    let psk = Psk::new(&vec![0x5a; hash.output_len()], hash);
    let groups = match (sel >> 2) & 3 {
        0 => vec![Group::X25519, Group::Secp256r1],
        1 => vec![Group::Secp256r1],
        2 => vec![Group::X25519],
        _ => vec![],
    };
    let mut buf = Vec::new();
    let mut hs = if sel & 1 == 0 {
        let mut cfg = ServerConfig::with_psk(ID, psk.clone());
        cfg.allow_psk_ke = groups.is_empty();
        cfg.groups = groups;
        if sel & 16 != 0 {
            // Start from a genuine ClientHello.
            let (_, ch) = Handshake::client(ClientConfig::new(ID, psk)).unwrap();
            buf.extend_from_slice(&ch);
        }
        Handshake::server(cfg)
    } else {
        let mut cfg = ClientConfig::new(ID, psk);
        cfg.allow_psk_ke = groups.is_empty();
        cfg.key_shares = groups.iter().copied().take(1).collect();
        cfg.groups = groups;
        Handshake::client(cfg).unwrap().0
    };
    // A KeyUpdate (update_not_requested, update_requested, or a value no peer may send) where a handshake
    // message belongs.
    let key_update = sel2 & 1 != 0;
    if key_update {
        buf.extend_from_slice(&[22, 3, 3, 0, 5, 24, 0, 0, 1, (sel2 >> 1) % 3]);
    }
    let split = if rest.is_empty() { 0 } else { usize::from(sel >> 5) * rest.len() / 8 };
    let mut out = Vec::new();
    for chunk in [&rest[..split], &rest[split..]] {
        buf.extend_from_slice(chunk);
        match hs.read(&buf, &mut out) {
            Ok(p) => {
                assert!(!key_update, "a handshake took a KeyUpdate before it ended");
                assert!(p.consumed <= buf.len());
                buf.drain(..p.consumed);
                if p.done {
                    return;
                }
            }
            Err(e) => {
                assert_eq!(hs.state(), HandshakeState::Failed);
                let mut again = Vec::new();
                assert_eq!(hs.read(&buf, &mut again), Err(e));
                assert!(again.is_empty(), "the alert goes out once");
                return;
            }
        }
    }
});
