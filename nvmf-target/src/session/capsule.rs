//! A command capsule: its data pointer checked, then run through its handler ([`crate::admin`], [`crate::io`])
//! or its data asked for with R2T.

use std::ops::Range;
use std::time::Instant;

use nvpoll::spec::{fabrics, io as io_op, SglDescriptor, SglType, Sqe, Status};

use crate::admin;
use crate::handler::{Ctx, Reply};
use crate::io;
use nvpoll_wire::pdu;

use super::slots::{held_aers, Sink, SlotState};
use super::{Connected, Fatal, Session, State, DISCONNECT_LINGER, MAX_ADMIN_DATA};

impl Session {
    /// A command capsule: checks its data pointer, then executes it or asks for its data.
    pub(super) fn on_capsule(&mut self, sqe: Sqe, data: Range<usize>) -> Result<(), Fatal> {
        self.stats.commands += 1;
        if let State::Connected(Connected {
            disconnected: Some(until),
            ..
        }) = &mut self.state
        {
            // Behind a Disconnect (SPDK's nvme_fuzz sends commands there): each still gets its one answer.
            // Disconnect deleted this I/O queue's submission queue, and these commands were submitted to it
            // before the host could see that, so they end as commands on a deleted SQ do (NVMe Base 2.0,
            // Delete I/O Submission Queue): Command Aborted due to SQ Deletion, which the host may retry on
            // another queue (no DNR). Command Sequence Error would tell it that it broke a command sequence,
            // and a host cannot know where in the stream the target processed its Disconnect.
            *until = Instant::now() + DISCONNECT_LINGER;
            self.stats.aborted_after_disconnect += 1;
            return self.complete(sqe.cid, Status::ABORTED_SQ_DELETION, 0, 0);
        }
        self.check_command_id(sqe.cid)?;
        if let Some(q) = self.state.queue_mut() {
            q.sqhd = ((u32::from(q.sqhd) + 1) % (u32::from(q.sqsize) + 1)) as u16;
            // The namespaces and the path's ANA states as they are now (an atomic load each when unchanged):
            // the poll's refresh can have run before this command arrived in the same pass, and a change the
            // host saw take effect (an RPC answered, an ANA event read) before it sent the command applies to
            // it. Without this, CI saw a write answered with the ANA state from before the change.
            q.refresh_namespaces();
        }
        let fctype = (sqe.opcode == fabrics::FABRICS).then_some(sqe.nsid as u8);
        // Data transfer direction: bits 1:0 of the opcode (of the fctype for fabrics commands).
        let dir = fctype.unwrap_or(sqe.opcode) & 3;
        let sgl = sqe.sgl();
        let xfer_len = sgl.length;
        let incapsule_max = self.target.limits.incapsule_data;
        if let Some(status) =
            data_pointer_refusal(&sqe, &sgl, dir, data.len() as u32, incapsule_max)
        {
            return self.complete(sqe.cid, status, 0, 0);
        }
        if let Some(status) = self.sequence_refusal(&sqe, fctype) {
            return self.complete(sqe.cid, status, 0, 0);
        }

        // Host-to-controller data that is not in the capsule: ask for it first, for the commands that take it
        // (the others complete without it, with an error or without needing it).
        let transport = sgl.sgl_type == SglType::TransportDataBlock;
        let io_queue = self.state.queue().is_some_and(|q| q.qid != 0);
        let io_data = io_queue && (sqe.opcode == io_op::WRITE || io::takes_data(sqe.opcode));
        if dir == 1
            && transport
            && xfer_len > 0
            && (io_data || matches!(fctype, Some(fabrics::CONNECT | fabrics::AUTH_SEND)))
        {
            return self.solicit(sqe, xfer_len);
        }
        self.execute(sqe, fctype, data, xfer_len)
    }

    /// Refuses what the connection takes none of yet: anything but Connect before Connect, and on a queue whose
    /// host must authenticate anything but authentication until it has (logged as such).
    fn sequence_refusal(&self, sqe: &Sqe, fctype: Option<u8>) -> Option<Status> {
        // The connection is not a queue yet: only Connect may come.
        if self.awaiting_connect() && fctype != Some(fabrics::CONNECT) {
            return Some(Status::COMMAND_SEQUENCE_ERROR.with_dnr());
        }

        // A queue whose host must authenticate runs nothing else until it has.
        let auth_cmd = matches!(fctype, Some(fabrics::AUTH_SEND | fabrics::AUTH_RECV));
        if !auth_cmd && self.state.queue().is_some_and(|q| !q.authenticated()) {
            self.emit_auth_failed(&format!(
                "opcode {:#04x}{} before authentication: refused with Authentication Required",
                sqe.opcode,
                fctype.map_or(String::new(), |t| format!(" (fctype {t:#04x})"))
            ));
            return Some(Status::AUTHENTICATION_REQUIRED);
        }
        None
    }

