//! Interop with OpenSSL 3 (`openssl s_server` / `s_client`) over loopback: our client and our server, both
//! suites, x25519 and P-256, HelloRetryRequest, psk_ke, session tickets, and the failures a real peer
//! reports (wrong PSK, unknown identity, a tampered record).
//!
//! Skipped with a message when `openssl` is missing.

use nvpoll_testkit::tls as tls_common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::Command;
use std::time::{Duration, Instant};

use base64::Engine as _;
use nvpoll_tls::{
    AlertDescription, CipherSuite, ClientConfig, ConfiguredKey, Derivation, Group, HashAlg,
    IdentityVersion, Psk, ServerConfig, TlsError,
};
use tls_common::*;

const HOST: &str = "nqn.2014-08.org.nvmexpress:uuid:host-under-test";
const SUBSYS: &str = "nqn.2016-06.io.nvpoll:tls-target";
const KEY32: &str = "NVMeTLSkey-1:01:VRLbtnN9AQb2WXW3c9+wEf/DRLz0QuLdbYvEhwtdWwNf9LrZ:";
const KEY48: &str =
    "NVMeTLSkey-1:02:VRLbtnN9AQb2WXW3c9+wEf/DRLz0QuLdbYvEhwtdWwP/w0S89ELi3W2LxIcLXVsDn8kXZQ==:";

fn openssl() -> bool {
    have("openssl", "openssl")
}

/// The v0 identity and TLS PSK derived from a configured key, as a host and target would.
fn nvme_psk(configured: &str) -> (String, Psk) {
    ConfiguredKey::parse(configured).unwrap().derive(
        IdentityVersion::V0,
        HOST,
        SUBSYS,
        Derivation::Rfc8446,
    )
}

/// DER tag-length-value.
fn tlv(tag: u8, content: &[u8]) -> Vec<u8> {
    let mut v = vec![tag];
    match content.len() {
        n if n < 0x80 => v.push(n as u8),
        n if n < 0x100 => v.extend_from_slice(&[0x81, n as u8]),
        n => v.extend_from_slice(&[0x82, (n >> 8) as u8, n as u8]),
    }
    v.extend_from_slice(content);
    v
}

fn der_int(n: u64) -> Vec<u8> {
    let mut b: Vec<u8> = n.to_be_bytes().to_vec();
    while b.len() > 1 && b[0] == 0 && b[1] & 0x80 == 0 {
        b.remove(0);
    }
    if b[0] & 0x80 != 0 {
        b.insert(0, 0);
    }
    tlv(0x02, &b)
}

/// A TLS 1.3 SSL_SESSION in PEM (what `-psk_session` reads) holding `psk` as the key for its suite:
/// SEQUENCE { version 1, ssl_version 0x0304, cipher (2 bytes), session_id, master_key,
/// [1] time, [2] timeout }, as OpenSSL's ssl_asn1.c lays it out.
fn psk_session_pem(psk: &Psk) -> String {
    let suite = CipherSuite::for_hash(psk.hash()).code();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let mut body = Vec::new();
    body.extend(der_int(1));
    body.extend(der_int(0x0304));
    body.extend(tlv(0x04, &suite.to_be_bytes()));
    body.extend(tlv(0x04, &[]));
    body.extend(tlv(0x04, psk.dangerous_as_bytes()));
    body.extend(tlv(0xa1, &der_int(now)));
    body.extend(tlv(0xa2, &der_int(86400)));
    let der = tlv(0x30, &body);
    let b64 = base64::engine::general_purpose::STANDARD.encode(der);
    let mut pem = String::from("-----BEGIN SSL SESSION PARAMETERS-----\n");
    for line in b64.as_bytes().chunks(64) {
        pem.push_str(std::str::from_utf8(line).unwrap());
        pem.push('\n');
    }
    pem.push_str("-----END SSL SESSION PARAMETERS-----\n");
    pem
}

struct PskArgs {
    args: Vec<String>,
    _file: Option<TempFile>,
}

