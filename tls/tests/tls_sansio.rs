//! Our client against our server, in memory: every suite/group/mode combination, bytes fed one at a
//! time, records split and gathered, KeyUpdate, close_notify, ChangeCipherSpec tolerance, and the negative
//! cases with the alert each one must produce (wrong PSK, unknown identity, tampered record, record
//! overflow, out-of-order and truncated messages, and nothing accepted after a failure).

use nvpoll_tls::{
    AlertDescription, CipherSuite, ClientConfig, ConfiguredKey, Derivation, Group, Handshake,
    HandshakeState, HashAlg, IdentityVersion, KeyLimits, Psk, ServerConfig, Session, TlsError,
    KEY_UPDATE_LEN, MAX_CIPHERTEXT,
};

const ID: &str = "NVMe0R01 nqn.psk-test-host nqn.psk-test-subsys";

fn psk(hash: HashAlg) -> Psk {
    Psk::new(&vec![0x5a; hash.output_len()], hash)
}

/// Runs both handshakes in memory, moving at most `chunk` bytes per step. Returns the sessions, or the
/// first error with the bytes that side wrote last (holding its alert).
fn run(
    ccfg: ClientConfig,
    scfg: ServerConfig,
    chunk: usize,
) -> Result<(Session, Session), (TlsError, Vec<u8>)> {
    let (mut c, mut to_s) = Handshake::client(ccfg).map_err(|e| (e, vec![]))?;
    let mut s = Handshake::server(scfg);
    let mut to_c = Vec::new();
    let (mut s_in, mut c_in) = (Vec::new(), Vec::new());
    for _ in 0..100_000 {
        if c.is_done() && s.is_done() {
            break;
        }
        let n = chunk.min(to_s.len());
        s_in.extend(to_s.drain(..n));
        let mut out = Vec::new();
        let p = s.read(&s_in, &mut out).map_err(|e| (e, out.clone()))?;
        s_in.drain(..p.consumed);
        to_c.extend_from_slice(&out);
        let n = chunk.min(to_c.len());
        c_in.extend(to_c.drain(..n));
        let mut out = Vec::new();
        let p = c.read(&c_in, &mut out).map_err(|e| (e, out.clone()))?;
        c_in.drain(..p.consumed);
        to_s.extend_from_slice(&out);
    }
    assert!(s_in.is_empty() && c_in.is_empty() && to_s.is_empty() && to_c.is_empty());
    Ok((c.into_session().unwrap(), s.into_session().unwrap()))
}

fn pair() -> (Session, Session) {
    let p = psk(HashAlg::Sha256);
    run(
        ClientConfig::new(ID, p.clone()),
        ServerConfig::with_psk(ID, p),
        usize::MAX,
    )
    .unwrap()
}

/// A plaintext alert record as sent before keys.
fn plain_alert(a: AlertDescription) -> Vec<u8> {
    vec![21, 3, 3, 0, 2, 2, a.code()]
}

/// Moves `data` from one session to the other through seal/open.
fn transfer(tx: &mut Session, rx: &mut Session, data: &[&[u8]]) -> Vec<u8> {
    let mut wire = Vec::new();
    tx.seal(data, &mut wire).unwrap();
    let mut plain = Vec::new();
    let n = rx.open(&wire, &mut plain).unwrap();
    assert_eq!(n, wire.len());
    plain
}

#[test]
fn every_suite_group_and_mode() {
    for hash in [HashAlg::Sha256, HashAlg::Sha384] {
        let p = psk(hash);
        for (groups, shares, want, hrr) in [
            (
                vec![Group::X25519, Group::Secp256r1],
                vec![Group::X25519, Group::Secp256r1],
                Group::X25519,
                false,
            ),
            (
                vec![Group::Secp256r1],
                vec![Group::Secp256r1],
                Group::Secp256r1,
                false,
            ),
            (
                vec![Group::X25519, Group::Secp256r1],
                vec![Group::Secp256r1],
                Group::Secp256r1,
                false,
            ),
            (
                vec![Group::X25519, Group::Secp256r1],
                vec![],
                Group::X25519,
                true,
            ),
        ] {
            let mut c = ClientConfig::new(ID, p.clone());
            c.groups = groups;
            c.key_shares = shares;
            let (mut cs, mut ss) =
                run(c, ServerConfig::with_psk(ID, p.clone()), usize::MAX).unwrap();
            assert_eq!(cs.cipher_suite(), CipherSuite::for_hash(hash));
            assert_eq!(ss.group(), Some(want));
            assert_eq!(cs.negotiated(), ss.negotiated());
            assert_eq!(ss.negotiated().hello_retry, hrr);
            assert_eq!(transfer(&mut cs, &mut ss, &[b"ping"]), b"ping");
            assert_eq!(transfer(&mut ss, &mut cs, &[b"pong"]), b"pong");
        }
        // Server prefers P-256 and the client shared only x25519: HelloRetryRequest.
        let mut c = ClientConfig::new(ID, p.clone());
        c.key_shares = vec![Group::X25519];
        let mut s = ServerConfig::with_psk(ID, p.clone());
        s.groups = vec![Group::Secp256r1];
        let (cs, _) = run(c, s, usize::MAX).unwrap();
        assert!(cs.negotiated().hello_retry);
        assert_eq!(cs.group(), Some(Group::Secp256r1));
        // psk_ke when both allow it.
        let mut c = ClientConfig::new(ID, p.clone());
        c.groups.clear();
        c.key_shares.clear();
        c.allow_psk_ke = true;
        let mut s = ServerConfig::with_psk(ID, p.clone());
        s.allow_psk_ke = true;
        let (mut cs, mut ss) = run(c, s, usize::MAX).unwrap();
        assert_eq!(cs.group(), None);
        assert_eq!(transfer(&mut cs, &mut ss, &[b"x"]), b"x");
    }
}

