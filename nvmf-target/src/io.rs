//! NVM I/O commands: Read, Write, Flush, Write Zeroes, Dataset Management and the reservation commands
//! ([`crate::resv`] holds the rules).
//!
//! Reads are answered straight from the namespace into the send buffer ([`Reply::Read`]); writes go straight
//! from the receive buffer into the namespace, whether the data came in the capsule or in H2CData PDUs. Flushes
//! of a file wait for its flusher thread ([`Reply::Flush`]).

use nvpoll::spec::{io as op, DsmRange, Sqe, Status, DSM_RANGE_SIZE};

use crate::handler::{NsRef, Queue, Reply};
use crate::shared::SessionStats;

/// Namespace ID meaning "every namespace" (Flush).
const ALL_NAMESPACES: u32 = 0xffff_ffff;

/// Checks a read or write: the namespace, the block range, and that the data pointer covers exactly the blocks.
/// Returns the namespace and the byte offset and length.
fn check_rw(q: &Queue, sqe: &Sqe, xfer_len: u32) -> Result<(NsRef, u64, u32), Status> {
    let Some(ns) = q.namespace(sqe.nsid) else {
        return Err(Status::INVALID_NAMESPACE.with_dnr());
    };
    if let Some(status) = q.ana_refusal(ns) {
        return Err(status);
    }
    if let Some(status) = q.resv_refusal(ns, sqe.opcode != op::READ) {
        return Err(status);
    }
    let nlb = u64::from(sqe.nlb_zero_based()) + 1;
    let Some((off, len)) = ns.byte_range(sqe.slba(), nlb) else {
        return Err(Status::LBA_OUT_OF_RANGE.with_dnr());
    };
    if len > u64::from(q.max_transfer()) {
        return Err(Status::INVALID_FIELD.with_dnr());
    }
    if u64::from(xfer_len) != len {
        return Err(Status::DATA_SGL_LENGTH_INVALID.with_dnr());
    }
    Ok((ns.clone(), off, len as u32))
}

/// A write whose data will come with R2T/H2CData: where it goes.
pub(crate) fn prepare_write(q: &Queue, sqe: &Sqe, xfer_len: u32) -> Result<(NsRef, u64), Status> {
    check_rw(q, sqe, xfer_len).map(|(ns, off, _)| (ns, off))
}

/// A write with its data in the capsule.
pub(crate) fn write_in_capsule(
    q: &Queue,
    sqe: &Sqe,
    data: &[u8],
    stats: &mut SessionStats,
) -> Reply {
    let (ns, off, _) = match check_rw(q, sqe, data.len() as u32) {
        Ok(v) => v,
        Err(status) => return Reply::status(status),
    };
    if let Err(e) = ns.store.write(off, data) {
        return Reply::status(write_error_status(&e));
    }
    stats.writes += 1;
    stats.bytes_written += data.len() as u64;
    if sqe.cdw12 & Sqe::FUA != 0 {
        let ticket = ns.store.start_flush();
        return Reply::Flush(vec![(ns, ticket)]);
    }
    Reply::ok(0)
}

/// Dataset Management dword 11: Attribute - Deallocate.
const DSM_AD: u32 = 1 << 2;

/// The most bytes of host-to-controller data an I/O command other than a write takes (Dataset Management: 256
/// ranges of 16 bytes).
pub(crate) const MAX_COMMAND_DATA: u32 = 256 * DSM_RANGE_SIZE as u32;

/// Whether an I/O command takes host-to-controller data into a buffer before it runs (a write's goes to the
/// namespace instead).
pub(crate) fn takes_data(opcode: u8) -> bool {
    matches!(
        opcode,
        op::DSM | op::RESERVATION_REGISTER | op::RESERVATION_ACQUIRE | op::RESERVATION_RELEASE
    )
}