    /// Runs a command whose data, if it has any, came in its capsule (`data`, a range of the receive buffer):
    /// Connect, authentication, an in-capsule write, or any other command through its handler.
    fn execute(
        &mut self,
        sqe: Sqe,
        fctype: Option<u8>,
        data: Range<usize>,
        xfer_len: u32,
    ) -> Result<(), Fatal> {
        if self.awaiting_connect() {
            return self.connect(&sqe, Data::Received(data));
        }
        if matches!(fctype, Some(fabrics::AUTH_SEND | fabrics::AUTH_RECV)) {
            let data = self.conn.rx_data()[data].to_vec();
            return self.on_auth(sqe, &data);
        }
        let queue = self
            .state
            .queue_mut()
            .expect("a connected session has a queue");
        let reply = if queue.qid != 0 && sqe.opcode == io_op::WRITE && !data.is_empty() {
            // An in-capsule write goes straight to the namespace.
            io::write_in_capsule(queue, &sqe, &self.conn.rx_data()[data], &mut self.stats)
        } else {
            self.run_handler(&sqe, Data::Received(data), xfer_len)
        };
        self.reply(sqe, reply)
    }

    /// Sends R2T for a command's data (or completes it with an error if it cannot take data).
    fn solicit(&mut self, sqe: Sqe, len: u32) -> Result<(), Fatal> {
        let sink = match self.state.queue() {
            Some(q) if q.qid != 0 && sqe.opcode == io_op::WRITE => {
                match io::prepare_write(q, &sqe, len) {
                    Ok((ns, off)) => Sink::Namespace {
                        ns,
                        off,
                        fua: sqe.cdw12 & Sqe::FUA != 0,
                    },
                    Err(status) => return self.complete(sqe.cid, status, 0, 0),
                }
            }
            _ if len > MAX_ADMIN_DATA.max(io::MAX_COMMAND_DATA) => {
                return self.complete(sqe.cid, Status::DATA_SGL_LENGTH_INVALID.with_dnr(), 0, 0);
            }
            _ => Sink::Buffer(Vec::with_capacity(len as usize)),
        };
        let ttag = self.take_slot(
            sqe,
            SlotState::Receiving {
                sink,
                len,
                received: 0,
                error: None,
            },
        )?;
        let r2t = pdu::R2T {
            cccid: sqe.cid,
            ttag,
            r2to: 0,
            r2tl: len,
        };
        pdu::encode_r2t(self.conn.tx_buf(), &r2t, self.digests);
        self.conn.pdu_queued();
        self.stats.r2ts += 1;
        Ok(())
    }

    /// Runs a command that needs no more data through its handler, on this session's queue.
    pub(super) fn run_handler(&mut self, sqe: &Sqe, data: Data<'_>, xfer_len: u32) -> Reply {
        let data = match data {
            Data::Received(range) => &self.conn.rx_data()[range],
            Data::Gathered(buf) => buf,
        };
        let queue = self
            .state
            .queue_mut()
            .expect("a connected session has a queue");
        let held_aers = if queue.qid == 0 {
            held_aers(&self.slots)
        } else {
            0
        };
        let mut ctx = Ctx {
            target: &self.target,
            queue,
            local: self.local,
            listener: &self.listener,
            xfer_len,
            held_aers,
        };
        dispatch(&mut ctx, sqe, data)
    }
}

/// Where a command's data is, for [`Session::run_handler`].
pub(super) enum Data<'a> {
    /// In the capsule: this range of the receive buffer.
    Received(std::ops::Range<usize>),
    /// Gathered from H2CData PDUs.
    Gathered(&'a [u8]),
}

/// Why a command's data pointer is refused, if it is: its SGL descriptor `sgl` against the `in_len` bytes of
/// data in the capsule (at most `incapsule_max`) and the command's data direction `dir`, in this order.
fn data_pointer_refusal(
    sqe: &Sqe,
    sgl: &SglDescriptor,
    dir: u8,
    in_len: u32,
    incapsule_max: u32,
) -> Option<Status> {
    let xfer_len = sgl.length;
    if sqe.flags & 0xc0 == 0 && (dir != 0 || in_len > 0) {
        return Some(Status::INVALID_FIELD.with_dnr());
    }
    let incapsule =
        sgl.sgl_type == SglType::DataBlock && sgl.subtype == nvpoll::spec::sgl_subtype::OFFSET;
    let transport = sgl.sgl_type == SglType::TransportDataBlock;
    if in_len > 0 && !incapsule {
        return Some(Status::SGL_DESCRIPTOR_TYPE_INVALID.with_dnr());
    }
    if incapsule {
        if dir != 1 {
            return Some(Status::SGL_DESCRIPTOR_TYPE_INVALID.with_dnr());
        }
        if sgl.address != 0 {
            return Some(Status::SGL_OFFSET_INVALID.with_dnr());
        }
        if xfer_len != in_len || in_len > incapsule_max {
            return Some(Status::DATA_SGL_LENGTH_INVALID.with_dnr());
        }
    } else if xfer_len > 0 && !transport {
        return Some(Status::SGL_DESCRIPTOR_TYPE_INVALID.with_dnr());
    }
    None
}

/// Routes a command that needs no more data to its handler.
fn dispatch(ctx: &mut Ctx<'_>, sqe: &Sqe, data: &[u8]) -> Reply {
    if sqe.opcode == fabrics::FABRICS {
        return admin::fabrics(ctx, sqe);
    }
    if ctx.queue.qid == 0 {
        admin::execute(ctx, sqe, data)
    } else {
        io::execute(ctx.queue, sqe, data)
    }
}
