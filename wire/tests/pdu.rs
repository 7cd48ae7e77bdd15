//! Tests of the NVMe/TCP PDU codec: spec layouts byte by byte, round trips, streaming, malformed input.

use nvpoll::spec::{Cqe, Sqe};
use nvpoll_wire::pdu::*;
use proptest::prelude::*;

const BIG: u32 = 1 << 20;

fn cfg(direction: Direction, digests: Digests) -> DecodeConfig {
    DecodeConfig::new(direction, digests, BIG)
}

fn to_host(digests: Digests) -> DecodeConfig {
    cfg(Direction::ToHost, digests)
}

fn to_ctrl(digests: Digests) -> DecodeConfig {
    cfg(Direction::ToController, digests)
}

/// Decodes a buffer that must hold exactly one whole PDU.
fn decode_one<'a>(buf: &'a [u8], cfg: &DecodeConfig) -> Pdu<'a> {
    match decode(buf, cfg) {
        Ok(Decoded::Pdu { pdu, len }) => {
            assert_eq!(len, buf.len(), "PDU length");
            pdu
        }
        other => panic!("expected a PDU, got {other:?}"),
    }
}

fn crc_le(b: &[u8]) -> [u8; 4] {
    crc32c::crc32c(b).to_le_bytes()
}

fn sample_sqe() -> Sqe {
    Sqe {
        opcode: 0x01,
        flags: Sqe::PSDT_SGL,
        cid: 0x1234,
        nsid: 1,
        dptr1: 0,
        dptr2: 0x0100_0000_0000_1000,
        cdw10: 8,
        cdw12: 7,
        ..Default::default()
    }
}

fn sample_cqe() -> Cqe {
    Cqe {
        dw0: 0xdead_beef,
        dw1: 0,
        sqhd: 5,
        sqid: 1,
        cid: 0x1234,
        status_phase: 0,
    }
}

// ------------------------------------------------------------------------------------------------------------
// Digests

#[test]
fn crc32c_check_value() {
    assert_eq!(crc32c::crc32c(b"123456789"), 0xE306_9283);
    // Linux sends cpu_to_le32(~crc32c(~0, ...)): the standard CRC32C value, little endian.
    assert_eq!(data_digest(b"123456789"), [0x83, 0x92, 0x06, 0xE3]);
    let mut d = DataDigest::new();
    d.update(b"1234");
    d.update(b"");
    d.update(b"56789");
    assert_eq!(d.finish(), [0x83, 0x92, 0x06, 0xE3]);
    let mut v = vec![1u8];
    append_data_digest(&mut v, b"123456789");
    assert_eq!(v, [1, 0x83, 0x92, 0x06, 0xE3]);
}

// ------------------------------------------------------------------------------------------------------------
// Hand-built byte vectors against the spec layout

#[test]
fn icreq_bytes_like_linux() {
    // What the Linux host sends with no digests, hpda 0 and maxr2t 0.
    let mut want = vec![0x00, 0x00, 0x80, 0x00, 0x80, 0x00, 0x00, 0x00];
    want.extend_from_slice(&[0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00]);
    want.resize(128, 0);
    let mut out = Vec::new();
    assert_eq!(encode_ic_req(&mut out, &IcReq::default()), 128);
    assert_eq!(out, want);
    assert_eq!(
        decode_one(&out, &to_ctrl(Digests::NONE)),
        Pdu::IcReq(IcReq::default())
    );

    // Digests requested, hpda 3, maxr2t 0x0f; the decoder ignores the connection's digests for ICReq.
    let ic = IcReq {
        pfv: 0,
        hpda: 3,
        digests: Digests::BOTH,
        maxr2t: 0x0f,
    };
    out.clear();
    encode_ic_req(&mut out, &ic);
    assert_eq!(
        &out[..16],
        &[0, 0, 0x80, 0, 0x80, 0, 0, 0, 0, 0, 3, 0x03, 0x0f, 0, 0, 0]
    );
    assert!(out[16..].iter().all(|&b| b == 0));
    assert_eq!(decode_one(&out, &to_ctrl(Digests::BOTH)), Pdu::IcReq(ic));
}

#[test]
fn icresp_bytes() {
    let ic = IcResp {
        pfv: 0,
        cpda: 0,
        digests: Digests {
            header: true,
            data: false,
        },
        maxh2cdata: 0x2_0000,
    };
    let mut out = Vec::new();
    assert_eq!(encode_ic_resp(&mut out, &ic), 128);
    assert_eq!(
        &out[..16],
        &[0x01, 0, 0x80, 0, 0x80, 0, 0, 0, 0, 0, 0, 0x01, 0x00, 0x00, 0x02, 0x00]
    );
    assert!(out[16..].iter().all(|&b| b == 0));
    assert_eq!(decode_one(&out, &to_host(Digests::NONE)), Pdu::IcResp(ic));
}

#[test]
fn capsule_cmd_bytes() {
    let sqe = sample_sqe();
    let sqe_b = sqe.to_bytes();

    // No digests, no data.
    let mut out = Vec::new();
    assert_eq!(
        encode_capsule_cmd(&mut out, &sqe, &[], Digests::NONE, 0),
        72
    );
    assert_eq!(&out[..8], &[0x04, 0x00, 0x48, 0x00, 0x48, 0x00, 0x00, 0x00]);
    assert_eq!(&out[8..], &sqe_b);
    assert_eq!(
        decode_one(&out, &to_ctrl(Digests::NONE)),
        Pdu::CapsuleCmd { sqe, data: &[] }
    );

    // Both digests negotiated, no data: HDGSTF only, pdo 0, plen 76.
    out.clear();
    encode_capsule_cmd(&mut out, &sqe, &[], Digests::BOTH, 0);
    assert_eq!(&out[..8], &[0x04, 0x01, 0x48, 0x00, 0x4c, 0x00, 0x00, 0x00]);
    assert_eq!(&out[72..], &crc_le(&out[..72]));
    assert_eq!(
        decode_one(&out, &to_ctrl(Digests::BOTH)),
        Pdu::CapsuleCmd { sqe, data: &[] }
    );

    // Both digests, 4 bytes of in-capsule data, cpda 0: pdo 76, plen 84.
    let data = [0xaa, 0xbb, 0xcc, 0xdd];
    out.clear();
    assert_eq!(
        encode_capsule_cmd(&mut out, &sqe, &data, Digests::BOTH, 0),
        84
    );
    assert_eq!(&out[..8], &[0x04, 0x03, 0x48, 0x4c, 0x54, 0x00, 0x00, 0x00]);
    assert_eq!(&out[72..76], &crc_le(&out[..72]));
    assert_eq!(&out[76..80], &data);
    assert_eq!(&out[80..84], &crc_le(&data));
    assert_eq!(
        decode_one(&out, &to_ctrl(Digests::BOTH)),
        Pdu::CapsuleCmd { sqe, data: &data }
    );

    // Header digest, cpda 3 (16-byte alignment): pdo 80 with 4 bytes of padding.
    out.clear();
    encode_capsule_cmd(
        &mut out,
        &sqe,
        &data,
        Digests {
            header: true,
            data: false,
        },
        3,
    );
    assert_eq!(&out[..8], &[0x04, 0x01, 0x48, 0x50, 0x54, 0x00, 0x00, 0x00]);
    assert_eq!(&out[76..80], &[0, 0, 0, 0]);
    assert_eq!(&out[80..], &data);
}