struct TempFile(std::path::PathBuf);

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// `-psk HEX` for SHA-256, `-psk_session FILE` for SHA-384 (OpenSSL's `-psk` is SHA-256 only).
fn psk_args(identity: &str, psk: &Psk) -> PskArgs {
    let mut args = vec!["-psk_identity".to_string(), identity.to_string()];
    match psk.hash() {
        HashAlg::Sha256 => {
            args.extend(["-psk".into(), hex(psk.dangerous_as_bytes())]);
            args.extend(["-ciphersuites".into(), "TLS_AES_128_GCM_SHA256".into()]);
            PskArgs { args, _file: None }
        }
        HashAlg::Sha384 => {
            let path = scratch("psk-session.pem");
            std::fs::write(&path, psk_session_pem(psk)).unwrap();
            args.extend(["-psk_session".into(), path.display().to_string()]);
            args.extend(["-ciphersuites".into(), "TLS_AES_256_GCM_SHA384".into()]);
            PskArgs {
                args,
                _file: Some(TempFile(path)),
            }
        }
    }
}

/// `openssl s_server -rev` (echoes each line reversed) for one connection.
fn s_server(identity: &str, psk: &Psk, extra: &[&str]) -> (Peer, u16, PskArgs) {
    let pa = psk_args(identity, psk);
    let (peer, port) = spawn_listening(|port| {
        let mut cmd = Command::new("openssl");
        cmd.args(["s_server", "-accept", &format!("127.0.0.1:{port}")])
            .args(["-tls1_3", "-nocert", "-naccept", "1", "-rev"])
            .args(&pa.args)
            .args(extra);
        cmd
    });
    (peer, port, pa)
}

/// `openssl s_client` to 127.0.0.1:`port` with `pa`'s PSK and `extra` arguments; its stdin is ours.
fn s_client(port: u16, pa: &PskArgs, extra: &[&str]) -> Peer {
    let mut cmd = Command::new("openssl");
    cmd.args([
        "s_client",
        "-connect",
        &format!("127.0.0.1:{port}"),
        "-tls1_3",
    ])
    .args(&pa.args)
    .args(extra);
    Peer::spawn(&mut cmd, true)
}

/// Our client against s_server: handshake, "hello nvme\n" out, the reversed line back.
fn client_round_trip(
    cfg: ClientConfig,
    identity: &str,
    psk: &Psk,
    extra: &[&str],
) -> nvpoll_tls::Session {
    let (server, port, _pa) = s_server(identity, psk, extra);
    let mut stream = connect(port);
    let (mut s, mut pending) = client_handshake(&mut stream, cfg)
        .unwrap_or_else(|e| panic!("handshake: {e:?}\ns_server:\n{}", server.output()));
    send(&mut stream, &mut s, &[b"hello ", b"nvme\n"]);
    let mut plain = Vec::new();
    recv(&mut stream, &mut s, &mut pending, &mut plain, 11)
        .unwrap_or_else(|e| panic!("recv: {e:?}\ns_server:\n{}", server.output()));
    assert_eq!(plain, b"emvn olleh\n");
    s
}

#[test]
fn client_sha256_x25519_nvme_v0_identity() {
    if !openssl() {
        return;
    }
    let (id, psk) = nvme_psk(KEY32);
    let s = client_round_trip(
        ClientConfig::new(id.clone(), psk.clone()),
        &id,
        &psk,
        &["-num_tickets", "0"],
    );
    assert_eq!(s.cipher_suite(), CipherSuite::Aes128GcmSha256);
    assert_eq!(s.group(), Some(Group::X25519));
    assert!(!s.negotiated().hello_retry);
}

#[test]
fn client_sha256_p256() {
    if !openssl() {
        return;
    }
    let (id, psk) = nvme_psk(KEY32);
    let s = client_round_trip(
        ClientConfig::new(id.clone(), psk.clone()),
        &id,
        &psk,
        &["-num_tickets", "0", "-groups", "P-256"],
    );
    assert_eq!(s.group(), Some(Group::Secp256r1));
    assert!(!s.negotiated().hello_retry);
}