#[test]
fn one_byte_at_a_time() {
    let p = psk(HashAlg::Sha384);
    let mut c = ClientConfig::new(ID, p.clone());
    c.key_shares = vec![Group::X25519];
    let mut s = ServerConfig::with_psk(ID, p);
    s.groups = vec![Group::Secp256r1];
    let (mut cs, mut ss) = run(c, s, 1).unwrap();
    assert!(cs.negotiated().hello_retry);
    // Records fed one byte at a time into the session too.
    let data: Vec<u8> = (0..40_000u32).map(|i| (i * 7) as u8).collect();
    let mut wire = Vec::new();
    assert_eq!(
        cs.seal(
            &[&data[..100], &data[100..30_000], &data[30_000..]],
            &mut wire
        )
        .unwrap(),
        3
    );
    let mut input = Vec::new();
    let mut plain = Vec::new();
    for b in wire {
        input.push(b);
        let n = ss.open(&input, &mut plain).unwrap();
        input.drain(..n);
    }
    assert_eq!(plain, data);
    assert_eq!(ss.stats().records_opened, 3);
}

#[test]
fn nvme_derived_keys_and_lookup_by_identity() {
    // A target holding several hosts' keys, looked up by identity; hosts use v0 and v1 identities.
    let k = ConfiguredKey::parse(
        "NVMeTLSkey-1:02:VRLbtnN9AQb2WXW3c9+wEf/DRLz0QuLdbYvEhwtdWwP/w0S89ELi3W2LxIcLXVsDn8kXZQ==:",
    )
    .unwrap();
    let sub = "nqn.psk-test-subsys";
    let keys: Vec<(String, Psk)> = ["nqn.h1", "nqn.h2"]
        .iter()
        .flat_map(|h| {
            [IdentityVersion::V0, IdentityVersion::V1]
                .map(|v| k.derive(v, h, sub, Derivation::Rfc8446))
        })
        .collect();
    let table = keys.clone();
    let scfg = ServerConfig::new(move |id| {
        table
            .iter()
            .find(|(i, _)| i.as_bytes() == id)
            .map(|(_, p)| p.clone())
    });
    for (id, p) in keys {
        let (_, ss) = run(ClientConfig::new(id.clone(), p), scfg.clone(), usize::MAX).unwrap();
        assert_eq!(ss.psk_identity(), id.as_bytes());
        assert_eq!(ss.cipher_suite(), CipherSuite::Aes256GcmSha384);
    }
}

#[test]
fn records_are_cut_at_16k() {
    let (mut c, mut s) = pair();
    let data = vec![1u8; 16384 * 2 + 5];
    let mut wire = Vec::new();
    assert_eq!(c.seal(&[&data], &mut wire).unwrap(), 3);
    assert_eq!(wire.len(), data.len() + 3 * 22);
    assert_eq!(&wire[..5], &[23, 3, 3, 0x40, 0x11]);
    assert_eq!(c.seal(&[], &mut wire).unwrap(), 0);
    assert_eq!(c.seal(&[b"", b""], &mut wire).unwrap(), 0);
    let mut plain = Vec::new();
    s.open(&wire, &mut plain).unwrap();
    assert_eq!(plain, data);
}

#[test]
fn key_update_both_ways() {
    let (mut c, mut s) = pair();
    let mut wire = Vec::new();
    s.update_keys(true, &mut wire).unwrap();
    s.seal(&[b"after update"], &mut wire).unwrap();
    let mut plain = Vec::new();
    c.open(&wire, &mut plain).unwrap();
    assert_eq!(plain, b"after update");
    assert!(c.has_pending());
    // The reply goes out ahead of the client's next data.
    let mut wire = Vec::new();
    c.seal(&[b"reply"], &mut wire).unwrap();
    assert!(!c.has_pending());
    let mut plain = Vec::new();
    s.open(&wire, &mut plain).unwrap();
    assert_eq!(plain, b"reply");
    assert_eq!(c.stats().key_updates_received, 1);
    assert_eq!(c.stats().key_updates_sent, 1);
    assert_eq!(s.stats().key_updates_received, 1);
    // And through write_pending, without data.
    let mut wire = Vec::new();
    c.update_keys(true, &mut wire).unwrap();
    s.open(&wire, &mut Vec::new()).unwrap();
    let mut wire = Vec::new();
    assert!(s.write_pending(&mut wire).unwrap());
    c.open(&wire, &mut Vec::new()).unwrap();
    assert_eq!(transfer(&mut s, &mut c, &[b"ok"]), b"ok");
    assert_eq!(transfer(&mut c, &mut s, &[b"ok"]), b"ok");
}

/// With keys renewed every 10 records, both directions renew again and again while data flows both ways,
/// in single records and in batches that cross the count, and every byte arrives.
#[test]
fn keys_renew_on_their_own_in_both_directions() {
    let (mut c, mut s) = pair();
    let limits = KeyLimits::renew_after(10).unwrap();
    assert_eq!(limits.hard_limit, Some(20));
    c.set_key_limits(limits).unwrap();
    s.set_key_limits(limits).unwrap();
    let big = vec![0xa5u8; 3 * 16384 + 5]; // four records in one seal
    for i in 0..200u32 {
        let msg = i.to_be_bytes();
        assert_eq!(transfer(&mut c, &mut s, &[&msg]), msg);
        if i % 7 == 0 {
            assert_eq!(transfer(&mut s, &mut c, &[&big]), big);
        }
        // A KeyUpdate the server owes (or asks for) goes out even if it has nothing to send.
        let mut wire = Vec::new();
        if s.write_pending(&mut wire).unwrap() {
            c.open(&wire, &mut Vec::new()).unwrap();
        }
        for x in [&c, &s] {
            assert!(
                x.records_under_write_key() <= 20,
                "never past the hard limit"
            );
            assert!(!x.peer_key_overdue());
        }
    }
    let (cs, ss) = (c.stats(), s.stats());
    assert!(cs.key_updates_sent >= 200 / 11, "{cs:?}");
    assert!(ss.key_updates_sent >= 3, "{ss:?}");
    assert_eq!(cs.key_updates_sent, ss.key_updates_received);
    assert_eq!(ss.key_updates_sent, cs.key_updates_received);
}