/// An I/O command other than a write, with the host-to-controller data it came with (in the capsule or
/// fetched with R2T; empty for the commands that take none).
pub(crate) fn execute(q: &Queue, sqe: &Sqe, data: &[u8]) -> Reply {
    let xfer_len = sqe.sgl().length;
    match sqe.opcode {
        op::READ => match check_rw(q, sqe, xfer_len) {
            Ok((ns, off, len)) => Reply::Read { ns, off, len },
            Err(status) => Reply::status(status),
        },
        // A write always has data; one without any describes the wrong length.
        op::WRITE => match check_rw(q, sqe, 0) {
            Ok(_) => Reply::ok(0),
            Err(status) => Reply::status(status),
        },
        op::FLUSH => {
            if sqe.nsid == ALL_NAMESPACES {
                // Every namespace this path may reach.
                let all = q
                    .namespaces()
                    .filter(|ns| q.ana_refusal(ns).is_none())
                    .map(|ns| (ns.clone(), ns.store.start_flush()))
                    .collect();
                return Reply::Flush(all);
            }
            match q.namespace(sqe.nsid) {
                Some(ns) => match q.ana_refusal(ns).or_else(|| q.resv_refusal(ns, true)) {
                    Some(status) => Reply::status(status),
                    None => Reply::Flush(vec![(ns.clone(), ns.store.start_flush())]),
                },
                None => Reply::status(Status::INVALID_NAMESPACE.with_dnr()),
            }
        }
        op::WRITE_ZEROES => {
            let Some(ns) = q.namespace(sqe.nsid) else {
                return Reply::status(Status::INVALID_NAMESPACE.with_dnr());
            };
            if let Some(status) = q.ana_refusal(ns).or_else(|| q.resv_refusal(ns, true)) {
                return Reply::status(status);
            }
            let nlb = u64::from(sqe.nlb_zero_based()) + 1;
            let Some((off, len)) = ns.byte_range(sqe.slba(), nlb) else {
                return Reply::status(Status::LBA_OUT_OF_RANGE.with_dnr());
            };
            // With Deallocate set the blocks may be forgotten instead, where they then read as zeroes.
            let result = if sqe.cdw12 & Sqe::DEALLOCATE != 0 && ns.store.deallocates() == Some(true)
            {
                ns.store.deallocate(off, len)
            } else {
                ns.store.write_zeroes(off, len)
            };
            if let Err(e) = result {
                return Reply::status(write_error_status(&e));
            }
            if sqe.cdw12 & Sqe::FUA != 0 {
                return Reply::Flush(vec![(ns.clone(), ns.store.start_flush())]);
            }
            Reply::ok(0)
        }
        op::DSM => dataset_management(q, sqe, data),
        op::RESERVATION_REGISTER | op::RESERVATION_ACQUIRE | op::RESERVATION_RELEASE => {
            reservation(q, sqe, data)
        }
        op::RESERVATION_REPORT => reservation_report(q, sqe),
        _ => Reply::status(Status::INVALID_OPCODE.with_dnr()),
    }
}

/// Dataset Management: with Deallocate, every range is forgotten (checked whole before any is); without it the
/// attributes are hints, and hints are free to ignore.
fn dataset_management(q: &Queue, sqe: &Sqe, data: &[u8]) -> Reply {
    let Some(ns) = q.namespace(sqe.nsid) else {
        return Reply::status(Status::INVALID_NAMESPACE.with_dnr());
    };
    if let Some(status) = q.ana_refusal(ns) {
        return Reply::status(status);
    }
    // Hints change nothing; only a deallocate is in the write command group.
    if sqe.cdw11 & DSM_AD != 0 {
        if let Some(status) = q.resv_refusal(ns, true) {
            return Reply::status(status);
        }
    }
    let ranges = (sqe.cdw10 & 0xff) as usize + 1;
    let need = ranges * DSM_RANGE_SIZE;
    // The data must hold the ranges (Linux and SPDK send 16 bytes a range; more is ignored).
    if data.len() < need {
        return Reply::status(Status::DATA_SGL_LENGTH_INVALID.with_dnr());
    }
    let ranges = DsmRange::parse_all(&data[..need]);
    let mut extents = Vec::with_capacity(ranges.len());
    for r in &ranges {
        let Some(extent) = ns.byte_range(r.slba, u64::from(r.nlb)) else {
            return Reply::status(Status::LBA_OUT_OF_RANGE.with_dnr());
        };
        extents.push(extent);
    }
    if sqe.cdw11 & DSM_AD == 0 {
        return Reply::ok(0);
    }
    if ns.store.deallocates().is_none() {
        // Identify Namespace says so too (DLFEAT 0): the device behind it cannot deallocate.
        return Reply::status(Status::INVALID_FIELD.with_dnr());
    }
    for (off, len) in extents {
        if len > 0 {
            if let Err(e) = ns.store.deallocate(off, len) {
                return Reply::status(write_error_status(&e));
            }
        }
    }
    Reply::ok(0)
}

