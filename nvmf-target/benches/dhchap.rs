//! DH-HMAC-CHAP costs: `cargo bench -p nvpoll-target --bench dhchap`.
//!
//! 1. Connect time of our initiator to our target (admin queue: TCP, ICReq, Connect, the authentication,
//!    enable, Identify) per hash and DH group, host-only and bidirectional, against the same connect without
//!    authentication: the median of NVPOLL_DHCHAP_CONNECTS (default 7) connects each.
//! 2. A storm: NVPOLL_DHCHAP_STORM (default 128) queues authenticating with ffdhe8192 and SHA-512
//!    (bidirectional) from two threads, while another connection on the same target reactor runs 4 KiB reads
//!    at queue depth 1: its latency (p50, p99, max) before and during the storm. The target runs the FFDHE
//!    arithmetic on threads of its own, so the reactor keeps serving; on a machine with few cores those
//!    threads and the hosts' own arithmetic still take CPU from it, which the numbers then show.

use nvpoll_testkit::target as target_common;

use std::time::{Duration, Instant};

use nvpoll::api::{IoOp, IoRequest, QueuePair};
use nvpoll_target::{DhchapKey, DhchapPolicy};
use nvpoll_tcp::dhchap::{DhGroup, Hash, Secret};
use nvpoll_tcp::host::{ConnectOptions, TcpController};
use target_common::{pool, TestTarget, HOSTNQN, NQN};

const HOST_KEY: &str = "DHHC-1:01:WulleCBkG4oCs0iIC3Cit9gBDCLWiZ9PNXuhqytWkBIZkvGy:";

fn env_usize(name: &str, default: usize) -> usize {
    match std::env::var(name) {
        Ok(s) => s.parse().unwrap_or_else(|_| {
            eprintln!("{name} must be a number, not '{s}'");
            std::process::exit(2)
        }),
        Err(_) => default,
    }
}

fn ctrl_key() -> String {
    let raw: Vec<u8> = (0..64u8)
        .map(|i| i.wrapping_mul(13).wrapping_add(1))
        .collect();
    Secret::from_key(&raw, Some(Hash::Sha512))
        .unwrap()
        .to_dhhc1()
        .to_string()
}

fn options(t: &TestTarget, auth: Option<bool>) -> ConnectOptions {
    let mut o = ConnectOptions::new(t.addr, NQN, HOSTNQN);
    o.timeout = Duration::from_secs(30);
    o.kato = Duration::from_secs(30);
    match auth {
        None => o,
        Some(bidi) => {
            let ck = ctrl_key();
            o.with_dhchap(HOST_KEY, bidi.then_some(ck.as_str()))
                .expect("keys parse")
        }
    }
}