/// With no renewal on its own, the hard limit refuses the record that would pass it (sealing nothing), and
/// the session still closes cleanly; a KeyUpdate asked for by hand makes room again.
#[test]
fn no_key_seals_past_its_hard_limit() {
    let (mut c, mut s) = pair();
    c.set_key_limits(KeyLimits {
        update_after: None,
        hard_limit: Some(5),
    })
    .unwrap();
    for i in 0..5u8 {
        assert_eq!(transfer(&mut c, &mut s, &[&[i]]), [i]);
    }
    let mut wire = Vec::new();
    assert_eq!(
        c.seal(&[b"sixth"], &mut wire),
        Err(TlsError::KeyLimitReached)
    );
    assert!(wire.is_empty(), "nothing sealed");
    let mut big = vec![0u8; 20];
    assert_eq!(
        c.seal_to_slice(&[b"sixth"], &mut big),
        Err(TlsError::KeyLimitReached)
    );
    let mut wire = Vec::new();
    c.update_keys(false, &mut wire).unwrap();
    c.seal(&[b"sixth"], &mut wire).unwrap();
    let mut plain = Vec::new();
    s.open(&wire, &mut plain).unwrap();
    assert_eq!(plain, b"sixth");
    assert_eq!(c.records_under_write_key(), 1);
    // And at the limit again, close_notify still goes out.
    c.set_key_limits(KeyLimits {
        update_after: None,
        hard_limit: Some(1),
    })
    .unwrap();
    let mut wire = Vec::new();
    c.close(&mut wire).unwrap();
    assert_eq!(s.open(&wire, &mut Vec::new()), Err(TlsError::Closed));
}

/// A peer that goes on with one key after being asked to renew it is overdue at the hard limit.
#[test]
fn a_peer_that_never_renews_is_overdue() {
    let (mut c, mut s) = pair();
    c.set_key_limits(KeyLimits {
        update_after: Some(3),
        hard_limit: Some(6),
    })
    .unwrap();
    s.set_key_limits(KeyLimits::NONE).unwrap();
    for i in 0..6u8 {
        // The server's records, sealed raw: it never answers the client's request.
        let mut wire = Vec::new();
        s.dangerous_seal_raw(23, &[i], &mut wire).unwrap();
        let mut plain = Vec::new();
        c.open(&wire, &mut plain).unwrap();
        assert_eq!(plain, [i]);
        assert_eq!(c.peer_key_overdue(), i == 5, "after record {i}");
        // The client asks once, at the third record, and not again.
        assert_eq!(c.has_pending(), i >= 2, "after record {i}");
    }
    let mut wire = Vec::new();
    assert!(c.write_pending(&mut wire).unwrap());
    assert_eq!(wire.len(), KEY_UPDATE_LEN);
    assert!(!c.has_pending());
    assert_eq!(c.stats().key_updates_sent, 1);
}

#[test]
fn key_limits_are_checked() {
    let (mut c, _) = pair();
    assert_eq!(c.key_limits(), KeyLimits::AES_GCM);
    for bad in [(Some(0), Some(5)), (Some(5), Some(5)), (Some(6), Some(5))] {
        let limits = KeyLimits {
            update_after: bad.0,
            hard_limit: bad.1,
        };
        assert!(c.set_key_limits(limits).is_err(), "{limits:?}");
    }
    assert!(KeyLimits::renew_after(0).is_err());
    assert_eq!(
        KeyLimits::renew_after(1 << 40).unwrap(),
        KeyLimits::AES_GCM,
        "never past the AES-GCM limits"
    );
}

#[test]
fn close_notify_returns_what_came_before() {
    let (mut c, mut s) = pair();
    let mut wire = Vec::new();
    c.seal(&[b"last words"], &mut wire).unwrap();
    c.close(&mut wire).unwrap();
    c.seal(&[b"x"], &mut Vec::new()).unwrap_err();
    let mut plain = Vec::new();
    assert_eq!(s.open(&wire, &mut plain).unwrap(), wire.len());
    assert_eq!(plain, b"last words");
    assert!(s.is_peer_closed());
    assert_eq!(s.open(&[], &mut plain), Err(TlsError::Closed));
    // Half-close: the server may still send.
    assert_eq!(transfer(&mut s, &mut c, &[b"bye"]), b"bye");
    // close_notify alone: Closed at once.
    let (mut c, mut s) = pair();
    let mut wire = Vec::new();
    c.close(&mut wire).unwrap();
    assert_eq!(s.open(&wire, &mut Vec::new()), Err(TlsError::Closed));
}

#[test]
fn change_cipher_spec_tolerated_during_handshake_only() {
    let p = psk(HashAlg::Sha256);
    let ccs = [20u8, 3, 3, 0, 1, 1];
    let (mut c, ch) = Handshake::client(ClientConfig::new(ID, p.clone())).unwrap();
    let mut s = Handshake::server(ServerConfig::with_psk(ID, p.clone()));
    // Server: CCS before ClientHello is unexpected.
    let mut s0 = Handshake::server(ServerConfig::with_psk(ID, p.clone()));
    let mut out = Vec::new();
    assert!(matches!(
        s0.read(&ccs, &mut out),
        Err(TlsError::UnexpectedMessage(_))
    ));
    assert_eq!(out, plain_alert(AlertDescription::UnexpectedMessage));
    // After it, fine both ways.
    let mut input = ch.clone();
    input.extend_from_slice(&ccs);
    let mut to_c = ccs.to_vec();
    let p1 = s.read(&input, &mut to_c).unwrap();
    assert_eq!(p1.consumed, input.len());
    to_c.extend_from_slice(&ccs);
    let mut to_s = Vec::new();
    assert!(c.read(&to_c, &mut to_s).unwrap().done);
    let mut input = ccs.to_vec();
    input.extend_from_slice(&to_s);
    assert!(s.read(&input, &mut Vec::new()).unwrap().done);
    // After the handshake it is an error.
    let mut ss = s.into_session().unwrap();
    let mut plain = Vec::new();
    assert!(matches!(
        ss.open(&ccs, &mut plain),
        Err(TlsError::UnexpectedMessage(_))
    ));
    let mut alert = Vec::new();
    assert!(ss.write_pending(&mut alert).unwrap());
    assert_eq!(alert.len(), 5 + 2 + 1 + 16);
    // A CCS with another value is unexpected too.
    let mut s = Handshake::server(ServerConfig::with_psk(ID, p));
    let mut input = ch;
    input.extend_from_slice(&[20, 3, 3, 0, 1, 2]);
    assert!(matches!(
        s.read(&input, &mut Vec::new()),
        Err(TlsError::UnexpectedMessage(_))
    ));
}

