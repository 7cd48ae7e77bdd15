//! TLS key renewal on a real loopback connection between two `Conn`s: both directions renew by KeyUpdate
//! at a low count; a renewal by reconnecting ends the connection at the count; a peer that alerts at our
//! KeyUpdate is told apart from one that fails for another reason.

use std::net::TcpListener;
use std::time::{Duration, Instant};

use nvpoll_tls::{ClientConfig, Handshake, HashAlg, Psk, ServerConfig};
use nvpoll_wire::conn::Conn;
use nvpoll_wire::{Error, KeyRenewal, RekeyCause, RenewBy};

const KEY: [u8; 32] = [7; 32];

/// A connected TLS pair: (client, server), the server's handshake driven here.
fn tls_pair(client: KeyRenewal, server: KeyRenewal) -> (Conn, Conn) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let t = std::thread::spawn(move || {
        let mut c = Conn::connect(addr, Duration::from_secs(5), 1 << 20).unwrap();
        c.set_key_renewal(client);
        let cfg = ClientConfig::new(b"id".to_vec(), Psk::new(&KEY, HashAlg::Sha256));
        c.tls_client_handshake(cfg, Duration::from_secs(5)).unwrap();
        c
    });
    let (s, _) = l.accept().unwrap();
    let mut srv = Conn::from_stream(s, 1 << 20).unwrap();
    srv.set_key_renewal(server);
    let mut hs = Some(Handshake::server(ServerConfig::new(|id| {
        (id == b"id").then(|| Psk::new(&KEY, HashAlg::Sha256))
    })));
    let mut inb = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(5);
    while !srv.tls_step(&mut hs, &mut inb).unwrap() {
        assert!(Instant::now() < deadline, "server handshake did not finish");
    }
    (t.join().unwrap(), srv)
}

/// Sends `msg` from `a` and reads it whole at `b` (both sides flushed and filled until it arrives).
fn send(a: &mut Conn, b: &mut Conn, msg: &[u8]) -> Result<(), Error> {
    a.tx_buf().extend_from_slice(msg);
    a.pdu_queued();
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        a.flush()?;
        a.fill()?; // takes the peer's KeyUpdates and answers them
        b.fill()?;
        b.flush()?;
        if b.rx_data().len() >= msg.len() {
            assert_eq!(&b.rx_data()[..msg.len()], msg);
            b.consume(msg.len());
            return Ok(());
        }
        assert!(Instant::now() < deadline, "the message did not arrive");
    }
}

#[test]
fn both_directions_renew_by_key_update_at_a_low_count() {
    let (mut c, mut s) = tls_pair(KeyRenewal::after(10), KeyRenewal::after(10));
    for i in 0..100u32 {
        send(&mut c, &mut s, &i.to_le_bytes()).unwrap();
        send(&mut s, &mut c, &i.to_be_bytes()).unwrap();
    }
    let (cs, ss) = (c.stats, s.stats);
    // 100 records each way under a count of 10: about ten renewals each way, each answered.
    assert!(cs.key_updates_sent >= 5, "{cs:?}");
    assert!(ss.key_updates_sent >= 5, "{ss:?}");
    assert!(cs.key_updates_received >= 5, "{cs:?}");
    assert!(ss.key_updates_received >= 5, "{ss:?}");
    let hard = 20;
    let (cw, sw) = (
        c.tls_session().unwrap().records_under_write_key(),
        s.tls_session().unwrap().records_under_write_key(),
    );
    assert!(
        cw < hard && sw < hard,
        "a key went past its limit: {cw} {sw}"
    );
}

#[test]
fn one_way_traffic_still_renews_the_silent_side_s_peer() {
    // Only the client sends data: the server opens records under the client's key and asks for a renewal
    // (and the client renews on its own count anyway).
    let (mut c, mut s) = tls_pair(KeyRenewal::after(1_000_000), KeyRenewal::after(10));
    for i in 0..60u32 {
        send(&mut c, &mut s, &i.to_le_bytes()).unwrap();
    }
    assert!(s.stats.key_updates_received >= 3, "{:?}", s.stats);
    assert!(c.stats.key_updates_received >= 3, "{:?}", c.stats);
}

#[test]
fn renewal_by_reconnect_ends_the_connection_at_the_count() {
    let by_reconnect = KeyRenewal {
        method: RenewBy::Reconnect,
        ..KeyRenewal::after(10)
    };
    let (mut c, mut s) = tls_pair(by_reconnect, KeyRenewal::after(1_000_000));
    let mut ended = None;
    for i in 0..30u32 {
        if let Err(e) = send(&mut c, &mut s, &i.to_le_bytes()) {
            ended = Some((i, e));
            break;
        }
    }
    let (i, e) = ended.expect("the connection should end at the count");
    assert!(matches!(e, Error::Rekey(RekeyCause::Planned)), "{e:?}");
    assert_eq!(i, 10, "it ended after exactly the count's records: {e}");
    assert_eq!(c.stats.key_updates_sent, 0, "no KeyUpdate in this mode");
    let api = nvpoll::Error::from(e);
    assert_eq!(api.retry(), nvpoll::Retry::Elsewhere, "{api:?}");
}

#[test]
fn a_peer_that_ends_the_connection_at_our_key_update_is_recognised() {
    let (mut c, mut s) = tls_pair(KeyRenewal::after(3), KeyRenewal::after(1_000_000));
    // The server reads nothing and resets the connection once our KeyUpdate is out, as a kernel TLS peer
    // without re-keying does.
    let mut err = None;
    for i in 0..10u32 {
        c.tx_buf().extend_from_slice(&i.to_le_bytes());
        c.pdu_queued();
        if let Err(e) = c.flush() {
            err = Some(e);
            break;
        }
        if c.stats.key_updates_sent > 0 {
            break;
        }
    }
    assert!(err.is_none(), "{err:?}");
    assert_eq!(c.stats.key_updates_sent, 1);
    s.shutdown();
    drop(s);
    let deadline = Instant::now() + Duration::from_secs(5);
    let e = loop {
        match c.fill() {
            Err(e) => break e,
            Ok(_) => assert!(Instant::now() < deadline, "the reset was not seen"),
        }
    };
    assert!(matches!(e, Error::KeyUpdateRefused { .. }), "{e:?}");
}

#[test]
fn a_key_in_use_for_the_interval_is_renewed_by_time() {
    let hourly = KeyRenewal::after(1_000_000);
    let (mut c, mut s) = tls_pair(hourly, hourly);
    let now = Instant::now();
    c.renew_keys_if_due(now).unwrap();
    assert_eq!(c.stats.key_updates_sent, 0, "not due yet");
    c.renew_keys_if_due(now + Duration::from_secs(3601))
        .unwrap();
    assert_eq!(c.stats.key_updates_sent, 1);
    // The peer answers (update_requested) and both go on under new keys.
    send(&mut c, &mut s, b"after").unwrap();
    send(&mut s, &mut c, b"reply").unwrap();
    assert_eq!(s.stats.key_updates_received, 1);
    assert_eq!(s.stats.key_updates_sent, 1);
    assert_eq!(c.stats.key_updates_received, 1);
    // Not again until another interval has passed from the renewal.
    c.renew_keys_if_due(now + Duration::from_secs(3602))
        .unwrap();
    c.renew_keys_if_due(now + Duration::from_secs(3603))
        .unwrap();
    assert_eq!(c.stats.key_updates_sent, 1);
}