#[test]
fn capsule_resp_bytes() {
    let cqe = sample_cqe();
    let mut out = Vec::new();
    assert_eq!(encode_capsule_resp(&mut out, &cqe, Digests::NONE), 24);
    assert_eq!(&out[..8], &[0x05, 0x00, 0x18, 0x00, 0x18, 0x00, 0x00, 0x00]);
    assert_eq!(&out[8..], &cqe.to_bytes());
    assert_eq!(
        decode_one(&out, &to_host(Digests::NONE)),
        Pdu::CapsuleResp { cqe }
    );

    out.clear();
    assert_eq!(encode_capsule_resp(&mut out, &cqe, Digests::BOTH), 28);
    assert_eq!(&out[..8], &[0x05, 0x01, 0x18, 0x00, 0x1c, 0x00, 0x00, 0x00]);
    assert_eq!(&out[24..], &crc_le(&out[..24]));
    assert_eq!(
        decode_one(&out, &to_host(Digests::BOTH)),
        Pdu::CapsuleResp { cqe }
    );
}

#[test]
fn c2h_data_bytes() {
    let data: Vec<u8> = (0..10).collect();
    let hdr = C2HDataHdr {
        cccid: 0x0102,
        datao: 0x1000,
        datal: 10,
        last: true,
        success: true,
    };
    let mut out = Vec::new();
    assert_eq!(encode_c2h_data(&mut out, &hdr, &data, Digests::NONE, 0), 34);
    #[rustfmt::skip]
    let want_hdr = [
        0x07, 0x0c, 0x18, 0x18, 0x22, 0x00, 0x00, 0x00,
        0x02, 0x01, 0x00, 0x00, 0x00, 0x10, 0x00, 0x00,
        0x0a, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
    ];
    assert_eq!(&out[..24], &want_hdr);
    assert_eq!(&out[24..], &data[..]);
    assert_eq!(
        decode_one(&out, &to_host(Digests::NONE)),
        Pdu::C2HData { hdr, data: &data }
    );

    // Both digests, hpda 31: header digest at 24, padding to 128, data, data digest.
    out.clear();
    assert_eq!(
        encode_c2h_data(&mut out, &hdr, &data, Digests::BOTH, 31),
        128 + 10 + 4
    );
    assert_eq!(&out[..8], &[0x07, 0x0f, 0x18, 0x80, 0x8e, 0x00, 0x00, 0x00]);
    assert_eq!(&out[24..28], &crc_le(&out[..24]));
    assert!(out[28..128].iter().all(|&b| b == 0));
    assert_eq!(&out[128..138], &data[..]);
    assert_eq!(&out[138..], &crc_le(&data));
    assert_eq!(
        decode_one(&out, &to_host(Digests::BOTH)),
        Pdu::C2HData { hdr, data: &data }
    );
}

#[test]
fn h2c_data_bytes() {
    let data = [9u8; 8];
    let hdr = H2CDataHdr {
        cccid: 7,
        ttag: 0x0203,
        datao: 4096,
        datal: 8,
        last: true,
    };
    let mut out = Vec::new();
    encode_h2c_data(&mut out, &hdr, &data, Digests::NONE, 0);
    #[rustfmt::skip]
    let want_hdr = [
        0x06, 0x04, 0x18, 0x18, 0x20, 0x00, 0x00, 0x00,
        0x07, 0x00, 0x03, 0x02, 0x00, 0x10, 0x00, 0x00,
        0x08, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
    ];
    assert_eq!(&out[..24], &want_hdr);
    assert_eq!(
        decode_one(&out, &to_ctrl(Digests::NONE)),
        Pdu::H2CData { hdr, data: &data }
    );
}

#[test]
fn r2t_bytes() {
    let r2t = R2T {
        cccid: 0x0011,
        ttag: 0x2233,
        r2to: 0x4455_6677,
        r2tl: 0x0000_1000,
    };
    let mut out = Vec::new();
    assert_eq!(encode_r2t(&mut out, &r2t, Digests::NONE), 24);
    #[rustfmt::skip]
    let want = [
        0x09, 0x00, 0x18, 0x00, 0x18, 0x00, 0x00, 0x00,
        0x11, 0x00, 0x33, 0x22, 0x77, 0x66, 0x55, 0x44,
        0x00, 0x10, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
    ];
    assert_eq!(out, want);
    assert_eq!(decode_one(&out, &to_host(Digests::NONE)), Pdu::R2T(r2t));
}

#[test]
fn term_req_bytes() {
    let bad_hdr = [0x05u8, 0, 0x19, 0, 0x19, 0, 0, 0];
    let t = TermReq {
        fes: Fes::InvalidHeaderField as u16,
        fei: 2,
        data: &bad_hdr,
    };
    let mut out = Vec::new();
    assert_eq!(encode_c2h_term_req(&mut out, &t), 32);
    #[rustfmt::skip]
    let want_hdr = [
        0x03, 0x00, 0x18, 0x00, 0x20, 0x00, 0x00, 0x00,
        0x01, 0x00, 0x02, 0x00, 0x00, 0x00, 0x00, 0x00,
        0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,
    ];
    assert_eq!(&out[..24], &want_hdr);
    assert_eq!(&out[24..], &bad_hdr);
    // Digests never apply to termination requests.
    let pdu = decode_one(&out, &to_host(Digests::BOTH));
    assert_eq!(pdu, Pdu::C2HTermReq(t));
    let Pdu::C2HTermReq(got) = pdu else {
        unreachable!()
    };
    assert_eq!(got.fes_kind(), Some(Fes::InvalidHeaderField));

    // At most 128 bytes of the offending header are sent.
    let long = [0x55u8; 200];
    out.clear();
    assert_eq!(
        encode_h2c_term_req(
            &mut out,
            &TermReq {
                fes: 3,
                fei: 0,
                data: &long
            }
        ),
        152
    );
    let Pdu::H2CTermReq(got) = decode_one(&out, &to_ctrl(Digests::NONE)) else {
        panic!()
    };
    assert_eq!(got.data, &long[..128]);
    assert_eq!(got.fes_kind(), Some(Fes::HeaderDigestError));

    // A termination request with no data at all (plen 24) is accepted, as Linux does.
    out.clear();
    encode_h2c_term_req(
        &mut out,
        &TermReq {
            fes: 2,
            fei: 0,
            data: &[],
        },
    );
    assert_eq!(out.len(), 24);
    assert_eq!(
        decode_one(&out, &to_ctrl(Digests::NONE)).data(),
        &[] as &[u8]
    );
}