#[test]
fn wrong_psk_is_decrypt_error() {
    let (e, out) = run(
        ClientConfig::new(ID, psk(HashAlg::Sha256)),
        ServerConfig::with_psk(ID, Psk::new(&[1; 32], HashAlg::Sha256)),
        usize::MAX,
    )
    .unwrap_err();
    assert_eq!(e, TlsError::BadBinder);
    assert_eq!(e.alert(), Some(AlertDescription::DecryptError));
    assert_eq!(out, plain_alert(AlertDescription::DecryptError));
}

#[test]
fn unknown_identity_is_unknown_psk_identity() {
    let p = psk(HashAlg::Sha256);
    let (e, out) = run(
        ClientConfig::new("NVMe0R01 nqn.nobody nqn.nothing", p.clone()),
        ServerConfig::with_psk(ID, p),
        usize::MAX,
    )
    .unwrap_err();
    assert_eq!(e, TlsError::UnknownIdentity);
    assert_eq!(out, plain_alert(AlertDescription::UnknownPskIdentity));
}

#[test]
fn psk_hash_without_matching_suite_is_handshake_failure() {
    let (e, out) = run(
        ClientConfig::new(ID, psk(HashAlg::Sha384)),
        ServerConfig::with_psk(ID, psk(HashAlg::Sha256)),
        usize::MAX,
    )
    .unwrap_err();
    assert!(matches!(e, TlsError::HandshakeFailure(_)), "{e}");
    assert_eq!(out, plain_alert(AlertDescription::HandshakeFailure));
}

#[test]
fn psk_ke_needs_both_sides() {
    let p = psk(HashAlg::Sha256);
    let mut c = ClientConfig::new(ID, p.clone());
    c.groups.clear();
    c.key_shares.clear();
    c.allow_psk_ke = true;
    let (e, out) = run(c, ServerConfig::with_psk(ID, p.clone()), usize::MAX).unwrap_err();
    assert!(matches!(e, TlsError::HandshakeFailure(_)), "{e}");
    assert_eq!(out, plain_alert(AlertDescription::HandshakeFailure));
    // A client with nothing to offer is a configuration error.
    let mut c = ClientConfig::new(ID, p);
    c.groups.clear();
    assert!(matches!(Handshake::client(c), Err(TlsError::InvalidUse(_))));
}

#[test]
fn identity_too_long_for_the_client_hello_is_refused() {
    // 65529 bytes passes the identity's own 16-bit bound, but not the extensions block around it: the
    // ClientHello used to go out with its extension lengths cut to 16 bits.
    let c = ClientConfig::new(vec![b'a'; 65529], psk(HashAlg::Sha256));
    assert!(matches!(Handshake::client(c), Err(TlsError::InvalidUse(_))));
    // One that fits still makes a ClientHello.
    let c = ClientConfig::new(vec![b'a'; 60000], psk(HashAlg::Sha256));
    assert!(Handshake::client(c).is_ok());
}

#[test]
fn tampered_handshake_record_is_bad_record_mac() {
    let p = psk(HashAlg::Sha256);
    let (mut c, ch) = Handshake::client(ClientConfig::new(ID, p.clone())).unwrap();
    let mut s = Handshake::server(ServerConfig::with_psk(ID, p));
    let mut flight = Vec::new();
    s.read(&ch, &mut flight).unwrap();
    // ServerHello (plaintext), then one protected record: flip its last byte (the tag).
    let last = flight.len() - 1;
    flight[last] ^= 1;
    let mut out = Vec::new();
    assert_eq!(c.read(&flight, &mut out), Err(TlsError::BadRecordMac));
    // The alert goes out protected under the client's handshake key: one 19-byte record.
    assert_eq!(out.len(), 5 + 19);
    assert_eq!(&out[..5], &[23, 3, 3, 0, 19]);
    assert_eq!(c.state(), HandshakeState::Failed);
    // Nothing more is accepted, not even the genuine flight.
    flight[last] ^= 1;
    assert_eq!(
        c.read(&flight, &mut Vec::new()),
        Err(TlsError::BadRecordMac)
    );
    assert!(c.into_session().is_err());
}

#[test]
fn tampered_session_record_ends_the_session() {
    let (mut c, mut s) = pair();
    let mut wire = Vec::new();
    c.seal(&[b"good"], &mut wire).unwrap();
    let good_len = wire.len();
    c.seal(&[b"evil"], &mut wire).unwrap();
    let last = wire.len() - 3;
    wire[last] ^= 0x80;
    c.seal(&[b"after"], &mut wire).unwrap();
    let mut plain = b"earlier ".to_vec();
    assert_eq!(s.open(&wire, &mut plain), Err(TlsError::BadRecordMac));
    // The failing call leaves the caller's buffer as it was, though "good" was authentic.
    assert_eq!(plain, b"earlier ");
    assert_eq!(
        s.open(&wire[..good_len], &mut plain),
        Err(TlsError::BadRecordMac)
    );
    assert_eq!(plain, b"earlier ");
    assert!(s.seal(&[b"x"], &mut Vec::new()).is_err());
    let mut alert = Vec::new();
    assert!(s.write_pending(&mut alert).unwrap());
    assert!(!s.write_pending(&mut alert).unwrap());
    // The peer reads our bad_record_mac alert.
    let mut cp = Vec::new();
    assert_eq!(
        c.open(&alert, &mut cp),
        Err(TlsError::PeerAlert(AlertDescription::BadRecordMac))
    );
}