#[test]
fn client_hello_retry_to_p256() {
    if !openssl() {
        return;
    }
    let (id, psk) = nvme_psk(KEY32);
    let mut cfg = ClientConfig::new(id.clone(), psk.clone());
    cfg.key_shares = vec![Group::X25519];
    let s = client_round_trip(cfg, &id, &psk, &["-num_tickets", "0", "-groups", "P-256"]);
    assert_eq!(s.group(), Some(Group::Secp256r1));
    assert!(s.negotiated().hello_retry);
}

#[test]
fn client_sha384_psk_session() {
    if !openssl() {
        return;
    }
    let (id, psk) = nvme_psk(KEY48);
    assert_eq!(psk.hash(), HashAlg::Sha384);
    let s = client_round_trip(
        ClientConfig::new(id.clone(), psk.clone()),
        &id,
        &psk,
        &["-num_tickets", "0"],
    );
    assert_eq!(s.cipher_suite(), CipherSuite::Aes256GcmSha384);
}

#[test]
fn client_absorbs_session_tickets() {
    if !openssl() {
        return;
    }
    let (id, psk) = nvme_psk(KEY32);
    let s = client_round_trip(
        ClientConfig::new(id.clone(), psk.clone()),
        &id,
        &psk,
        &["-num_tickets", "2"],
    );
    // OpenSSL sends a single ticket after a PSK ("resumed") handshake, whatever -num_tickets says.
    assert!(s.stats().tickets_ignored >= 1, "{:?}", s.stats());
}

#[test]
fn client_psk_ke_when_both_allow_it() {
    if !openssl() {
        return;
    }
    let (id, psk) = nvme_psk(KEY32);
    let mut cfg = ClientConfig::new(id.clone(), psk.clone());
    cfg.groups.clear();
    cfg.key_shares.clear();
    cfg.allow_psk_ke = true;
    let s = client_round_trip(cfg, &id, &psk, &["-num_tickets", "0", "-allow_no_dhe_kex"]);
    assert_eq!(s.group(), None);
}

#[test]
fn client_wrong_psk_is_refused() {
    if !openssl() {
        return;
    }
    let (id, psk) = nvme_psk(KEY32);
    let (mut server, port, _pa) = s_server(&id, &psk, &["-num_tickets", "0"]);
    let mut stream = connect(port);
    let wrong = Psk::new(&[0x11; 32], HashAlg::Sha256);
    let e = client_handshake(&mut stream, ClientConfig::new(id.clone(), wrong)).unwrap_err();
    // RFC 8446 asks for decrypt_error; OpenSSL 3.0 sends illegal_parameter for a binder that does not
    // verify.
    assert!(
        matches!(
            e.tls(),
            Some(TlsError::PeerAlert(
                AlertDescription::DecryptError | AlertDescription::IllegalParameter
            ))
        ),
        "{e:?}\n{}",
        server.output()
    );
    assert!(
        server.wait_output("binder does not verify", STEP),
        "{}",
        server.output()
    );
}

#[test]
fn client_unknown_identity_is_refused() {
    if !openssl() {
        return;
    }
    let (id, psk) = nvme_psk(KEY32);
    let (server, port, _pa) = s_server(&id, &psk, &["-num_tickets", "0"]);
    let mut stream = connect(port);
    let e = client_handshake(
        &mut stream,
        ClientConfig::new("NVMe0R01 nobody nothing", psk),
    )
    .unwrap_err();
    // Without the PSK OpenSSL falls back to certificates, and has none.
    assert!(
        matches!(e.tls(), Some(TlsError::PeerAlert(_))),
        "{e:?}\n{}",
        server.output()
    );
}