// ------------------------------------------------------------------------------------------------------------
// Round trips

fn all_digests() -> [Digests; 4] {
    [
        Digests::NONE,
        Digests {
            header: true,
            data: false,
        },
        Digests {
            header: false,
            data: true,
        },
        Digests::BOTH,
    ]
}

/// One PDU of every type, with data where the type carries it.
fn samples(data: &[u8]) -> Vec<Pdu<'_>> {
    vec![
        Pdu::IcReq(IcReq {
            pfv: 0,
            hpda: 1,
            digests: Digests::BOTH,
            maxr2t: 3,
        }),
        Pdu::IcResp(IcResp {
            pfv: 0,
            cpda: 31,
            digests: Digests::NONE,
            maxh2cdata: 131_072,
        }),
        Pdu::H2CTermReq(TermReq {
            fes: 1,
            fei: 3,
            data: &data[..data.len().min(128)],
        }),
        Pdu::C2HTermReq(TermReq {
            fes: 6,
            fei: 8,
            data: &data[..data.len().min(20)],
        }),
        Pdu::CapsuleCmd {
            sqe: sample_sqe(),
            data: &[],
        },
        Pdu::CapsuleCmd {
            sqe: sample_sqe(),
            data,
        },
        Pdu::CapsuleResp { cqe: sample_cqe() },
        Pdu::H2CData {
            hdr: H2CDataHdr {
                cccid: 1,
                ttag: 2,
                datao: 3,
                datal: data.len() as u32,
                last: false,
            },
            data,
        },
        Pdu::C2HData {
            hdr: C2HDataHdr {
                cccid: 4,
                datao: 5,
                datal: data.len() as u32,
                last: true,
                success: false,
            },
            data,
        },
        Pdu::R2T(R2T {
            cccid: 6,
            ttag: 7,
            r2to: 8,
            r2tl: 9,
        }),
    ]
}

#[test]
fn round_trip_every_type() {
    let data: Vec<u8> = (0..=255u8).cycle().take(4096 + 3).collect();
    for pdu in samples(&data) {
        for digests in all_digests() {
            for pda in [0, 1, 3, 7, 31] {
                let mut out = vec![0xee; 5]; // encoders append
                let n = encode(&mut out, &pdu, digests, pda);
                assert_eq!(n, out.len() - 5);
                let c = cfg(pdu.pdu_type().direction(), digests);
                let got = decode_one(&out[5..], &c);
                assert_eq!(got, pdu, "{} {digests:?} pda {pda}", pdu.pdu_type());
                // Data starts at an aligned pdo when there is data and the type is padded.
                let pdo = usize::from(out[5 + 3]);
                if pdo != 0 && pdu.pdu_type().has_data_digest() {
                    assert_eq!(pdo % ((usize::from(pda) + 1) * 4), 0);
                    assert!(
                        pdo >= usize::from(pdu.pdu_type().hlen())
                            + if digests.header { 4 } else { 0 }
                    );
                }
            }
        }
    }
}

#[test]
fn header_encoders_match_whole_encoders() {
    let data = vec![0x5a; 1000];
    for digests in all_digests() {
        for pda in [0, 31] {
            // Capsule: header + data + digest written separately, as a sender with iovecs would.
            let sqe = sample_sqe();
            let mut whole = Vec::new();
            encode_capsule_cmd(&mut whole, &sqe, &data, digests, pda);
            let mut parts = Vec::new();
            let n = encode_capsule_cmd_header(&mut parts, &sqe, data.len() as u32, digests, pda);
            assert_eq!(n, parts.len());
            assert_eq!(usize::from(whole[3]), n, "header ends at pdo");
            parts.extend_from_slice(&data);
            if digests.data {
                parts.extend_from_slice(&data_digest(&data));
            }
            assert_eq!(parts, whole);

            let hdr = H2CDataHdr {
                cccid: 1,
                ttag: 2,
                datao: 0,
                datal: 1000,
                last: true,
            };
            whole.clear();
            encode_h2c_data(&mut whole, &hdr, &data, digests, pda);
            parts.clear();
            encode_h2c_data_header(&mut parts, &hdr, digests, pda);
            parts.extend_from_slice(&data);
            if digests.data {
                let mut d = DataDigest::new();
                for chunk in data.chunks(333) {
                    d.update(chunk);
                }
                parts.extend_from_slice(&d.finish());
            }
            assert_eq!(parts, whole);

            let hdr = C2HDataHdr {
                cccid: 1,
                datao: 0,
                datal: 1000,
                last: true,
                success: true,
            };
            whole.clear();
            encode_c2h_data(&mut whole, &hdr, &data, digests, pda);
            parts.clear();
            encode_c2h_data_header(&mut parts, &hdr, digests, pda);
            parts.extend_from_slice(&data);
            if digests.data {
                parts.extend_from_slice(&data_digest(&data));
            }
            assert_eq!(parts, whole);
        }
    }
}