#[test]
fn oversized_records_are_record_overflow() {
    // In a session: refused from the header alone, before the body arrives.
    let (_, mut s) = pair();
    let len = (MAX_CIPHERTEXT + 1) as u16;
    let hdr = [23, 3, 3, (len >> 8) as u8, len as u8];
    assert_eq!(s.open(&hdr, &mut Vec::new()), Err(TlsError::RecordOverflow));
    let mut alert = Vec::new();
    assert!(s.write_pending(&mut alert).unwrap());
    // In a handshake: a plaintext record over 16 KiB.
    let mut hs = Handshake::server(ServerConfig::with_psk(ID, psk(HashAlg::Sha256)));
    let mut out = Vec::new();
    assert_eq!(
        hs.read(&[22, 3, 1, 0x40, 0x01], &mut out),
        Err(TlsError::RecordOverflow)
    );
    assert_eq!(out, plain_alert(AlertDescription::RecordOverflow));
    // A protected record of exactly the limit is not refused for its size.
    let (_, mut s) = pair();
    let len = MAX_CIPHERTEXT as u16;
    let mut rec = vec![23, 3, 3, (len >> 8) as u8, len as u8];
    rec.resize(5 + MAX_CIPHERTEXT, 0);
    assert_eq!(s.open(&rec, &mut Vec::new()), Err(TlsError::BadRecordMac));
}

#[test]
fn out_of_order_messages_are_unexpected() {
    let p = psk(HashAlg::Sha256);
    // Server: Finished first.
    let mut s = Handshake::server(ServerConfig::with_psk(ID, p.clone()));
    let mut fin = vec![22, 3, 3, 0, 36, 20, 0, 0, 32];
    fin.resize(5 + 36, 0);
    let mut out = Vec::new();
    assert!(matches!(
        s.read(&fin, &mut out),
        Err(TlsError::UnexpectedMessage(_))
    ));
    assert_eq!(out, plain_alert(AlertDescription::UnexpectedMessage));
    // Client: EncryptedExtensions before ServerHello.
    let (mut c, _) = Handshake::client(ClientConfig::new(ID, p.clone())).unwrap();
    let mut out = Vec::new();
    let ee = [22, 3, 3, 0, 6, 8, 0, 0, 2, 0, 0];
    assert!(matches!(
        c.read(&ee, &mut out),
        Err(TlsError::UnexpectedMessage(_))
    ));
    assert_eq!(out, plain_alert(AlertDescription::UnexpectedMessage));
    // Client: application data before the handshake.
    let (mut c, _) = Handshake::client(ClientConfig::new(ID, p.clone())).unwrap();
    let mut rec = vec![23, 3, 3, 0, 17];
    rec.resize(5 + 17, 0);
    assert!(matches!(
        c.read(&rec, &mut Vec::new()),
        Err(TlsError::UnexpectedMessage(_))
    ));
    // Server: a second ClientHello in the same record as the first (spans the key change).
    let (_, ch) = Handshake::client(ClientConfig::new(ID, p.clone())).unwrap();
    let body = &ch[5..];
    let mut twice = Vec::new();
    let len = (body.len() * 2) as u16;
    twice.extend_from_slice(&[22, 3, 1, (len >> 8) as u8, len as u8]);
    twice.extend_from_slice(body);
    twice.extend_from_slice(body);
    let mut s = Handshake::server(ServerConfig::with_psk(ID, p.clone()));
    let mut out = Vec::new();
    assert!(matches!(
        s.read(&twice, &mut out),
        Err(TlsError::UnexpectedMessage(_))
    ));
    // Server: an unknown record type.
    let mut s = Handshake::server(ServerConfig::with_psk(ID, p));
    assert!(matches!(
        s.read(&[99, 3, 3, 0, 1, 0], &mut Vec::new()),
        Err(TlsError::UnexpectedMessage(_))
    ));
}

#[test]
fn truncated_client_hello_is_decode_error() {
    let p = psk(HashAlg::Sha256);
    let (_, ch) = Handshake::client(ClientConfig::new(ID, p.clone())).unwrap();
    for cut in [1, 10, 40, ch.len() - 5 - 4 - 10] {
        // Shorten the message, then make the record and handshake lengths agree with it.
        let mut t = ch[..ch.len() - cut].to_vec();
        let rec_len = (t.len() - 5) as u16;
        t[3..5].copy_from_slice(&rec_len.to_be_bytes());
        let msg_len = t.len() - 9;
        t[6..9].copy_from_slice(&(msg_len as u32).to_be_bytes()[1..]);
        let mut s = Handshake::server(ServerConfig::with_psk(ID, p.clone()));
        let mut out = Vec::new();
        let e = s.read(&t, &mut out).unwrap_err();
        assert!(matches!(e, TlsError::Decode(_)), "cut {cut}: {e}");
        assert_eq!(out, plain_alert(AlertDescription::DecodeError));
        // And again: the same error, nothing read.
        assert_eq!(s.read(&ch, &mut Vec::new()), Err(e));
    }
    // A ClientHello that is merely incomplete waits for more.
    let mut s = Handshake::server(ServerConfig::with_psk(ID, p));
    let p = s.read(&ch[..ch.len() - 1], &mut Vec::new()).unwrap();
    assert_eq!((p.consumed, p.done), (0, false));
    assert_eq!(s.state(), HandshakeState::ServerWaitClientHello);
}

/// A ClientHello assembled by hand (binders are zeros: these checks come before the binder's).
fn raw_client_hello(compression: &[u8], exts: &[(u16, Vec<u8>)]) -> Vec<u8> {
    let mut body = vec![3, 3];
    body.extend_from_slice(&[7; 32]);
    body.push(0);
    body.extend_from_slice(&[0, 2, 0x13, 0x01]);
    body.push(compression.len() as u8);
    body.extend_from_slice(compression);
    let mut e = Vec::new();
    for (t, d) in exts {
        e.extend_from_slice(&t.to_be_bytes());
        e.extend_from_slice(&(d.len() as u16).to_be_bytes());
        e.extend_from_slice(d);
    }
    body.extend_from_slice(&(e.len() as u16).to_be_bytes());
    body.extend_from_slice(&e);
    let mut msg = vec![1];
    msg.extend_from_slice(&(body.len() as u32).to_be_bytes()[1..]);
    msg.extend_from_slice(&body);
    let mut rec = vec![22, 3, 1];
    rec.extend_from_slice(&(msg.len() as u16).to_be_bytes());
    rec.extend_from_slice(&msg);
    rec
}

