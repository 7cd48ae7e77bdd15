//! PDU codec micro-benchmarks: decode of a response capsule and of a 4 KiB C2HData PDU (with and without
//! digests), encode of a command capsule and of a data PDU header.

use std::hint::black_box;

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use nvpoll::spec::{Cqe, Sqe};
use nvpoll_wire::pdu::{
    decode, encode_c2h_data, encode_c2h_data_header, encode_capsule_cmd, encode_capsule_resp,
    C2HDataHdr, DecodeConfig, Decoded, Digests, Direction,
};

const HDGST: Digests = Digests {
    header: true,
    data: false,
};

/// The header of the one 4 KiB C2HData PDU of command 7 (the last, with a CapsuleResp to follow).
const C2H_4K: C2HDataHdr = C2HDataHdr {
    cccid: 7,
    datao: 0,
    datal: 4096,
    last: true,
    success: false,
};

fn decode_len(buf: &[u8], cfg: &DecodeConfig) -> usize {
    match decode(buf, cfg) {
        Ok(Decoded::Pdu { len, .. }) => len,
        other => panic!("{other:?}"),
    }
}

fn bench_decode(c: &mut Criterion) {
    let mut g = c.benchmark_group("decode");
    let cqe = Cqe {
        cid: 7,
        sqhd: 3,
        sqid: 1,
        ..Default::default()
    };
    for (name, digests) in [
        ("capsule_resp", Digests::NONE),
        ("capsule_resp_hdgst", HDGST),
    ] {
        let mut buf = Vec::new();
        encode_capsule_resp(&mut buf, &cqe, digests);
        let cfg = DecodeConfig::new(Direction::ToHost, digests, 1 << 20);
        g.throughput(Throughput::Elements(1));
        g.bench_function(name, |b| b.iter(|| decode_len(black_box(&buf), &cfg)));
    }

    let data = vec![0xa5u8; 4096];
    for (name, digests) in [
        ("c2h_data_4k", Digests::NONE),
        ("c2h_data_4k_hdgst", HDGST),
        (
            "c2h_data_4k_ddgst",
            Digests {
                header: false,
                data: true,
            },
        ),
        ("c2h_data_4k_both", Digests::BOTH),
    ] {
        let mut buf = Vec::new();
        encode_c2h_data(&mut buf, &C2H_4K, &data, digests, 0);
        let cfg = DecodeConfig::new(Direction::ToHost, digests, 1 << 20);
        g.throughput(Throughput::Bytes(buf.len() as u64));
        g.bench_function(name, |b| b.iter(|| decode_len(black_box(&buf), &cfg)));
    }
    g.finish();
}

fn bench_encode(c: &mut Criterion) {
    let mut g = c.benchmark_group("encode");
    g.throughput(Throughput::Elements(1));
    let sqe = Sqe {
        opcode: 0x02,
        cid: 7,
        nsid: 1,
        cdw10: 1234,
        cdw12: 7,
        ..Default::default()
    };
    let mut out = Vec::with_capacity(8192);
    for (name, digests) in [("capsule_cmd", Digests::NONE), ("capsule_cmd_hdgst", HDGST)] {
        g.bench_function(name, |b| {
            b.iter(|| {
                out.clear();
                encode_capsule_cmd(&mut out, black_box(&sqe), &[], digests, 0)
            })
        });
    }
    g.bench_function("c2h_data_header_hdgst", |b| {
        b.iter(|| {
            out.clear();
            encode_c2h_data_header(&mut out, black_box(&C2H_4K), HDGST, 0)
        })
    });
    g.finish();
}

// criterion_group! makes an undocumented `pub fn`: kept in a module of its own, it is not public.
mod group {
    use super::*;
    criterion_group!(benches, bench_decode, bench_encode);
}
criterion_main!(group::benches);