#[test]
fn stream_of_many_pdus() {
    let data: Vec<u8> = (0..3000u32).map(|i| (i * 7) as u8).collect();
    let digests = Digests::BOTH;
    let mut want = Vec::new();
    let mut stream = Vec::new();
    for i in 0..500usize {
        let len = (i * 37) % data.len() + 1;
        let pdu = match i % 3 {
            0 => Pdu::CapsuleResp {
                cqe: Cqe {
                    cid: i as u16,
                    ..sample_cqe()
                },
            },
            1 => Pdu::C2HData {
                hdr: C2HDataHdr {
                    cccid: i as u16,
                    datao: 0,
                    datal: len as u32,
                    last: i % 2 == 0,
                    success: false,
                },
                data: &data[..len],
            },
            _ => Pdu::R2T(R2T {
                cccid: i as u16,
                ttag: 1,
                r2to: 0,
                r2tl: len as u32,
            }),
        };
        encode(&mut stream, &pdu, digests, 3);
        want.push(pdu);
    }
    let c = to_host(digests);
    let mut off = 0;
    let mut got = Vec::new();
    while off < stream.len() {
        match decode(&stream[off..], &c).unwrap() {
            Decoded::Pdu { pdu, len } => {
                got.push(pdu);
                off += len;
            }
            Decoded::Incomplete { need } => panic!("incomplete at {off}, need {need}"),
        }
    }
    assert_eq!(off, stream.len());
    assert_eq!(got, want);
    assert_eq!(
        decode(&stream[off..], &c),
        Ok(Decoded::Incomplete { need: 8 })
    );
}

#[test]
fn split_at_every_byte() {
    let data: Vec<u8> = (0..200u8).collect();
    for pdu in samples(&data) {
        for digests in [Digests::NONE, Digests::BOTH] {
            let mut out = Vec::new();
            encode(&mut out, &pdu, digests, 7);
            let c = cfg(pdu.pdu_type().direction(), digests);
            for k in 0..out.len() {
                let need = if k < 8 { 8 } else { out.len() };
                assert_eq!(
                    decode(&out[..k], &c),
                    Ok(Decoded::Incomplete { need }),
                    "{} at {k}",
                    pdu.pdu_type()
                );
            }
            assert_eq!(
                decode(&out, &c),
                Ok(Decoded::Pdu {
                    pdu,
                    len: out.len()
                })
            );

            // Fed byte by byte into a receive buffer that also holds the start of the next PDU.
            let mut stream = out.clone();
            stream.extend_from_slice(&out[..5]);
            let mut rx = Vec::new();
            let mut done = None;
            for (i, &b) in stream.iter().enumerate() {
                rx.push(b);
                if let Decoded::Pdu { pdu: p, len } = decode(&rx, &c).unwrap() {
                    assert_eq!(p, pdu);
                    done = Some((i, len));
                    break;
                }
            }
            assert_eq!(done, Some((out.len() - 1, out.len())));
        }
    }
}

// ------------------------------------------------------------------------------------------------------------
// Malformed input

fn err(buf: &[u8], cfg: &DecodeConfig) -> PduError {
    match decode(buf, cfg) {
        Err(e) => e,
        Ok(d) => panic!("expected an error, got {d:?}"),
    }
}

/// Asserts the error and its FES/FEI, and that the common header alone (8 bytes) already gives it.
fn check_early(buf: &[u8], cfg: &DecodeConfig, want: PduError, fes: Fes, fei: u32) {
    assert_eq!(err(buf, cfg), want);
    assert_eq!(
        err(&buf[..8], cfg),
        want,
        "rejected from the common header alone"
    );
    assert_eq!(want.fes(), Some(fes));
    assert_eq!(want.fei(), fei);
}

fn resp_bytes(digests: Digests) -> Vec<u8> {
    let mut out = Vec::new();
    encode_capsule_resp(&mut out, &sample_cqe(), digests);
    out
}

fn c2h_bytes(digests: Digests, len: usize, pda: u8) -> Vec<u8> {
    let data = vec![0x42; len];
    let hdr = C2HDataHdr {
        cccid: 9,
        datao: 0,
        datal: len as u32,
        last: true,
        success: false,
    };
    let mut out = Vec::new();
    encode_c2h_data(&mut out, &hdr, &data, digests, pda);
    out
}

fn cmd_bytes(digests: Digests, len: usize) -> Vec<u8> {
    let mut out = Vec::new();
    encode_capsule_cmd(&mut out, &sample_sqe(), &vec![1; len], digests, 0);
    out
}

#[test]
fn unknown_type() {
    let c = to_host(Digests::NONE);
    for t in [0x08u8, 0x0a, 0x10, 0xff] {
        let mut b = resp_bytes(Digests::NONE);
        b[0] = t;
        check_early(
            &b,
            &c,
            PduError::UnknownType { pdu_type: t },
            Fes::InvalidHeaderField,
            0,
        );
    }
}

#[test]
fn wrong_direction() {
    let b = resp_bytes(Digests::NONE);
    let want = PduError::WrongDirection {
        pdu_type: PduType::CapsuleResp,
    };
    check_early(
        &b,
        &to_ctrl(Digests::NONE),
        want,
        Fes::InvalidHeaderField,
        0,
    );
    let b = cmd_bytes(Digests::NONE, 0);
    let want = PduError::WrongDirection {
        pdu_type: PduType::CapsuleCmd,
    };
    check_early(
        &b,
        &to_host(Digests::NONE),
        want,
        Fes::InvalidHeaderField,
        0,
    );
    let mut b = Vec::new();
    encode_ic_req(&mut b, &IcReq::default());
    assert_eq!(
        err(&b, &to_host(Digests::NONE)),
        PduError::WrongDirection {
            pdu_type: PduType::IcReq
        }
    );
}

#[test]
fn bad_hlen() {
    let mut b = resp_bytes(Digests::NONE);
    b[2] = 0x19;
    let want = PduError::BadHlen {
        pdu_type: PduType::CapsuleResp,
        hlen: 0x19,
    };
    check_early(
        &b,
        &to_host(Digests::NONE),
        want,
        Fes::InvalidHeaderField,
        2,
    );
    // A huge hlen (Linux CVE-style) never makes the decoder read past the buffer.
    b[2] = 0xff;
    assert!(matches!(
        err(&b, &to_host(Digests::BOTH)),
        PduError::BadHlen { hlen: 0xff, .. }
    ));
    let mut b = Vec::new();
    encode_ic_req(&mut b, &IcReq::default());
    b[2] = 0x7f;
    assert!(matches!(
        err(&b, &to_ctrl(Digests::NONE)),
        PduError::BadHlen { .. }
    ));
}