fn psk_ext(identity: &[u8]) -> Vec<u8> {
    let mut ids = Vec::new();
    ids.extend_from_slice(&(identity.len() as u16).to_be_bytes());
    ids.extend_from_slice(identity);
    ids.extend_from_slice(&[0; 4]);
    let mut d = (ids.len() as u16).to_be_bytes().to_vec();
    d.extend_from_slice(&ids);
    d.extend_from_slice(&[0, 33, 32]);
    d.extend_from_slice(&[0; 32]);
    d
}

#[test]
fn malformed_client_hellos_get_the_right_alert() {
    let p = psk(HashAlg::Sha256);
    let versions = (43u16, vec![2, 3, 4]);
    let modes = (45u16, vec![1, 1]);
    let groups = (10u16, vec![0, 2, 0, 0x1d]);
    let share = {
        let mut d = vec![0, 36, 0, 0x1d, 0, 32];
        d.extend_from_slice(&[9; 32]);
        (51u16, d)
    };
    let pskx = (41u16, psk_ext(ID.as_bytes()));
    let cases: Vec<(Vec<u8>, AlertDescription)> = vec![
        // No supported_versions: a TLS 1.2 client.
        (
            raw_client_hello(&[0], &[modes.clone(), pskx.clone()]),
            AlertDescription::ProtocolVersion,
        ),
        // Compression other than null.
        (
            raw_client_hello(&[1, 0], &[versions.clone(), pskx.clone()]),
            AlertDescription::IllegalParameter,
        ),
        // Duplicate extension.
        (
            raw_client_hello(&[0], &[versions.clone(), versions.clone(), pskx.clone()]),
            AlertDescription::IllegalParameter,
        ),
        // pre_shared_key not last.
        (
            raw_client_hello(&[0], &[versions.clone(), pskx.clone(), modes.clone()]),
            AlertDescription::IllegalParameter,
        ),
        // pre_shared_key without psk_key_exchange_modes.
        (
            raw_client_hello(&[0], &[versions.clone(), pskx.clone()]),
            AlertDescription::MissingExtension,
        ),
        // No PSK at all.
        (
            raw_client_hello(&[0], &[versions.clone(), modes.clone()]),
            AlertDescription::HandshakeFailure,
        ),
        // The binder does not verify (all zeros).
        (
            raw_client_hello(&[0], &[versions, groups, share, modes, pskx]),
            AlertDescription::DecryptError,
        ),
    ];
    for (i, (ch, want)) in cases.into_iter().enumerate() {
        let mut s = Handshake::server(ServerConfig::with_psk(ID, p.clone()));
        let mut out = Vec::new();
        let e = s.read(&ch, &mut out).unwrap_err();
        assert_eq!(e.alert(), Some(want), "case {i}: {e}");
        assert_eq!(out, plain_alert(want), "case {i}");
    }
}

/// A HelloRetryRequest or ServerHello assembled by hand.
fn raw_server_hello(hrr: bool, suite: u16, exts: &[(u16, Vec<u8>)]) -> Vec<u8> {
    const HRR: [u8; 32] = [
        0xCF, 0x21, 0xAD, 0x74, 0xE5, 0x9A, 0x61, 0x11, 0xBE, 0x1D, 0x8C, 0x02, 0x1E, 0x65, 0xB8,
        0x91, 0xC2, 0xA2, 0x11, 0x16, 0x7A, 0xBB, 0x8C, 0x5E, 0x07, 0x9E, 0x09, 0xE2, 0xC8, 0xA8,
        0x33, 0x9C,
    ];
    let mut body = vec![3, 3];
    body.extend_from_slice(if hrr { &HRR } else { &[1; 32] });
    body.push(0);
    body.extend_from_slice(&suite.to_be_bytes());
    body.push(0);
    let mut e = Vec::new();
    for (t, d) in exts {
        e.extend_from_slice(&t.to_be_bytes());
        e.extend_from_slice(&(d.len() as u16).to_be_bytes());
        e.extend_from_slice(d);
    }
    body.extend_from_slice(&(e.len() as u16).to_be_bytes());
    body.extend_from_slice(&e);
    let mut rec = vec![22, 3, 3];
    rec.extend_from_slice(&((body.len() + 4) as u16).to_be_bytes());
    rec.push(2);
    rec.extend_from_slice(&(body.len() as u32).to_be_bytes()[1..]);
    rec.extend_from_slice(&body);
    rec
}

