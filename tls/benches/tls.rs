//! TLS record throughput: seal + open of one 4 KiB or 16 KiB record through `Session`, against the limit,
//! a raw AES-128-GCM seal-in-place + open-in-place of the same size with aws-lc-rs. Two forms of ours:
//! `seal`/`open` on Vecs (which zero-fill the room they grow: safe Rust cannot hand uninitialized memory
//! to the AEAD) and `seal_to_slice`/`open_to_slice` on reused buffers (no fill). After criterion's report,
//! prints the ratios (raw time / ours) measured in a short timing loop.
//!
//! `cargo bench -p nvpoll-tcp --bench tls`

use std::hint::black_box;
use std::time::{Duration, Instant};

use aws_lc_rs::aead::{Aad, LessSafeKey, Nonce, UnboundKey, AES_128_GCM};
use criterion::{Criterion, Throughput};
use nvpoll_tls::{ClientConfig, Handshake, HashAlg, Psk, ServerConfig, Session};

const SIZES: [usize; 2] = [4096, 16384];

/// A client and a server session over an in-memory handshake (TLS_AES_128_GCM_SHA256).
fn sessions() -> (Session, Session) {
    let psk = Psk::new(&[0x42; 32], HashAlg::Sha256);
    let id = "NVMe0R01 nqn.bench-host nqn.bench-subsys";
    let (mut c, mut to_s) = Handshake::client(ClientConfig::new(id, psk.clone())).unwrap();
    let mut s = Handshake::server(ServerConfig::with_psk(id, psk));
    let mut to_c = Vec::new();
    while !(c.is_done() && s.is_done()) {
        let p = s.read(&to_s, &mut to_c).unwrap();
        to_s.drain(..p.consumed);
        let p = c.read(&to_c, &mut to_s).unwrap();
        to_c.drain(..p.consumed);
    }
    (c.into_session().unwrap(), s.into_session().unwrap())
}

/// Our record layer: seal one record from the caller's buffer, open it into a reassembly buffer.
struct Ours {
    tx: Session,
    rx: Session,
    data: Vec<u8>,
    wire: Vec<u8>,
    plain: Vec<u8>,
}

impl Ours {
    fn new(size: usize) -> Ours {
        let (tx, rx) = sessions();
        Ours {
            tx,
            rx,
            data: vec![0xa5; size],
            wire: Vec::with_capacity(size + 64),
            plain: Vec::with_capacity(size + 64),
        }
    }

    /// `seal` into a Vec, `open` into a Vec.
    fn round_vec(&mut self) {
        self.wire.clear();
        self.tx.seal(&[&self.data], &mut self.wire).unwrap();
        self.plain.clear();
        let n = self.rx.open(&self.wire, &mut self.plain).unwrap();
        debug_assert_eq!(n, self.wire.len());
        black_box(&self.plain);
    }

    /// `seal_to_slice` into a reused send buffer, `open_to_slice` into a reused receive buffer.
    fn round_slice(&mut self) {
        self.wire.resize(Session::sealed_len(self.data.len()), 0);
        self.plain.resize(self.data.len() + 64, 0);
        let (_, n) = self
            .tx
            .seal_to_slice(&[&self.data], &mut self.wire)
            .unwrap();
        let (c, w) = self
            .rx
            .open_to_slice(&self.wire[..n], &mut self.plain)
            .unwrap();
        debug_assert_eq!((c, w), (n, self.data.len()));
        black_box(&self.plain[..w]);
    }
}

/// The limit: AES-128-GCM seal in place and open in place of one buffer, nonce from a counter.
struct Raw {
    key: LessSafeKey,
    buf: Vec<u8>,
    seq: u64,
}

impl Raw {
    fn new(size: usize) -> Raw {
        Raw {
            key: LessSafeKey::new(UnboundKey::new(&AES_128_GCM, &[0x42; 16]).unwrap()),
            buf: vec![0xa5; size + 16],
            seq: 0,
        }
    }

    fn nonce(&self) -> Nonce {
        let mut n = [0u8; 12];
        n[4..].copy_from_slice(&self.seq.to_be_bytes());
        Nonce::assume_unique_for_key(n)
    }

    fn round(&mut self) {
        let size = self.buf.len() - 16;
        let hdr = [23, 3, 3, (size >> 8) as u8, size as u8];
        let tag = self
            .key
            .seal_in_place_separate_tag(self.nonce(), Aad::from(hdr), &mut self.buf[..size])
            .unwrap();
        self.buf[size..].copy_from_slice(tag.as_ref());
        let plain = self
            .key
            .open_in_place(self.nonce(), Aad::from(hdr), &mut self.buf)
            .unwrap();
        black_box(plain);
        self.seq += 1;
    }
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("tls_record_seal_open");
    for size in SIZES {
        g.throughput(Throughput::Bytes(size as u64));
        let mut raw = Raw::new(size);
        g.bench_function(format!("raw_aes128gcm/{size}"), |b| b.iter(|| raw.round()));
        let mut ours = Ours::new(size);
        g.bench_function(format!("session_vec/{size}"), |b| {
            b.iter(|| ours.round_vec())
        });
        g.bench_function(format!("session_slice/{size}"), |b| {
            b.iter(|| ours.round_slice())
        });
    }
    g.finish();
}

/// Best-of-5 time per round, each pass about `pass` long.
fn time_per_round(mut round: impl FnMut(), pass: Duration) -> f64 {
    let mut best = f64::MAX;
    for _ in 0..5 {
        let start = Instant::now();
        let mut n = 0u64;
        while start.elapsed() < pass {
            for _ in 0..64 {
                round();
            }
            n += 64;
        }
        best = best.min(start.elapsed().as_secs_f64() / n as f64);
    }
    best
}

fn main() {
    let mut c = Criterion::default().configure_from_args();
    bench(&mut c);
    c.final_summary();
    // `cargo test --benches` runs this with --test (or --bench absent): keep that quick.
    let quick =
        std::env::args().any(|a| a == "--test") || !std::env::args().any(|a| a == "--bench");
    let pass = if quick {
        Duration::from_millis(5)
    } else {
        Duration::from_millis(200)
    };
    for size in SIZES {
        let mut raw = Raw::new(size);
        let mut ours = Ours::new(size);
        // Interleaved passes, so that a noisy neighbour hits all three alike.
        let (mut t_raw, mut t_vec, mut t_slice) = (f64::MAX, f64::MAX, f64::MAX);
        for _ in 0..3 {
            t_raw = t_raw.min(time_per_round(|| raw.round(), pass));
            t_vec = t_vec.min(time_per_round(|| ours.round_vec(), pass));
            t_slice = t_slice.min(time_per_round(|| ours.round_slice(), pass));
        }
        let gbps = |t: f64| size as f64 / t / 1e9;
        println!(
            "tls record {size:>5} B: raw AES-128-GCM {:.2} GB/s ({:.0} ns) | Session seal/open {:.2} GB/s ({:.0} ns), ratio {:.3} | seal_to_slice/open_to_slice {:.2} GB/s ({:.0} ns), ratio {:.3}",
            gbps(t_raw),
            t_raw * 1e9,
            gbps(t_vec),
            t_vec * 1e9,
            t_raw / t_vec,
            gbps(t_slice),
            t_slice * 1e9,
            t_raw / t_slice,
        );
    }
}