/// `openssl s_client` against our server: it sends a line from stdin, we answer and close.
fn server_round_trip(
    cfg: ServerConfig,
    identity: &str,
    psk: &Psk,
    extra: &[&str],
) -> nvpoll_tls::Session {
    let (port, t) = accept_one(move |mut stream| {
        let (mut s, mut pending) = server_handshake(&mut stream, cfg)?;
        let mut plain = Vec::new();
        recv(&mut stream, &mut s, &mut pending, &mut plain, 20)?;
        assert_eq!(plain, b"hello from s_client\n");
        send(&mut stream, &mut s, &[b"hello from nvpoll\n"]);
        let mut out = Vec::new();
        s.close(&mut out).unwrap();
        stream.write_all(&out).unwrap();
        Ok::<_, Failure>(s)
    });
    let pa = psk_args(identity, psk);
    let mut client = s_client(port, &pa, extra);
    client.send_stdin(b"hello from s_client\n");
    let s = t
        .join()
        .unwrap()
        .unwrap_or_else(|e| panic!("{e:?}\ns_client:\n{}", client.output()));
    assert!(
        client.wait_output("hello from nvpoll", STEP),
        "s_client did not print our reply:\n{}",
        client.output()
    );
    assert_eq!(s.psk_identity(), identity.as_bytes());
    s
}

#[test]
fn server_sha256_x25519() {
    if !openssl() {
        return;
    }
    let (id, psk) = nvme_psk(KEY32);
    let s = server_round_trip(
        ServerConfig::with_psk(id.clone(), psk.clone()),
        &id,
        &psk,
        &[],
    );
    assert_eq!(s.group(), Some(Group::X25519));
    assert_eq!(s.cipher_suite(), CipherSuite::Aes128GcmSha256);
}

#[test]
fn server_sha256_p256() {
    if !openssl() {
        return;
    }
    let (id, psk) = nvme_psk(KEY32);
    let s = server_round_trip(
        ServerConfig::with_psk(id.clone(), psk.clone()),
        &id,
        &psk,
        &["-groups", "P-256"],
    );
    assert_eq!(s.group(), Some(Group::Secp256r1));
    assert!(!s.negotiated().hello_retry);
}

#[test]
fn server_hello_retry_request() {
    if !openssl() {
        return;
    }
    let (id, psk) = nvme_psk(KEY32);
    let mut cfg = ServerConfig::with_psk(id.clone(), psk.clone());
    cfg.groups = vec![Group::Secp256r1];
    // s_client shares x25519 only but supports P-256: we ask for it.
    let s = server_round_trip(cfg, &id, &psk, &["-groups", "X25519:P-256"]);
    assert_eq!(s.group(), Some(Group::Secp256r1));
    assert!(s.negotiated().hello_retry);
}

#[test]
fn server_sha384_psk_session() {
    if !openssl() {
        return;
    }
    let (id, psk) = nvme_psk(KEY48);
    let s = server_round_trip(
        ServerConfig::with_psk(id.clone(), psk.clone()),
        &id,
        &psk,
        &[],
    );
    assert_eq!(s.cipher_suite(), CipherSuite::Aes256GcmSha384);
}

#[test]
fn server_psk_ke_when_both_allow_it() {
    if !openssl() {
        return;
    }
    let (id, psk) = nvme_psk(KEY32);
    let mut cfg = ServerConfig::with_psk(id.clone(), psk.clone());
    cfg.groups.clear();
    cfg.allow_psk_ke = true;
    let s = server_round_trip(cfg, &id, &psk, &["-allow_no_dhe_kex"]);
    assert_eq!(s.group(), None);
}

/// s_client with the wrong key or an unknown identity: our server's error and the alert s_client saw.
fn server_refuses(client_identity: &str, client_psk: &Psk, want: TlsError, alert_text: &str) {
    let (id, psk) = nvme_psk(KEY32);
    let (port, t) = accept_one(move |mut stream| {
        server_handshake(&mut stream, ServerConfig::with_psk(id, psk)).map(|_| ())
    });
    let pa = psk_args(client_identity, client_psk);
    let mut client = s_client(port, &pa, &[]);
    let e = t.join().unwrap().unwrap_err();
    assert_eq!(e.tls(), Some(&want), "{e:?}\n{}", client.output());
    assert!(
        client.wait_output(alert_text, STEP),
        "s_client did not report {alert_text:?}:\n{}",
        client.output()
    );
}

