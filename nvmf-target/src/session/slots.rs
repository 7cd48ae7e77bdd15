//! The slot table: the commands that stay outstanding after the poll that received them (waiting for data,
//! held AERs, flushes, authentication jobs); a slot's index is its R2T transfer tag.

use nvpoll::spec::{Sqe, Status};

use crate::handler::{NsRef, Queue};
use crate::store::{FlushStatus, FlushTicket};
use nvpoll_wire::dhchap::controller::Computed;
use nvpoll_wire::pdu::Fes;

use super::{Fatal, Session, State};

/// Where the data of a command fetched with R2T goes.
#[derive(Debug)]
pub(super) enum Sink {
    /// Straight into a namespace, at this byte offset (an NVM write).
    Namespace { ns: NsRef, off: u64, fua: bool },
    /// Into a buffer, then the command runs with it.
    Buffer(Vec<u8>),
}

#[derive(Debug)]
pub(super) enum SlotState {
    Free,
    /// Waiting for H2CData: `received` of `len` bytes so far. `error` is set when a write failed or a data
    /// digest was bad; the data still has to arrive before the command completes with it.
    Receiving {
        sink: Sink,
        len: u32,
        received: u32,
        error: Option<Status>,
    },
    /// An Asynchronous Event Request, held until an event happens.
    Held,
    /// Waiting for flushes, then completes with `status`.
    Flushing {
        tickets: Vec<(NsRef, FlushTicket)>,
        status: Status,
    },
    /// An Authentication Send or Receive whose Diffie-Hellman work runs on a thread of its own.
    Authenticating {
        job: std::sync::mpsc::Receiver<Computed>,
    },
}

/// A command that stays outstanding after the poll that received it.
#[derive(Debug)]
pub(super) struct Slot {
    pub(super) cid: u16,
    pub(super) sqe: Sqe,
    pub(super) state: SlotState,
}

// Every command scans the slot table for its command ID while commands are outstanding: a slot stays two cache
// lines or less (the command, its ID and a state whose largest variant is an R2T's sink); a bigger state goes
// behind a box.
const _: () = assert!(std::mem::size_of::<Slot>() <= 128);

impl Session {
    /// Frees the slot of a held Asynchronous Event Request without completing it: the host has given up on it.
    fn retire_aer(&mut self, i: usize) {
        debug_assert!(matches!(self.slots[i].state, SlotState::Held));
        self.slots[i].state = SlotState::Free;
        self.busy_slots -= 1;
        self.stats.aers_retired += 1;
    }

    /// Completes every command the queue still holds (waiting for data or a flush, or a held AER) with Command
    /// Aborted due to SQ Deletion: the connection is about to close on the target's account, and the host must
    /// hear what became of each command rather than guess.
    pub(super) fn abort_outstanding(&mut self) {
        if self.busy_slots == 0 || !matches!(self.state, State::Connected(_)) {
            return;
        }
        let cids: Vec<u16> = self
            .slots
            .iter_mut()
            .filter(|s| !matches!(s.state, SlotState::Free))
            .map(|s| {
                s.state = SlotState::Free;
                s.cid
            })
            .collect();
        self.busy_slots = 0;
        self.flushing = 0;
        self.auth_jobs = 0;
        for cid in cids {
            let _ = self.complete(cid, Status::ABORTED_SQ_DELETION, 0, 0);
        }
    }

    /// A command ID that is already outstanding ends the connection, unless a held AER has it: that AER is
    /// retired.
    #[inline]
    pub(super) fn check_command_id(&mut self, cid: u16) -> Result<(), Fatal> {
        if self.busy_slots > 0 {
            if let Some(i) = self
                .slots
                .iter()
                .position(|s| !matches!(s.state, SlotState::Free) && s.cid == cid)
            {
                if !matches!(self.slots[i].state, SlotState::Held) {
                    return Err(Fatal::term(
                        Fes::InvalidHeaderField,
                        10,
                        format!("command ID {cid:#x} is already outstanding"),
                    ));
                }
                // A host that completed an Asynchronous Event Request on its own (SPDK does at detach) and
                // reused its command ID: the AER is retired, never completed, and the new command runs. Only a
                // held AER is forgiven; its completion carries no data the host could confuse with another's.
                self.retire_aer(i);
            }
        }
        Ok(())
    }

    /// Puts a command in a free slot (its index is the R2T transfer tag).
    pub(super) fn take_slot(&mut self, sqe: Sqe, state: SlotState) -> Result<u16, Fatal> {
        let depth = self.state.queue().map_or(1, Queue::depth);
        if self.busy_slots >= depth {
            // A full queue that holds AERs: the host counts only what it still waits for, so it has given up on
            // one of them (completed it locally) and used its entry. Retire one rather than end the session.
            if let Some(i) = self
                .slots
                .iter()
                .position(|s| matches!(s.state, SlotState::Held))
            {
                self.retire_aer(i);
            }
        }
        if self.busy_slots >= depth {
            return Err(Fatal::term(
                Fes::PduSequenceError,
                0,
                format!("more than {depth} commands outstanding (the queue size)"),
            ));
        }
        self.busy_slots += 1;
        let slot = Slot {
            cid: sqe.cid,
            sqe,
            state,
        };
        match self
            .slots
            .iter()
            .position(|s| matches!(s.state, SlotState::Free))
        {
            Some(i) => {
                self.slots[i] = slot;
                Ok(i as u16)
            }
            None => {
                self.slots.push(slot);
                Ok((self.slots.len() - 1) as u16)
            }
        }
    }

    /// Completes the commands whose flushes finished. Returns whether one did.
    pub(super) fn poll_flushes(&mut self) -> bool {
        if self.flushing == 0 {
            return false;
        }
        let mut done = Vec::new();
        for (i, slot) in self.slots.iter_mut().enumerate() {
            if let SlotState::Flushing { tickets, status } = &mut slot.state {
                let mut pending = false;
                for (ns, t) in tickets.iter() {
                    match ns.store.flush_status(*t) {
                        FlushStatus::Pending => pending = true,
                        FlushStatus::Failed => *status = Status::WRITE_FAULT,
                        FlushStatus::Done => {}
                    }
                }
                if !pending {
                    done.push((i, slot.cid, *status));
                }
            }
        }
        for &(i, cid, status) in &done {
            self.slots[i].state = SlotState::Free;
            self.busy_slots -= 1;
            self.flushing -= 1;
            let _ = self.complete(cid, status, 0, 0);
        }
        !done.is_empty()
    }
}

/// The Asynchronous Event Requests held in `slots`.
pub(super) fn held_aers(slots: &[Slot]) -> usize {
    slots
        .iter()
        .filter(|s| matches!(s.state, SlotState::Held))
        .count()
}