#[test]
fn bad_server_hellos_get_the_right_alert() {
    let p = psk(HashAlg::Sha256);
    let v13 = (43u16, vec![3, 4]);
    let mut only_x25519 = ClientConfig::new(ID, p.clone());
    only_x25519.key_shares = vec![Group::X25519];
    let cases: Vec<(ClientConfig, Vec<Vec<u8>>, AlertDescription)> = vec![
        // A suite we did not offer.
        (
            ClientConfig::new(ID, p.clone()),
            vec![raw_server_hello(
                false,
                0x1302,
                &[v13.clone(), (41, vec![0, 0])],
            )],
            AlertDescription::IllegalParameter,
        ),
        // TLS 1.2.
        (
            ClientConfig::new(ID, p.clone()),
            vec![raw_server_hello(false, 0x1301, &[])],
            AlertDescription::ProtocolVersion,
        ),
        // An extension we never offered.
        (
            ClientConfig::new(ID, p.clone()),
            vec![raw_server_hello(
                false,
                0x1301,
                &[v13.clone(), (0x7777, vec![])],
            )],
            AlertDescription::UnsupportedExtension,
        ),
        // PSK not accepted.
        (
            ClientConfig::new(ID, p.clone()),
            vec![raw_server_hello(false, 0x1301, std::slice::from_ref(&v13))],
            AlertDescription::HandshakeFailure,
        ),
        // A second identity index.
        (
            ClientConfig::new(ID, p.clone()),
            vec![raw_server_hello(
                false,
                0x1301,
                &[v13.clone(), (41, vec![0, 1])],
            )],
            AlertDescription::IllegalParameter,
        ),
        // HelloRetryRequest for a group already shared.
        (
            ClientConfig::new(ID, p.clone()),
            vec![raw_server_hello(
                true,
                0x1301,
                &[v13.clone(), (51, vec![0, 0x1d])],
            )],
            AlertDescription::IllegalParameter,
        ),
        // Two HelloRetryRequests.
        (
            only_x25519,
            vec![raw_server_hello(true, 0x1301, &[v13.clone(), (51, vec![0, 0x17])]); 2],
            AlertDescription::UnexpectedMessage,
        ),
        // psk_dhe_ke offered, no key_share returned.
        (
            ClientConfig::new(ID, p.clone()),
            vec![raw_server_hello(
                false,
                0x1301,
                &[v13.clone(), (41, vec![0, 0])],
            )],
            AlertDescription::MissingExtension,
        ),
        // An x25519 share of the wrong length.
        (
            ClientConfig::new(ID, p.clone()),
            vec![raw_server_hello(
                false,
                0x1301,
                &[v13, (51, vec![0, 0x1d, 0, 1, 9]), (41, vec![0, 0])],
            )],
            AlertDescription::IllegalParameter,
        ),
    ];
    for (i, (cfg, msgs, want)) in cases.into_iter().enumerate() {
        let (mut c, _) = Handshake::client(cfg).unwrap();
        let mut r = Ok(());
        let mut out = Vec::new();
        for m in msgs {
            out.clear();
            if let Err(e) = c.read(&m, &mut out) {
                r = Err(e);
                break;
            }
        }
        let e = r.unwrap_err();
        assert_eq!(e.alert(), Some(want), "case {i}: {e}");
        assert_eq!(out, plain_alert(want), "case {i}");
    }
}

#[test]
fn debug_output_never_shows_keys() {
    let p = Psk::new(&[0xee; 32], HashAlg::Sha256);
    let c = ClientConfig::new(ID, p.clone());
    let s = ServerConfig::with_psk(ID, p);
    let (hs, _) = Handshake::client(c.clone()).unwrap();
    let (cs, ss) = pair();
    for d in [
        format!("{c:?}"),
        format!("{s:?}"),
        format!("{hs:?}"),
        format!("{cs:?}"),
        format!("{ss:?}"),
    ] {
        assert!(
            !d.contains("238") && !d.to_lowercase().contains("ee, "),
            "{d}"
        );
    }
}

/// The client opens what a fresh server session sends with `f` (which may misbehave).
fn client_opens(
    f: impl FnOnce(&mut Session, &mut Vec<u8>),
) -> (Result<usize, TlsError>, Vec<u8>, Session) {
    let (mut c, mut s) = pair();
    let mut wire = Vec::new();
    f(&mut s, &mut wire);
    let mut plain = Vec::new();
    let r = c.open(&wire, &mut plain);
    (r, plain, c)
}

const NST: [u8; 18] = [4, 0, 0, 14, 0, 0, 0, 60, 0, 0, 0, 1, 0, 0, 1, 0xaa, 0, 0];

#[test]
fn client_absorbs_new_session_tickets() {
    let (r, plain, c) = client_opens(|s, w| {
        s.dangerous_seal_raw(22, &NST, w).unwrap();
        // One split across two records.
        s.dangerous_seal_raw(22, &NST[..7], w).unwrap();
        s.dangerous_seal_raw(22, &NST[7..], w).unwrap();
        s.seal(&[b"data"], w).unwrap();
    });
    r.unwrap();
    assert_eq!(plain, b"data");
    assert_eq!(c.stats().tickets_ignored, 2);
    // A malformed ticket is a decode error.
    let (r, _, _) =
        client_opens(|s, w| s.dangerous_seal_raw(22, &NST[..17], w).map(|_| ()).unwrap());
    assert!(r.is_ok(), "incomplete message waits");
    let mut bad = NST;
    bad[3] = 13;
    let (r, _, _) = client_opens(|s, w| s.dangerous_seal_raw(22, &bad[..17], w).unwrap());
    assert!(matches!(r, Err(TlsError::Decode(_))), "{r:?}");
}

/// A KeyUpdate before the handshake has ended (in the clear, where a ClientHello or ServerHello belongs)
/// ends it with unexpected_message, on either side.
#[test]
fn a_key_update_before_the_handshake_ends_is_refused() {
    let key_update = [22u8, 3, 3, 0, 5, 24, 0, 0, 1, 1];
    let mut server = Handshake::server(ServerConfig::with_psk(ID, psk(HashAlg::Sha256)));
    let mut out = Vec::new();
    let e = server.read(&key_update, &mut out).unwrap_err();
    assert!(matches!(e, TlsError::UnexpectedMessage(_)), "{e:?}");
    assert_eq!(e.alert(), Some(AlertDescription::UnexpectedMessage));
    let (mut client, _hello) =
        Handshake::client(ClientConfig::new(ID, psk(HashAlg::Sha256))).unwrap();
    let e = client.read(&key_update, &mut out).unwrap_err();
    assert!(matches!(e, TlsError::UnexpectedMessage(_)), "{e:?}");
}