#[test]
fn server_wrong_psk_sends_decrypt_error() {
    if !openssl() {
        return;
    }
    let (id, _) = nvme_psk(KEY32);
    let wrong = Psk::new(&[0x22; 32], HashAlg::Sha256);
    server_refuses(&id, &wrong, TlsError::BadBinder, "decrypt error");
}

#[test]
fn server_unknown_identity_sends_unknown_psk_identity() {
    if !openssl() {
        return;
    }
    let (_, psk) = nvme_psk(KEY32);
    server_refuses(
        "NVMe0R01 nqn.someone-else nqn.something",
        &psk,
        TlsError::UnknownIdentity,
        "alert unknown psk identity",
    );
}

/// A relay that flips one bit in the first application-data record going from `from` to `to`
/// after `skip` such records, and passes everything else through.
fn tampering_relay(
    mut from: TcpStream,
    mut to: TcpStream,
    skip: usize,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        relay_records(&mut from, &mut to, skip);
        // Ending one direction ends the other: its read sees EOF.
        let _ = from.shutdown(std::net::Shutdown::Both);
        let _ = to.shutdown(std::net::Shutdown::Both);
    })
}

fn relay_records(from: &mut TcpStream, to: &mut TcpStream, skip: usize) {
    {
        from.set_read_timeout(Some(Duration::from_millis(100)))
            .unwrap();
        let end = Instant::now() + STEP;
        let mut buf = Vec::new();
        let mut seen = 0;
        let mut chunk = [0u8; 65536];
        while Instant::now() < end {
            match from.read(&mut chunk) {
                Ok(0) => return,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
                Err(_) => continue,
            }
            // Forward whole records only, so the flip lands where we want.
            while buf.len() >= 5 {
                let len = 5 + (usize::from(buf[3]) << 8 | usize::from(buf[4]));
                if buf.len() < len {
                    break;
                }
                let mut rec: Vec<u8> = buf.drain(..len).collect();
                if rec[0] == 23 {
                    if seen == skip {
                        rec[len - 1] ^= 0x40;
                    }
                    seen += 1;
                }
                if to.write_all(&rec).is_err() {
                    return;
                }
            }
        }
    }
}

#[test]
fn client_rejects_tampered_record_from_s_server() {
    if !openssl() {
        return;
    }
    let (id, psk) = nvme_psk(KEY32);
    let (server, port, _pa) = s_server(&id, &psk, &["-num_tickets", "0"]);
    // us <-> relay (flips a bit in the server's first protected record: EncryptedExtensions) <-> s_server
    let (relay_port, relay) = accept_one(move |ours| {
        let theirs = connect(port);
        let up = tampering_relay(
            ours.try_clone().unwrap(),
            theirs.try_clone().unwrap(),
            usize::MAX,
        );
        let down = tampering_relay(theirs, ours, 0);
        up.join().unwrap();
        down.join().unwrap();
    });
    let mut stream = connect(relay_port);
    let e = client_handshake(&mut stream, ClientConfig::new(id, psk)).unwrap_err();
    assert_eq!(e.tls(), Some(&TlsError::BadRecordMac), "{e:?}");
    drop(stream);
    let _ = relay.join();
    drop(server);
}

#[test]
fn server_rejects_tampered_record_from_s_client() {
    if !openssl() {
        return;
    }
    let (id, psk) = nvme_psk(KEY32);
    let cfg = ServerConfig::with_psk(id.clone(), psk.clone());
    let (port, t) = accept_one(move |mut stream| server_handshake(&mut stream, cfg).map(|_| ()));
    // s_client <-> relay (flips a bit in the client's Finished) <-> us
    let (relay_port, relay) = accept_one(move |theirs| {
        let ours = connect(port);
        let up = tampering_relay(theirs.try_clone().unwrap(), ours.try_clone().unwrap(), 0);
        let down = tampering_relay(ours, theirs, usize::MAX);
        up.join().unwrap();
        down.join().unwrap();
    });
    let pa = psk_args(&id, &psk);
    let mut client = s_client(relay_port, &pa, &[]);
    let e = t.join().unwrap().unwrap_err();
    assert_eq!(e.tls(), Some(&TlsError::BadRecordMac), "{e:?}");
    assert!(
        client.wait_output("bad record mac", STEP),
        "s_client did not report bad record mac:\n{}",
        client.output()
    );
    drop(client);
    let _ = relay.join();
}