fn median_connect_ms(t: &TestTarget, auth: Option<bool>, n: usize) -> f64 {
    let mut v: Vec<f64> = (0..n)
        .map(|_| {
            let t0 = Instant::now();
            let c = TcpController::connect(options(t, auth), pool()).expect("connect");
            let ms = t0.elapsed().as_secs_f64() * 1e3;
            drop(c);
            ms
        })
        .collect();
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() {
    let n = env_usize("NVPOLL_DHCHAP_CONNECTS", 7);
    let storm = env_usize("NVPOLL_DHCHAP_STORM", 128);
    // Hosts without a key connect without authenticating; ours has one, so a second target serves the
    // baseline with no key configured.
    let plain = TestTarget::start(|c| c);
    let t = TestTarget::start(|mut c| {
        c.subsystems[0].dhchap_keys.push(DhchapKey {
            hostnqn: HOSTNQN.into(),
            key: Secret::parse(HOST_KEY).unwrap(),
            ctrl_key: Some(Secret::parse(&ctrl_key()).unwrap()),
            concat: false,
        });
        c
    });
    let base = median_connect_ms(&plain, None, n);
    println!("dhchap: connect time of one controller (admin queue), median of {n}, target on one reactor");
    println!("| hash | DH group | host only ms | bidirectional ms | host only vs none | bidirectional vs none |");
    println!("|---|---|---|---|---|---|");
    println!("| none | none | {base:.2} | | 1.00x | |");
    for hash in Hash::ALL {
        for group in DhGroup::ALL {
            t.handle
                .set_dhchap_policy(
                    NQN,
                    DhchapPolicy {
                        hashes: vec![hash],
                        groups: vec![group],
                    },
                )
                .unwrap();
            let one = median_connect_ms(&t, Some(false), n);
            let two = median_connect_ms(&t, Some(true), n);
            println!(
                "| {hash} | {group} | {one:.2} | {two:.2} | {:.2}x | {:.2}x |",
                one / base,
                two / base
            );
        }
    }

    // The storm.
    t.handle
        .set_dhchap_policy(
            NQN,
            DhchapPolicy {
                hashes: vec![Hash::Sha512],
                groups: vec![DhGroup::Ffdhe8192],
            },
        )
        .unwrap();
    let mut ctrl = TcpController::connect(options(&t, Some(false)), pool()).expect("connect");
    let mut qp = ctrl.connect_io_queue(4).expect("I/O queue");
    let p = pool();
    let mut sample = |secs: f64| -> Vec<f64> {
        let end = Instant::now() + Duration::from_secs_f64(secs);
        let mut lat = Vec::new();
        while Instant::now() < end {
            let t0 = Instant::now();
            let req = IoRequest {
                op: IoOp::Read,
                nsid: 1,
                lba: 0,
                blocks: 8,
                buf: Some(p.alloc(4096).unwrap()),
                tag: 0,
            };
            qp.submit(req).map_err(|r| r.error).expect("submit");
            qp.flush().expect("flush");
            loop {
                qp.poll(8).expect("poll");
                if let Some(c) = qp.pop_completion() {
                    c.result.expect("read");
                    break;
                }
            }
            lat.push(t0.elapsed().as_secs_f64() * 1e6);
        }
        lat.sort_by(|a, b| a.total_cmp(b));
        lat
    };
    let pct = |v: &[f64], q: f64| v[((v.len() as f64 - 1.0) * q) as usize];
    let before = sample(2.0);
    let addr = t.addr;
    let storm_threads: Vec<_> = (0..2)
        .map(|i| {
            let per = storm / 2 + (i < storm % 2) as usize;
            std::thread::spawn(move || {
                let t0 = Instant::now();
                for _ in 0..per {
                    let mut o = ConnectOptions::new(addr, NQN, HOSTNQN);
                    o.timeout = Duration::from_secs(60);
                    let ck = ctrl_key();
                    let o = o.with_dhchap(HOST_KEY, Some(&ck)).unwrap();
                    let c = TcpController::connect(o, pool()).expect("storm connect");
                    drop(c);
                }
                t0.elapsed()
            })
        })
        .collect();
    let mut during = Vec::new();
    while !storm_threads.iter().all(|h| h.is_finished()) {
        during.extend(sample(0.2));
    }
    let storm_time: Vec<Duration> = storm_threads
        .into_iter()
        .map(|h| h.join().expect("storm thread"))
        .collect();
    during.sort_by(|a, b| a.total_cmp(b));
    let after = sample(1.0);
    println!();
    println!(
        "dhchap: {storm} queues authenticating (SHA-512, ffdhe8192, bidirectional) from 2 threads took {:.1} s; \
         meanwhile 4 KiB reads at qd1 on another connection of the same target reactor:",
        storm_time.iter().max().unwrap().as_secs_f64()
    );
    println!("| phase | reads | p50 us | p99 us | max us |");
    println!("|---|---|---|---|---|");
    for (name, v) in [
        ("before", &before),
        ("during the storm", &during),
        ("after", &after),
    ] {
        println!(
            "| {name} | {} | {:.1} | {:.1} | {:.1} |",
            v.len(),
            pct(v, 0.5),
            pct(v, 0.99),
            v[v.len() - 1]
        );
    }
    println!(
        "dhchap: p99 during / before: {:.2}x; authentications counted by the target: {}",
        pct(&during, 0.99) / pct(&before, 0.99),
        t.counters().authentications
    );
    drop(qp);
    let _ = ctrl.shutdown();
}