/// Reservation Register, Acquire or Release, with its data (16, 16 and 8 bytes); the hosts it concerns are told
/// through their controllers' reservation logs.
fn reservation(q: &Queue, sqe: &Sqe, data: &[u8]) -> Reply {
    let Some(ns) = q.namespace(sqe.nsid) else {
        return Reply::status(Status::INVALID_NAMESPACE.with_dnr());
    };
    if let Some(status) = q.ana_refusal(ns) {
        return Reply::status(status);
    }
    let need = if sqe.opcode == op::RESERVATION_RELEASE {
        8
    } else {
        16
    };
    if data.len() < need {
        return Reply::status(Status::DATA_SGL_LENGTH_INVALID.with_dnr());
    }
    let host = &q.ctrl.hostid;
    let result = match sqe.opcode {
        op::RESERVATION_REGISTER => ns.resv.register(host, sqe.cdw10, data),
        op::RESERVATION_ACQUIRE => ns.resv.acquire(host, sqe.cdw10, data),
        _ => ns.resv.release(host, sqe.cdw10, data),
    };
    match result {
        Ok(notify) => {
            for (hostid, kind) in notify {
                q.subsys.reservation_notice(&hostid, ns.nsid, kind);
            }
            Reply::ok(0)
        }
        Err(status) => Reply::status(status),
    }
}

/// Reservation Report: NUMD (dword 10, 0-based dwords) of the status structure, extended with EDS (dword 11
/// bit 0).
fn reservation_report(q: &Queue, sqe: &Sqe) -> Reply {
    let Some(ns) = q.namespace(sqe.nsid) else {
        return Reply::status(Status::INVALID_NAMESPACE.with_dnr());
    };
    if let Some(status) = q.ana_refusal(ns) {
        return Reply::status(status);
    }
    let len = (u64::from(sqe.cdw10) + 1) * 4;
    let len = len.min(u64::from(sqe.sgl().length)) as usize;
    match ns.resv.report(sqe.cdw11 & 1 != 0, len) {
        Ok(page) => Reply::Data(page),
        Err(status) => Reply::status(status),
    }
}

/// The status of a write that the namespace's store failed: Capacity Exceeded when its file system is full
/// (ENOSPC, EDQUOT: the host sees "no space left", as with nvmet), else Write Fault.
pub(crate) fn write_error_status(e: &std::io::Error) -> Status {
    use rustix::io::Errno;
    match Errno::from_io_error(e) {
        Some(Errno::NOSPC | Errno::DQUOT) => Status::CAPACITY_EXCEEDED.with_dnr(),
        _ => Status::WRITE_FAULT,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_full_file_system_is_capacity_exceeded_and_other_errors_a_write_fault() {
        let full = std::io::Error::from(rustix::io::Errno::NOSPC);
        assert_eq!(
            write_error_status(&full),
            Status::CAPACITY_EXCEEDED.with_dnr()
        );
        let quota = std::io::Error::from(rustix::io::Errno::DQUOT);
        assert_eq!(
            write_error_status(&quota),
            Status::CAPACITY_EXCEEDED.with_dnr()
        );
        let eio = std::io::Error::from(rustix::io::Errno::IO);
        assert_eq!(write_error_status(&eio), Status::WRITE_FAULT);
    }
}