/// Our client renewing its keys on its own every 3 records, asking OpenSSL to renew too, over 30 lines
/// echoed reversed: every line comes back, and OpenSSL answered every request with a KeyUpdate of its own.
#[test]
fn client_renews_keys_on_its_own_and_openssl_follows() {
    if !openssl() {
        return;
    }
    let (id, psk) = nvme_psk(KEY32);
    let (server, port, _pa) = s_server(&id, &psk, &["-num_tickets", "0"]);
    let mut stream = connect(port);
    let (mut s, mut pending) = client_handshake(&mut stream, ClientConfig::new(id, psk))
        .unwrap_or_else(|e| panic!("handshake: {e:?}\ns_server:\n{}", server.output()));
    s.set_key_limits(nvpoll_tls::KeyLimits::renew_after(3).unwrap())
        .unwrap();
    for i in 0..30 {
        let line = format!("line {i:02}\n");
        send(&mut stream, &mut s, &[line.as_bytes()]);
        let mut plain = Vec::new();
        recv(&mut stream, &mut s, &mut pending, &mut plain, line.len())
            .unwrap_or_else(|e| panic!("recv {i}: {e:?}\ns_server:\n{}", server.output()));
        let want: Vec<u8> = line.trim_end().bytes().rev().chain(*b"\n").collect();
        assert_eq!(plain, want, "line {i}");
    }
    let st = *s.stats();
    assert!(st.key_updates_sent >= 9, "{st:?}");
    assert!(
        st.key_updates_received >= st.key_updates_sent - 1,
        "OpenSSL answers each request: {st:?}"
    );
}

/// `openssl s_client` sending 24 lines to our server, one at a time (each its own record: the next goes
/// once the server has the last), which renews every 4 records: it asks s_client to renew its key as the
/// records come in, and s_client does.
#[test]
fn server_asks_openssl_to_renew_and_it_does() {
    if !openssl() {
        return;
    }
    let (id, psk) = nvme_psk(KEY32);
    let cfg = ServerConfig::with_psk(id.clone(), psk.clone());
    const LINES: usize = 24;
    let (got, lines_in) = std::sync::mpsc::channel::<usize>();
    let (port, t) = accept_one(move |mut stream| {
        let (mut s, mut pending) = server_handshake(&mut stream, cfg)?;
        s.set_key_limits(nvpoll_tls::KeyLimits::renew_after(4).unwrap())
            .unwrap();
        let mut plain = Vec::new();
        for i in 0..LINES {
            let want = format!("line {i:02}\n");
            recv(&mut stream, &mut s, &mut pending, &mut plain, want.len())?;
            assert_eq!(plain, want.as_bytes());
            plain.clear();
            got.send(i).unwrap();
        }
        send(&mut stream, &mut s, &[b"done\n"]);
        Ok::<_, Failure>(s)
    });
    let pa = psk_args(&id, &psk);
    let mut client = s_client(port, &pa, &[]);
    for i in 0..LINES {
        client.send_stdin(format!("line {i:02}\n").as_bytes());
        if lines_in.recv_timeout(STEP) != Ok(i) {
            break; // the server thread failed: its error is reported below
        }
    }
    let s = t
        .join()
        .unwrap()
        .unwrap_or_else(|e| panic!("{e:?}\ns_client:\n{}", client.output()));
    assert!(client.wait_output("done", STEP), "{}", client.output());
    let st = *s.stats();
    assert!(st.key_updates_sent >= 5, "{st:?}");
    assert!(
        st.key_updates_received >= 5,
        "s_client renewed when asked: {st:?}"
    );
}