#[test]
fn bad_pdo() {
    let c = to_host(Digests::NONE);
    // A response capsule has no data.
    let mut b = resp_bytes(Digests::NONE);
    b[3] = 24;
    let want = PduError::BadPdo {
        pdu_type: PduType::CapsuleResp,
        pdo: 24,
    };
    check_early(&b, &c, want, Fes::InvalidHeaderField, 3);
    // Data inside the header.
    let mut b = c2h_bytes(Digests::NONE, 16, 0);
    b[3] = 20;
    let want = PduError::BadPdo {
        pdu_type: PduType::C2HData,
        pdo: 20,
    };
    check_early(&b, &c, want, Fes::InvalidHeaderField, 3);
    // Data inside the header digest.
    let mut b = c2h_bytes(
        Digests {
            header: true,
            data: false,
        },
        16,
        0,
    );
    b[3] = 26;
    let c2 = to_host(Digests {
        header: true,
        data: false,
    });
    assert_eq!(
        err(&b, &c2),
        PduError::BadPdo {
            pdu_type: PduType::C2HData,
            pdo: 26
        }
    );
    // Data offset at or past the end of the PDU.
    let mut b = c2h_bytes(Digests::NONE, 16, 0);
    b[3] = 40;
    assert_eq!(
        err(&b, &c),
        PduError::BadPdo {
            pdu_type: PduType::C2HData,
            pdo: 40
        }
    );
    // A capsule without data must have pdo 0.
    let mut b = cmd_bytes(Digests::NONE, 0);
    b[3] = 72;
    let want = PduError::BadPdo {
        pdu_type: PduType::CapsuleCmd,
        pdo: 72,
    };
    check_early(
        &b,
        &to_ctrl(Digests::NONE),
        want,
        Fes::InvalidHeaderField,
        3,
    );
    // ICReq has no data.
    let mut b = Vec::new();
    encode_ic_req(&mut b, &IcReq::default());
    b[3] = 8;
    assert!(matches!(
        err(&b, &to_ctrl(Digests::NONE)),
        PduError::BadPdo { pdo: 8, .. }
    ));
    // Padding beyond the minimum is accepted and skipped.
    let mut b = c2h_bytes(Digests::NONE, 16, 0);
    b.splice(24..24, [0xcc; 8]);
    b[3] = 32;
    b[4] = 48;
    let Pdu::C2HData { data, .. } = decode_one(&b, &c) else {
        panic!()
    };
    assert_eq!(data, &[0x42; 16]);
}

