//! Carrying out a handler's [`Reply`]: response capsules, C2HData (from a buffer or straight from a
//! namespace), held and flushing commands, a Disconnect.

use std::time::Instant;

use nvpoll::spec::{Cqe, Sqe, Status};

use crate::handler::{NsRef, Queue, Reply};
use crate::store::FlushTicket;
use nvpoll_wire::conn::DIRECT_SEND_MIN;
use nvpoll_wire::pdu;

use super::slots::SlotState;
use super::{Fatal, Session, State, C2H_CHUNK, DISCONNECT_LINGER, MAX_ADMIN_DATA};

impl Session {
    /// Carries out a handler's decision.
    #[inline]
    pub(super) fn reply(&mut self, sqe: Sqe, reply: Reply) -> Result<(), Fatal> {
        match reply {
            Reply::Complete { status, dw0, dw1 } => self.complete(sqe.cid, status, dw0, dw1),
            Reply::Data(data) => self.reply_data(sqe, data),
            Reply::Read { ns, off, len } => self.reply_read(sqe, ns, off, len),
            Reply::Hold => {
                self.take_slot(sqe, SlotState::Held)?;
                Ok(())
            }
            Reply::Flush(tickets) => self.reply_flush(sqe, tickets),
            Reply::CompleteAndClose => self.reply_disconnect(sqe),
        }
    }

    /// [`Reply::Data`]: `data`, padded or cut to the command's transfer length, as C2HData, then the completion.
    fn reply_data(&mut self, sqe: Sqe, mut data: Vec<u8>) -> Result<(), Fatal> {
        let len = sqe.sgl().length;
        let max = self
            .state
            .queue()
            .map_or(MAX_ADMIN_DATA, Queue::max_transfer);
        if len > max {
            return self.complete(sqe.cid, Status::DATA_SGL_LENGTH_INVALID.with_dnr(), 0, 0);
        }
        data.resize(len as usize, 0);
        if !data.is_empty() {
            self.send_data(sqe.cid, &data);
        }
        self.complete_after_data(sqe.cid, !data.is_empty())
    }

    /// [`Reply::Read`]: `len` bytes of `ns` from byte offset `off` as C2HData (straight from a RAM store's
    /// memory where a chunk is large enough), then the completion.
    fn reply_read(&mut self, sqe: Sqe, ns: NsRef, off: u64, len: u32) -> Result<(), Fatal> {
        let mark = self.conn.tx_buf().len();
        let mut done = 0usize;
        while done < len as usize {
            let n = C2H_CHUNK.min(len as usize - done);
            let last = done + n == len as usize;
            let success = last && self.state.queue().is_some_and(|q| q.sqflow_disabled);
            let hdr = pdu::C2HDataHdr {
                cccid: sqe.cid,
                datao: done as u32,
                datal: n as u32,
                last,
                success,
            };
            let tx = self.conn.tx_buf();
            pdu::encode_c2h_data_header(tx, &hdr, self.digests, self.hpda);
            if n >= DIRECT_SEND_MIN {
                // Straight from the namespace's memory to the socket (RAM stores).
                let conn = &mut self.conn;
                let digest = self.digests.data;
                let sent = ns
                    .store
                    .with_ram_slices(off + done as u64, n, |data| conn.send_payload(data, digest));
                match sent {
                    Some(Ok(_)) => {
                        self.conn.pdu_queued();
                        done += n;
                        continue;
                    }
                    Some(Err(e)) => {
                        return Err(self.send_failed(&e));
                    }
                    None => {}
                }
            }
            let tx = self.conn.tx_buf();
            let start = tx.len();
            if ns.store.read_append(off + done as u64, n, tx).is_err() {
                tx.truncate(mark);
                return self.complete(sqe.cid, Status::UNRECOVERED_READ_ERROR, 0, 0);
            }
            if self.digests.data {
                let d = pdu::data_digest(&tx[start..]);
                tx.extend_from_slice(&d);
            }
            self.conn.pdu_queued();
            done += n;
        }
        self.stats.reads += 1;
        self.stats.bytes_read += u64::from(len);
        self.complete_after_data(sqe.cid, len > 0)
    }

    /// [`Reply::Flush`]: the command waits in a slot for its flushes ([`Session::poll_flushes`]).
    fn reply_flush(&mut self, sqe: Sqe, tickets: Vec<(NsRef, FlushTicket)>) -> Result<(), Fatal> {
        self.take_slot(
            sqe,
            SlotState::Flushing {
                tickets,
                status: Status::SUCCESS,
            },
        )?;
        self.flushing += 1;
        Ok(())
    }

    /// [`Reply::CompleteAndClose`]: a Disconnect.
    fn reply_disconnect(&mut self, sqe: Sqe) -> Result<(), Fatal> {
        // What the queue still holds is answered first (the queue is going), then the Disconnect;
        // the connection stays to answer what the host sent behind it, and closes when the host
        // closes it or falls silent.
        self.abort_outstanding();
        self.complete(sqe.cid, Status::SUCCESS, 0, 0)?;
        if let State::Connected(c) = &mut self.state {
            c.disconnected = Some(Instant::now() + DISCONNECT_LINGER);
        }
        Ok(())
    }

    /// Queues `data` as C2HData PDUs (without SUCCESS; see [`Session::complete_after_data`]).
    fn send_data(&mut self, cid: u16, data: &[u8]) {
        let sqflow_disabled = self.state.queue().is_some_and(|q| q.sqflow_disabled);
        let mut done = 0;
        for chunk in data.chunks(C2H_CHUNK) {
            let last = done + chunk.len() == data.len();
            let hdr = pdu::C2HDataHdr {
                cccid: cid,
                datao: done as u32,
                datal: chunk.len() as u32,
                last,
                success: last && sqflow_disabled,
            };
            pdu::encode_c2h_data(self.conn.tx_buf(), &hdr, chunk, self.digests, self.hpda);
            self.conn.pdu_queued();
            done += chunk.len();
        }
    }

    /// Completes a command whose data went out: with SQ flow control disabled the last C2HData carried SUCCESS
    /// and no response capsule follows (the C2H success optimization); otherwise a CapsuleResp does.
    fn complete_after_data(&mut self, cid: u16, sent_data: bool) -> Result<(), Fatal> {
        if sent_data && self.state.queue().is_some_and(|q| q.sqflow_disabled) {
            return Ok(());
        }
        self.complete(cid, Status::SUCCESS, 0, 0)
    }

    /// Queues a response capsule.
    // Inline: every command ends here, from every file of the session (codegen units follow modules).
    #[inline]
    pub(super) fn complete(
        &mut self,
        cid: u16,
        status: Status,
        dw0: u32,
        dw1: u32,
    ) -> Result<(), Fatal> {
        let (sqid, sqhd) = match self.state.queue() {
            Some(q) if q.sqflow_disabled => (q.qid, 0xffff),
            Some(q) => (q.qid, q.sqhd),
            None => (0, 0),
        };
        let mut cqe = Cqe {
            dw0,
            dw1,
            sqhd,
            sqid,
            cid,
            status_phase: 0,
        };
        cqe.set_status(status, false);
        pdu::encode_capsule_resp(self.conn.tx_buf(), &cqe, self.digests);
        self.conn.pdu_queued();
        if !status.is_success() {
            self.stats.errors += 1;
        }
        Ok(())
    }
}
