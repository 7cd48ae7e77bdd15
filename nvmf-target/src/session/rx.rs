//! Receiving: decoding the PDUs in the receive buffer and routing them by kind; H2CData and data digest
//! errors, and a command whose data all arrived.

use std::ops::Range;

use nvpoll::spec::{fabrics, Sqe, Status};

use crate::handler::Reply;
use crate::io;
use nvpoll_wire::pdu::{self, Decoded, Fes, Pdu, PduError};

use super::capsule::Data;
use super::setup::SetupPhase;
use super::slots::{Sink, SlotState};
use super::{Fatal, Session, TX_HIGH_WATER};

/// A PDU with its data as a range of the receive buffer, so that the buffer is free to borrow again.
enum Rx {
    IcReq(pdu::IcReq),
    TermReq {
        fes: u16,
        fei: u32,
    },
    Capsule {
        sqe: Sqe,
        data: Range<usize>,
    },
    H2CData {
        hdr: pdu::H2CDataHdr,
        data: Range<usize>,
    },
}

impl Session {
    /// Decodes and handles the whole PDUs in the receive buffer, until the send buffer passes its high-water
    /// mark (the rest waits for the host to read its responses).
    pub(super) fn handle_received(&mut self) -> Result<(), Fatal> {
        loop {
            if self.conn.tx_pending() > TX_HIGH_WATER {
                // Responses pile up unsent: leave the rest for when the host has read them. (Once per
                // episode: the poll reads nothing more until the host has drained them.)
                self.stats.held_back += 1;
                return Ok(());
            }
            let rx = self.conn.rx_data();
            let (pdu, len) = match pdu::decode(rx, &self.decode) {
                Ok(Decoded::Incomplete { need }) => {
                    if need > rx.len() {
                        self.conn.reserve_rx(need);
                    }
                    self.conn.ack_partial(need);
                    return Ok(());
                }
                Ok(Decoded::Pdu { pdu, len }) => (to_rx(rx, pdu)?, len),
                Err(e) => match e.skip_len() {
                    Some(len) => {
                        self.on_data_digest_error(&e)?;
                        self.conn.consume(len);
                        continue;
                    }
                    None => {
                        let fes = e.fes().unwrap_or(Fes::InvalidHeaderField);
                        return Err(Fatal::term(fes, e.fei(), format!("malformed PDU: {e}")));
                    }
                },
            };
            let waiting = self.conn.tx_pending();
            self.on_pdu(pdu)?;
            self.conn.consume(len);
            if self.closing.is_some() {
                return Ok(());
            }
            // Send mode: inline writes each PDU's responses at once when nothing was waiting; adaptive does so
            // only when nothing else was received either (an idle connection), or when the host seals each
            // PDU in its own TLS record (it does not batch: see `note_packing`); deferred leaves everything
            // to the end-of-iteration flush.
            if self.conn.tx_pending() > waiting {
                let more = if self.conn.rx_data().is_empty() || self.host_unbatched {
                    0
                } else {
                    usize::MAX
                };
                if self.policy.kick_now(waiting, more) {
                    if let Err(e) = self.conn.flush() {
                        return Err(self.send_failed(&e));
                    }
                }
            }
        }
    }

    fn on_pdu(&mut self, pdu: Rx) -> Result<(), Fatal> {
        match (self.state.setup_phase() == Some(SetupPhase::IcReq), pdu) {
            (_, Rx::TermReq { fes, fei }) => Err(Fatal::close(format!(
                "host sent H2CTermReq (fes {fes:#x}, fei {fei:#x})"
            ))),
            (true, Rx::IcReq(ic)) => {
                self.on_icreq(&ic);
                Ok(())
            }
            (true, _) => Err(Fatal::term(
                Fes::PduSequenceError,
                0,
                "first PDU is not an ICReq",
            )),
            (_, Rx::IcReq(_)) => Err(Fatal::term(Fes::PduSequenceError, 0, "second ICReq")),
            (_, Rx::Capsule { sqe, data }) => self.on_capsule(sqe, data),
            (_, Rx::H2CData { hdr, data }) => self.on_h2c_data(hdr, data),
        }
    }

    /// Data for an outstanding command.
    fn on_h2c_data(&mut self, hdr: pdu::H2CDataHdr, data: Range<usize>) -> Result<(), Fatal> {
        let index = usize::from(hdr.ttag);
        let slot = match self.slots.get_mut(index) {
            Some(s) if s.cid == hdr.cccid && matches!(s.state, SlotState::Receiving { .. }) => s,
            _ => {
                return Err(Fatal::term(
                    Fes::InvalidHeaderField,
                    10,
                    format!(
                        "H2CData for command {:#x} with unknown transfer tag {}",
                        hdr.cccid, hdr.ttag
                    ),
                ))
            }
        };
        let SlotState::Receiving {
            sink,
            len,
            received,
            error,
        } = &mut slot.state
        else {
            unreachable!()
        };
        let end = u64::from(hdr.datao) + u64::from(hdr.datal);
        if hdr.datao != *received || end > u64::from(*len) {
            return Err(Fatal::term(
                Fes::DataOutOfRange,
                0,
                format!(
                    "H2CData for command {:#x} covers bytes {}..{end}; expected from {} of {}",
                    hdr.cccid, hdr.datao, received, len
                ),
            ));
        }
        let bytes = &self.conn.rx_data()[data];
        match sink {
            Sink::Namespace { ns, off, .. } => {
                if error.is_none() {
                    if let Err(e) = ns.store.write(*off + u64::from(hdr.datao), bytes) {
                        *error = Some(io::write_error_status(&e));
                    }
                }
            }
            Sink::Buffer(buf) => buf.extend_from_slice(bytes),
        }
        *received = end as u32;
        if *received < *len {
            return Ok(());
        }
        self.data_complete(index)
    }