#[test]
fn misbehaving_peer_after_the_handshake() {
    type Case = (
        &'static str,
        Box<dyn FnOnce(&mut Session, &mut Vec<u8>)>,
        fn(&TlsError) -> bool,
    );
    let cases: Vec<Case> = vec![
        (
            "KeyUpdate not at the end of its record",
            Box::new(|s, w| {
                s.dangerous_seal_raw(22, &[24, 0, 0, 1, 0, 4, 0], w)
                    .unwrap()
            }),
            |e| matches!(e, TlsError::UnexpectedMessage(_)),
        ),
        (
            "KeyUpdate value 2",
            Box::new(|s, w| s.dangerous_seal_raw(22, &[24, 0, 0, 1, 2], w).unwrap()),
            |e| matches!(e, TlsError::IllegalParameter(_)),
        ),
        (
            "a ClientHello after the handshake",
            Box::new(|s, w| s.dangerous_seal_raw(22, &[1, 0, 0, 0], w).unwrap()),
            |e| matches!(e, TlsError::UnexpectedMessage(_)),
        ),
        (
            "application data inside a handshake message",
            Box::new(|s, w| {
                s.dangerous_seal_raw(22, &NST[..5], w).unwrap();
                s.seal(&[b"x"], w).unwrap();
            }),
            |e| matches!(e, TlsError::UnexpectedMessage(_)),
        ),
        (
            "an empty handshake record",
            Box::new(|s, w| s.dangerous_seal_raw(22, &[], w).unwrap()),
            |e| matches!(e, TlsError::Decode(_)),
        ),
        (
            "an alert of 3 bytes",
            Box::new(|s, w| s.dangerous_seal_raw(21, &[2, 40, 0], w).unwrap()),
            |e| matches!(e, TlsError::Decode(_)),
        ),
        (
            "a fatal alert",
            Box::new(|s, w| s.dangerous_seal_raw(21, &[2, 40], w).unwrap()),
            |e| *e == TlsError::PeerAlert(AlertDescription::HandshakeFailure),
        ),
        (
            "a record with no content type",
            Box::new(|s, w| s.dangerous_seal_raw(0, &[0, 0], w).unwrap()),
            |e| matches!(e, TlsError::UnexpectedMessage(_)),
        ),
        (
            "an unknown content type",
            Box::new(|s, w| s.dangerous_seal_raw(99, b"x", w).unwrap()),
            |e| matches!(e, TlsError::UnexpectedMessage(_)),
        ),
        (
            "a ChangeCipherSpec inside protection",
            Box::new(|s, w| s.dangerous_seal_raw(20, &[1], w).unwrap()),
            |e| matches!(e, TlsError::UnexpectedMessage(_)),
        ),
        (
            "16385 bytes of content",
            Box::new(|s, w| s.dangerous_seal_raw(23, &[0x61; 16385], w).unwrap()),
            |e| *e == TlsError::RecordOverflow,
        ),
    ];
    for (what, f, ok) in cases {
        let (r, plain, mut c) = client_opens(|s, w| {
            s.seal(&[b"before"], w).unwrap();
            f(s, w);
        });
        let e = r.expect_err(what);
        assert!(ok(&e), "{what}: {e:?}");
        assert!(plain.is_empty(), "{what}");
        assert_eq!(c.error(), Some(&e));
        let mut alert = Vec::new();
        let sent = c.write_pending(&mut alert).unwrap();
        assert_eq!(sent, e.alert().is_some(), "{what}");
    }
    // A NewSessionTicket sent to a server.
    let (mut c, mut s) = pair();
    let mut wire = Vec::new();
    c.dangerous_seal_raw(22, &NST, &mut wire).unwrap();
    assert!(matches!(
        s.open(&wire, &mut Vec::new()),
        Err(TlsError::UnexpectedMessage(_))
    ));
    // user_canceled is not fatal.
    let (r, plain, _) = client_opens(|s, w| {
        s.dangerous_seal_raw(21, &[1, 90], w).unwrap();
        s.seal(&[b"still here"], w).unwrap();
    });
    r.unwrap();
    assert_eq!(plain, b"still here");
}

#[test]
fn slice_apis_write_in_place_and_respect_bounds() {
    let (mut c, mut s) = pair();
    let data: Vec<u8> = (0..20_000u32).map(|i| i as u8).collect();
    let need = Session::sealed_len(data.len());
    assert_eq!(need, 20_000 + 2 * 22);
    // Too small: refused, nothing written, the sequence untouched.
    let mut ring = vec![0xffu8; 64 * 1024];
    assert!(matches!(
        c.seal_to_slice(&[&data], &mut ring[..need - 1]),
        Err(TlsError::InvalidUse(_))
    ));
    assert!(ring.iter().all(|&b| b == 0xff));
    let (records, n) = c
        .seal_to_slice(&[&data[..7], &data[7..]], &mut ring)
        .unwrap();
    assert_eq!((records, n), (2, need));
    // Open into a buffer that holds only the first record's ciphertext: stops after it.
    let mut plain = vec![0u8; 16384 + 17];
    let (consumed, written) = s.open_to_slice(&ring[..n], &mut plain).unwrap();
    assert_eq!((consumed, written), (16384 + 22, 16384));
    assert_eq!(&plain[..written], &data[..16384]);
    let (consumed2, written2) = s.open_to_slice(&ring[consumed..n], &mut plain).unwrap();
    assert_eq!((consumed2, written2), (n - consumed, 20_000 - 16384));
    assert_eq!(&plain[..written2], &data[16384..]);
    // No room for a record: no progress, no error.
    let mut wire = Vec::new();
    c.seal(&[b"abc"], &mut wire).unwrap();
    assert_eq!(s.open_to_slice(&wire, &mut [0u8; 3]).unwrap(), (0, 0));
    assert_eq!(
        s.open_to_slice(&wire, &mut [0u8; 4]).unwrap(),
        (wire.len(), 3)
    );
    // An owed KeyUpdate needs room too.
    let mut ku = Vec::new();
    c.update_keys(true, &mut ku).unwrap();
    assert_eq!(s.open(&ku, &mut Vec::new()).unwrap(), ku.len());
    assert!(s.has_pending());
    let mut buf = [0u8; 64];
    let one = Session::sealed_len(1);
    assert!(s.seal_to_slice(&[b"x"], &mut buf[..one]).is_err());
    let (_, n) = s
        .seal_to_slice(&[b"x"], &mut buf[..one + KEY_UPDATE_LEN])
        .unwrap();
    assert_eq!(n, one + KEY_UPDATE_LEN);
    let mut plain = Vec::new();
    assert_eq!(c.open(&buf[..n], &mut plain).unwrap(), n);
    assert_eq!(plain, b"x");
}