#[test]
fn bad_plen() {
    let c = to_host(Digests::NONE);
    // Smaller than the header.
    let mut b = c2h_bytes(Digests::NONE, 16, 0);
    b[4] = 20;
    check_early(
        &b,
        &c,
        PduError::BadPlen {
            pdu_type: PduType::C2HData,
            plen: 20,
        },
        Fes::InvalidHeaderField,
        4,
    );
    // A data PDU without data.
    b[4] = 24;
    assert_eq!(
        err(&b, &c),
        PduError::BadPlen {
            pdu_type: PduType::C2HData,
            plen: 24
        }
    );
    // A response capsule with room for a header digest that was not negotiated.
    let mut b = resp_bytes(Digests::NONE);
    b[4] = 28;
    check_early(
        &b,
        &c,
        PduError::BadPlen {
            pdu_type: PduType::CapsuleResp,
            plen: 28,
        },
        Fes::InvalidHeaderField,
        4,
    );
    // A response capsule with a huge plen is rejected before waiting for 4 GiB.
    b[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
    assert_eq!(
        err(&b[..8], &c),
        PduError::BadPlen {
            pdu_type: PduType::CapsuleResp,
            plen: u32::MAX
        }
    );
    // ICResp is 128 bytes exactly.
    let mut b = Vec::new();
    encode_ic_resp(
        &mut b,
        &IcResp {
            maxh2cdata: 8192,
            ..Default::default()
        },
    );
    b[4] = 129;
    assert_eq!(
        err(&b[..8], &c),
        PduError::BadPlen {
            pdu_type: PduType::IcResp,
            plen: 129
        }
    );
    // Termination requests carry at most 128 bytes.
    let mut b = Vec::new();
    encode_c2h_term_req(
        &mut b,
        &TermReq {
            fes: 1,
            fei: 0,
            data: &[0; 128],
        },
    );
    b[4] = 153;
    assert_eq!(
        err(&b[..8], &c),
        PduError::BadPlen {
            pdu_type: PduType::C2HTermReq,
            plen: 153
        }
    );
    b[4] = 23;
    assert_eq!(
        err(&b[..8], &c),
        PduError::BadPlen {
            pdu_type: PduType::C2HTermReq,
            plen: 23
        }
    );
}

#[test]
fn data_too_long() {
    let c = DecodeConfig::new(Direction::ToHost, Digests::BOTH, 4096);
    let ok = c2h_bytes(Digests::BOTH, 4096, 0);
    assert!(matches!(decode(&ok, &c), Ok(Decoded::Pdu { .. })));
    let b = c2h_bytes(Digests::BOTH, 4097, 0);
    let want = PduError::DataTooLong {
        pdu_type: PduType::C2HData,
        len: 4097,
        max: 4096,
    };
    check_early(&b, &c, want, Fes::DataLimitExceeded, 0);
    // A bogus plen on a data PDU is caught by the limit from the first 8 bytes.
    let mut b = c2h_bytes(Digests::BOTH, 16, 0);
    b[4..8].copy_from_slice(&0xffff_fff0u32.to_le_bytes());
    assert!(matches!(err(&b[..8], &c), PduError::DataTooLong { .. }));
    // In-capsule data too.
    let c = DecodeConfig::new(Direction::ToController, Digests::NONE, 8192);
    let b = cmd_bytes(Digests::NONE, 8193);
    assert!(matches!(
        err(&b[..8], &c),
        PduError::DataTooLong {
            pdu_type: PduType::CapsuleCmd,
            ..
        }
    ));
}

#[test]
fn digest_flags_must_match() {
    let hd = Digests {
        header: true,
        data: false,
    };
    let dd = Digests {
        header: false,
        data: true,
    };
    // Header digest negotiated but HDGSTF clear, and the other way round.
    let b = resp_bytes(Digests::NONE);
    let want = PduError::DigestFlags {
        pdu_type: PduType::CapsuleResp,
        flags: 0,
    };
    check_early(&b, &to_host(hd), want, Fes::InvalidHeaderField, 1);
    let b = resp_bytes(hd);
    let want = PduError::DigestFlags {
        pdu_type: PduType::CapsuleResp,
        flags: FLAG_HDGST,
    };
    check_early(
        &b,
        &to_host(Digests::NONE),
        want,
        Fes::InvalidHeaderField,
        1,
    );
    // Data digest negotiated but DDGSTF clear on a PDU with data, and the other way round.
    let b = c2h_bytes(Digests::NONE, 16, 0);
    assert!(matches!(
        err(&b[..8], &to_host(dd)),
        PduError::DigestFlags { .. }
    ));
    let b = c2h_bytes(dd, 16, 0);
    assert!(matches!(
        err(&b[..8], &to_host(Digests::NONE)),
        PduError::DigestFlags { .. }
    ));
    // DDGSTF on a capsule without data.
    let mut b = cmd_bytes(Digests::NONE, 0);
    b[1] |= FLAG_DDGST;
    assert!(matches!(
        err(&b[..8], &to_ctrl(dd)),
        PduError::DigestFlags { .. }
    ));
    // DDGSTF on a PDU that never carries data.
    let mut b = resp_bytes(Digests::NONE);
    b[1] |= FLAG_DDGST;
    assert!(matches!(
        err(&b[..8], &to_host(dd)),
        PduError::BadFlags { .. }
    ));
}

#[test]
fn bad_flags() {
    // SUCCESS without LAST_PDU.
    let mut b = c2h_bytes(Digests::NONE, 16, 0);
    b[1] = FLAG_SUCCESS;
    let want = PduError::BadFlags {
        pdu_type: PduType::C2HData,
        flags: FLAG_SUCCESS,
    };
    check_early(
        &b,
        &to_host(Digests::NONE),
        want,
        Fes::InvalidHeaderField,
        1,
    );
    // LAST_PDU on a capsule, SUCCESS on H2CData, reserved bits.
    let mut b = cmd_bytes(Digests::NONE, 0);
    b[1] = FLAG_LAST_PDU;
    assert!(matches!(
        err(&b[..8], &to_ctrl(Digests::NONE)),
        PduError::BadFlags { .. }
    ));
    let mut b = Vec::new();
    let hdr = H2CDataHdr {
        cccid: 1,
        ttag: 1,
        datao: 0,
        datal: 4,
        last: true,
    };
    encode_h2c_data(&mut b, &hdr, &[1, 2, 3, 4], Digests::NONE, 0);
    b[1] |= FLAG_SUCCESS;
    assert!(matches!(
        err(&b[..8], &to_ctrl(Digests::NONE)),
        PduError::BadFlags { .. }
    ));
    let mut b = c2h_bytes(Digests::NONE, 16, 0);
    b[1] |= 0x10;
    assert!(matches!(
        err(&b[..8], &to_host(Digests::NONE)),
        PduError::BadFlags { .. }
    ));
    // No flags at all on ICReq and termination requests.
    let mut b = Vec::new();
    encode_ic_req(&mut b, &IcReq::default());
    b[1] = FLAG_HDGST;
    assert!(matches!(
        err(&b[..8], &to_ctrl(Digests::BOTH)),
        PduError::BadFlags { .. }
    ));
    let mut b = Vec::new();
    encode_c2h_term_req(
        &mut b,
        &TermReq {
            fes: 1,
            fei: 0,
            data: &[],
        },
    );
    b[1] = FLAG_HDGST;
    assert!(matches!(
        err(&b[..8], &to_host(Digests::BOTH)),
        PduError::BadFlags { .. }
    ));
}

#[test]
fn header_digest_mismatch() {
    let c = to_host(Digests::BOTH);
    let mut b = c2h_bytes(Digests::BOTH, 1000, 0);
    b[8] ^= 1; // cccid
    let e = err(&b[..28], &c); // caught before the data arrives
    assert!(
        matches!(
            e,
            PduError::HeaderDigest {
                pdu_type: PduType::C2HData,
                ..
            }
        ),
        "{e:?}"
    );
    assert_eq!(err(&b, &c), e);
    assert_eq!(e.fes(), Some(Fes::HeaderDigestError));
    assert_eq!(e.fei(), 0);
    // A corrupt digest itself.
    let mut b = resp_bytes(Digests::BOTH);
    b[27] ^= 0x80;
    let PduError::HeaderDigest {
        expected, received, ..
    } = err(&b, &c)
    else {
        panic!()
    };
    assert_eq!(expected ^ received, 0x8000_0000);
    // The header stage is not reached before the header is complete.
    assert_eq!(decode(&b[..27], &c), Ok(Decoded::Incomplete { need: 28 }));
}

#[test]
fn data_digest_mismatch_is_not_fatal() {
    let c = to_host(Digests::BOTH);
    let mut b = c2h_bytes(Digests::BOTH, 100, 3);
    let plen = b.len();
    b[40] ^= 0xff;
    // Incomplete until the last byte, then the error.
    assert_eq!(
        decode(&b[..plen - 1], &c),
        Ok(Decoded::Incomplete { need: plen })
    );
    let e = err(&b, &c);
    let PduError::DataDigest {
        pdu_type,
        cccid,
        flags,
        len,
        ..
    } = e
    else {
        panic!("{e:?}")
    };
    assert_eq!((pdu_type, cccid, len), (PduType::C2HData, 9, plen));
    assert_eq!(flags, FLAG_HDGST | FLAG_DDGST | FLAG_LAST_PDU);
    assert_eq!(e.fes(), None);
    assert_eq!(e.skip_len(), Some(plen));
    assert_eq!(e.term_req(&b), None);
    // After skipping, the stream goes on.
    let mut stream = b.clone();
    stream.extend_from_slice(&resp_bytes(Digests::BOTH));
    let skip = err(&stream, &c).skip_len().unwrap();
    assert_eq!(
        decode_one(&stream[skip..], &c),
        Pdu::CapsuleResp { cqe: sample_cqe() }
    );
    // In-capsule data, on the target side, reports the command's CID.
    let mut b = cmd_bytes(Digests::BOTH, 64);
    let n = b.len();
    b[n - 1] ^= 1;
    assert!(matches!(
        err(&b, &to_ctrl(Digests::BOTH)),
        PduError::DataDigest { cccid: 0x1234, .. }
    ));
}

#[test]
fn datal_inconsistent_with_plen() {
    let c = to_host(Digests::NONE);
    let mut b = c2h_bytes(Digests::NONE, 16, 0);
    b[16] = 15;
    let e = err(&b[..24], &c); // caught as soon as the header is complete
    assert_eq!(
        e,
        PduError::DataLength {
            pdu_type: PduType::C2HData,
            datal: 15,
            data_len: 16
        }
    );
    assert_eq!((e.fes(), e.fei()), (Some(Fes::InvalidHeaderField), 16));
    let mut b = Vec::new();
    let hdr = H2CDataHdr {
        cccid: 1,
        ttag: 1,
        datao: 0,
        datal: 4,
        last: true,
    };
    encode_h2c_data(&mut b, &hdr, &[1, 2, 3, 4], Digests::BOTH, 0);
    b[16] = 0; // datal 0
    let d = b[16..20].to_vec();
    assert_eq!(d, [0, 0, 0, 0]);
    let n = 24;
    let crc = crc_le(&b[..n]);
    b[n..n + 4].copy_from_slice(&crc);
    assert!(matches!(
        err(&b, &to_ctrl(Digests::BOTH)),
        PduError::DataLength {
            datal: 0,
            data_len: 4,
            ..
        }
    ));
}

#[test]
fn icresp_invalid_fields() {
    let c = to_host(Digests::NONE);
    let build = |f: &dyn Fn(&mut Vec<u8>)| {
        let mut b = Vec::new();
        encode_ic_resp(
            &mut b,
            &IcResp {
                maxh2cdata: 8192,
                ..Default::default()
            },
        );
        f(&mut b);
        b
    };
    for (maxh2cdata, ok) in [
        (4096u32, true),
        (4095, false),
        (4098, false),
        (0, false),
        (4100, true),
        (1 << 30, true),
    ] {
        let b = build(&|b| b[12..16].copy_from_slice(&maxh2cdata.to_le_bytes()));
        match decode(&b, &c) {
            Ok(Decoded::Pdu { .. }) => assert!(ok, "{maxh2cdata}"),
            Err(e) => {
                assert!(!ok, "{maxh2cdata}");
                assert_eq!(
                    e,
                    PduError::InvalidField {
                        pdu_type: PduType::IcResp,
                        offset: 12,
                        value: maxh2cdata
                    }
                );
                assert_eq!((e.fes(), e.fei()), (Some(Fes::InvalidHeaderField), 12));
            }
            other => panic!("{other:?}"),
        }
    }
    let e = err(&build(&|b| b[8] = 1), &c);
    assert_eq!(
        e,
        PduError::Unsupported {
            pdu_type: PduType::IcResp,
            offset: 8,
            value: 1
        }
    );
    assert_eq!((e.fes(), e.fei()), (Some(Fes::UnsupportedParameter), 8));
    let e = err(&build(&|b| b[10] = 32), &c);
    assert_eq!(
        e,
        PduError::InvalidField {
            pdu_type: PduType::IcResp,
            offset: 10,
            value: 32
        }
    );
    let e = err(&build(&|b| b[11] = 0x04), &c);
    assert_eq!(
        e,
        PduError::InvalidField {
            pdu_type: PduType::IcResp,
            offset: 11,
            value: 4
        }
    );
    // ICReq: pfv and hpda.
    let mut b = Vec::new();
    encode_ic_req(&mut b, &IcReq::default());
    b[9] = 1;
    assert_eq!(
        err(&b, &to_ctrl(Digests::NONE)),
        PduError::Unsupported {
            pdu_type: PduType::IcReq,
            offset: 8,
            value: 0x100
        }
    );
    b[9] = 0;
    b[10] = 0xff;
    assert!(matches!(
        err(&b, &to_ctrl(Digests::NONE)),
        PduError::InvalidField { offset: 10, .. }
    ));
}

#[test]
fn r2t_zero_length() {
    let mut b = Vec::new();
    encode_r2t(
        &mut b,
        &R2T {
            cccid: 1,
            ttag: 2,
            r2to: 0,
            r2tl: 0,
        },
        Digests::NONE,
    );
    let e = err(&b, &to_host(Digests::NONE));
    assert_eq!(
        e,
        PduError::InvalidField {
            pdu_type: PduType::R2T,
            offset: 16,
            value: 0
        }
    );
    assert_eq!(e.fei(), 16);
}

#[test]
fn term_req_for_an_error() {
    let mut b = resp_bytes(Digests::NONE);
    b[2] = 0x19;
    let e = err(&b, &to_host(Digests::NONE));
    let t = e.term_req(&b).unwrap();
    assert_eq!((t.fes, t.fei), (Fes::InvalidHeaderField as u16, 2));
    assert_eq!(
        t.data,
        &b[..24],
        "the offending header, as far as hlen says and the buffer holds"
    );
    let mut out = Vec::new();
    encode_h2c_term_req(&mut out, &t);
    assert_eq!(
        decode_one(&out, &to_ctrl(Digests::NONE)),
        Pdu::H2CTermReq(t)
    );
    // Only 8 bytes received: those are sent.
    assert_eq!(e.term_req(&b[..8]).unwrap().data.len(), 8);
    // Never more than 128 bytes.
    let mut b = c2h_bytes(Digests::NONE, 300, 0);
    b[2] = 200;
    let e = err(&b, &to_host(Digests::NONE));
    assert_eq!(e.term_req(&b).unwrap().data.len(), 128);
}

#[test]
fn errors_display() {
    let e = PduError::BadHlen {
        pdu_type: PduType::CapsuleResp,
        hlen: 25,
    };
    assert_eq!(e.to_string(), "CapsuleResp: hlen 25 (must be 24)");
    let e = PduError::UnknownType { pdu_type: 8 };
    assert_eq!(e.to_string(), "unknown PDU type 0x08");
}

// ------------------------------------------------------------------------------------------------------------
// Properties

/// An owned PDU, for generating arbitrary valid ones.
#[derive(Clone, Debug)]
enum Owned {
    IcReq(IcReq),
    IcResp(IcResp),
    Term(bool, u16, u32, Vec<u8>),
    Cmd(Sqe, Vec<u8>),
    Resp(Cqe),
    H2C(u16, u16, u32, bool, Vec<u8>),
    C2H(u16, u32, bool, bool, Vec<u8>),
    R2T(R2T),
}

impl Owned {
    fn pdu(&self) -> Pdu<'_> {
        match self {
            Owned::IcReq(x) => Pdu::IcReq(*x),
            Owned::IcResp(x) => Pdu::IcResp(*x),
            Owned::Term(h2c, fes, fei, data) => {
                let t = TermReq {
                    fes: *fes,
                    fei: *fei,
                    data,
                };
                if *h2c {
                    Pdu::H2CTermReq(t)
                } else {
                    Pdu::C2HTermReq(t)
                }
            }
            Owned::Cmd(sqe, data) => Pdu::CapsuleCmd { sqe: *sqe, data },
            Owned::Resp(cqe) => Pdu::CapsuleResp { cqe: *cqe },
            Owned::H2C(cccid, ttag, datao, last, data) => Pdu::H2CData {
                hdr: H2CDataHdr {
                    cccid: *cccid,
                    ttag: *ttag,
                    datao: *datao,
                    datal: data.len() as u32,
                    last: *last,
                },
                data,
            },
            Owned::C2H(cccid, datao, last, success, data) => Pdu::C2HData {
                hdr: C2HDataHdr {
                    cccid: *cccid,
                    datao: *datao,
                    datal: data.len() as u32,
                    last: *last || *success,
                    success: *success,
                },
                data,
            },
            Owned::R2T(x) => Pdu::R2T(*x),
        }
    }
}

