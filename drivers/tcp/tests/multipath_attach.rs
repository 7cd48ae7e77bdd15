//! A multipath subsystem whose path cannot be attached: the error says which path, and keeps the path's own
//! error whole as its source, classed as that error is.

use std::time::Duration;

use nvpoll::mem::DmaPool;
use nvpoll::{ErrorClass, TransportError};
use nvpoll_tcp::host::ConnectOptions;
use nvpoll_tcp::multipath::{MultipathController, PathPolicy};
use nvpoll_tcp::Error;

#[test]
fn a_path_that_refuses_the_connection_is_named_and_keeps_its_error() {
    // A port nothing listens on: the TCP connect is refused.
    let addr = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let mut o = ConnectOptions::new(
        addr,
        "nqn.2014-08.org.example:mp",
        "nqn.2014-08.org.example:host",
    );
    o.timeout = Duration::from_secs(2);
    let pool = DmaPool::builder().class(4096, 16).build().unwrap();
    let Err(e) = MultipathController::connect(vec![o], pool, PathPolicy::default()) else {
        panic!("no path can be attached");
    };
    let Error::PathAttach {
        addr: at, cause, ..
    } = &e
    else {
        panic!("{e:?}");
    };
    assert_eq!(*at, addr);
    assert!(matches!(**cause, Error::Io { .. }), "{cause:?}");
    assert_eq!(e.class(), ErrorClass::ConnectionLost);
    let source = std::error::Error::source(&e).expect("the path's error is the source");
    assert_eq!(source.to_string(), cause.to_string());
    assert_eq!(
        e.to_string(),
        format!("path {addr} of nqn.2014-08.org.example:mp: attach failed: {cause}")
    );
    let api = nvpoll::Error::from(e);
    assert!(matches!(api, nvpoll::Error::ConnectionLost(_)), "{api:?}");
}