    /// A data digest error: the PDU is dropped and its command fails with a transient transport error.
    fn on_data_digest_error(&mut self, e: &PduError) -> Result<(), Fatal> {
        let PduError::DataDigest { pdu_type, .. } = *e else {
            return Ok(());
        };
        let rx = self.conn.rx_data();
        match pdu_type {
            pdu::PduType::CapsuleCmd => {
                let sqe =
                    Sqe::from_bytes(&rx[pdu::CH_LEN..]).expect("the decoder checked the header");
                self.stats.commands += 1;
                if let Some(q) = self.state.queue_mut() {
                    q.sqhd = ((u32::from(q.sqhd) + 1) % (u32::from(q.sqsize) + 1)) as u16;
                }
                self.complete(sqe.cid, Status::TRANSIENT_TRANSPORT_ERROR, 0, 0)
            }
            pdu::PduType::H2CData => {
                let field = |o: usize| u32::from_le_bytes([rx[o], rx[o + 1], rx[o + 2], rx[o + 3]]);
                let (cccid, ttag) = (
                    u16::from_le_bytes([rx[8], rx[9]]),
                    u16::from_le_bytes([rx[10], rx[11]]),
                );
                let (datao, datal) = (field(12), field(16));
                let index = usize::from(ttag);
                let Some(slot) = self.slots.get_mut(index).filter(|s| s.cid == cccid) else {
                    return Err(Fatal::term(
                        Fes::InvalidHeaderField,
                        10,
                        "H2CData with unknown transfer tag",
                    ));
                };
                let SlotState::Receiving {
                    len,
                    received,
                    error,
                    ..
                } = &mut slot.state
                else {
                    return Err(Fatal::term(
                        Fes::PduSequenceError,
                        0,
                        "H2CData for a command not receiving",
                    ));
                };
                let end = u64::from(datao) + u64::from(datal);
                if datao != *received || end > u64::from(*len) {
                    return Err(Fatal::term(Fes::DataOutOfRange, 0, "H2CData out of range"));
                }
                *error = Some(Status::TRANSIENT_TRANSPORT_ERROR);
                *received = end as u32;
                if *received < *len {
                    Ok(())
                } else {
                    self.data_complete(index)
                }
            }
            _ => Ok(()),
        }
    }

    /// All data of the command in slot `index` arrived.
    fn data_complete(&mut self, index: usize) -> Result<(), Fatal> {
        let slot = &mut self.slots[index];
        let state = std::mem::replace(&mut slot.state, SlotState::Free);
        let sqe = slot.sqe;
        self.busy_slots -= 1;
        let SlotState::Receiving { sink, error, .. } = state else {
            unreachable!()
        };
        if let Some(status) = error {
            return self.complete(sqe.cid, status, 0, 0);
        }
        match sink {
            Sink::Namespace { ns, fua, .. } => {
                self.stats.writes += 1;
                self.stats.bytes_written += u64::from(sqe.sgl().length);
                if fua {
                    let ticket = ns.store.start_flush();
                    self.reply(sqe, Reply::Flush(vec![(ns, ticket)]))
                } else {
                    self.complete(sqe.cid, Status::SUCCESS, 0, 0)
                }
            }
            Sink::Buffer(buf) => {
                if self.awaiting_connect() {
                    return self.connect(&sqe, Data::Gathered(&buf));
                }
                if sqe.opcode == fabrics::FABRICS && sqe.nsid as u8 == fabrics::AUTH_SEND {
                    return self.on_auth(sqe, &buf);
                }
                let reply = self.run_handler(&sqe, Data::Gathered(&buf), buf.len() as u32);
                self.reply(sqe, reply)
            }
        }
    }
}

/// Converts a decoded PDU into one that refers to its data by position.
fn to_rx(buf: &[u8], pdu: Pdu<'_>) -> Result<Rx, Fatal> {
    let range = |d: &[u8]| {
        if d.is_empty() {
            0..0
        } else {
            let start = d.as_ptr() as usize - buf.as_ptr() as usize;
            start..start + d.len()
        }
    };
    Ok(match pdu {
        Pdu::IcReq(ic) => Rx::IcReq(ic),
        Pdu::H2CTermReq(t) => Rx::TermReq {
            fes: t.fes,
            fei: t.fei,
        },
        Pdu::CapsuleCmd { sqe, data } => Rx::Capsule {
            sqe,
            data: range(data),
        },
        Pdu::H2CData { hdr, data } => Rx::H2CData {
            hdr,
            data: range(data),
        },
        other => {
            return Err(Fatal::term(
                Fes::InvalidHeaderField,
                0,
                format!("{} from a host", other.pdu_type()),
            ));
        }
    })
}