fn digests_strategy() -> impl Strategy<Value = Digests> {
    (any::<bool>(), any::<bool>()).prop_map(|(header, data)| Digests { header, data })
}

fn owned_strategy() -> impl Strategy<Value = Owned> {
    let data = || prop::collection::vec(any::<u8>(), 1..700);
    prop_oneof![
        (0..=MAX_PDA, digests_strategy(), any::<u32>()).prop_map(|(hpda, digests, maxr2t)| {
            Owned::IcReq(IcReq {
                pfv: 0,
                hpda,
                digests,
                maxr2t,
            })
        }),
        (0..=MAX_PDA, digests_strategy(), 1024u32..=u32::MAX / 4).prop_map(|(cpda, digests, m)| {
            Owned::IcResp(IcResp {
                pfv: 0,
                cpda,
                digests,
                maxh2cdata: m * 4,
            })
        }),
        (
            any::<bool>(),
            any::<u16>(),
            any::<u32>(),
            prop::collection::vec(any::<u8>(), 0..=128)
        )
            .prop_map(|(h, fes, fei, d)| Owned::Term(h, fes, fei, d)),
        (
            prop::collection::vec(any::<u8>(), 64),
            prop::collection::vec(any::<u8>(), 0..700)
        )
            .prop_map(|(s, d)| Owned::Cmd(Sqe::from_bytes(&s).unwrap(), d)),
        prop::collection::vec(any::<u8>(), 16)
            .prop_map(|c| Owned::Resp(Cqe::from_bytes(&c).unwrap())),
        (
            any::<u16>(),
            any::<u16>(),
            any::<u32>(),
            any::<bool>(),
            data()
        )
            .prop_map(|(a, b, c, d, e)| Owned::H2C(a, b, c, d, e)),
        (
            any::<u16>(),
            any::<u32>(),
            any::<bool>(),
            any::<bool>(),
            data()
        )
            .prop_map(|(a, b, c, d, e)| Owned::C2H(a, b, c, d, e)),
        (any::<u16>(), any::<u16>(), any::<u32>(), 1..=u32::MAX).prop_map(
            |(cccid, ttag, r2to, r2tl)| Owned::R2T(R2T {
                cccid,
                ttag,
                r2to,
                r2tl
            })
        ),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(2000))]

    #[test]
    fn arbitrary_bytes_never_panic(
        buf in prop::collection::vec(any::<u8>(), 0..400),
        to_host in any::<bool>(),
        digests in digests_strategy(),
        max_data in prop_oneof![Just(0u32), Just(4096u32), Just(u32::MAX)],
        ty in prop::option::of(prop_oneof![0u8..=7, Just(9u8)]),
    ) {
        let mut buf = buf;
        // Often start with a valid type so the decoder gets past the first check.
        if let (Some(t), Some(b)) = (ty, buf.first_mut()) {
            *b = t;
        }
        let dir = if to_host { Direction::ToHost } else { Direction::ToController };
        let c = DecodeConfig::new(dir, digests, max_data);
        match decode(&buf, &c) {
            Ok(Decoded::Pdu { len, .. }) => prop_assert!(len <= buf.len() && len >= 8),
            Ok(Decoded::Incomplete { need }) => prop_assert!(need > buf.len()),
            Err(e) => {
                let _ = (e.fes(), e.fei(), e.to_string());
                if let Some(t) = e.term_req(&buf) {
                    prop_assert!(t.data.len() <= MAX_TERM_DATA);
                }
            }
        }
    }

    #[test]
    fn valid_pdus_round_trip(
        owned in owned_strategy(),
        digests in digests_strategy(),
        pda in 0..=MAX_PDA,
        tail in prop::collection::vec(any::<u8>(), 0..40),
    ) {
        let pdu = owned.pdu();
        let mut out = Vec::new();
        let n = encode(&mut out, &pdu, digests, pda);
        prop_assert_eq!(n, out.len());
        let c = DecodeConfig::new(pdu.pdu_type().direction(), digests, 700);
        out.extend_from_slice(&tail); // whatever follows does not matter
        prop_assert_eq!(decode(&out, &c), Ok(Decoded::Pdu { pdu, len: n }));
        for k in [0, 1, 7, 8, n / 2, n - 1] {
            let need = if k < 8 { 8 } else { n };
            prop_assert_eq!(decode(&out[..k], &c), Ok(Decoded::Incomplete { need }));
        }
    }

    #[test]
    fn corrupted_pdus_never_panic(
        owned in owned_strategy(),
        digests in digests_strategy(),
        pda in 0..=MAX_PDA,
        flips in prop::collection::vec((any::<prop::sample::Index>(), 1..=255u8), 1..4),
    ) {
        let pdu = owned.pdu();
        let mut out = Vec::new();
        encode(&mut out, &pdu, digests, pda);
        let n = out.len();
        for (i, x) in &flips {
            out[i.index(n)] ^= x;
        }
        let c = DecodeConfig::new(pdu.pdu_type().direction(), digests, 700);
        match decode(&out, &c) {
            Ok(Decoded::Pdu { len, .. }) => prop_assert!(len <= n),
            Ok(Decoded::Incomplete { need }) => prop_assert!(need > n),
            Err(_) => {}
        }
        // With header digests, a changed header (same type) never decodes as a PDU.
        let mut orig = Vec::new();
        encode(&mut orig, &pdu, digests, pda);
        let hlen = usize::from(pdu.pdu_type().hlen());
        if digests.header && pdu.pdu_type().has_header_digest() && out[0] == orig[0] && out[..hlen] != orig[..hlen] {
            let decoded = matches!(decode(&out, &c), Ok(Decoded::Pdu { .. }));
            prop_assert!(!decoded, "corrupt header accepted");
        }
    }
}
