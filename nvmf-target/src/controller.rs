//! What the queues of one controller share: its identity, keep-alive, readiness and which I/O queues exist.
//!
//! A controller is created by Fabrics Connect on an admin queue and lives as long as that admin connection. Its
//! I/O queues may be connections on other reactors, so everything here is atomics (read on every poll, cheap)
//! or a lock taken only when a queue connects or goes away. The registers and features, which only the admin
//! queue touches, live with the admin connection ([`crate::admin::AdminState`]).

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::Mutex;

/// The shared state of one controller.
#[derive(Debug)]
pub(crate) struct Controller {
    /// Controller ID, assigned at admin Connect.
    pub cntlid: u16,
    /// The host NQN its admin queue connected with; I/O queues must present the same.
    pub hostnqn: String,
    /// The host identifier from Connect.
    pub hostid: [u8; 16],
    /// The listener its admin queue came through: the path whose ANA states it reports.
    pub listener: SocketAddr,
    /// Keep Alive Timeout in milliseconds; 0 means keep-alive is off.
    kato_ms: AtomicU32,
    /// When any queue of the controller last received a command, in milliseconds since the target started.
    last_activity_ms: AtomicU64,
    /// CSTS.RDY: I/O queues may connect.
    ready: AtomicBool,
    /// The controller was torn down (keep-alive expired, admin queue gone); its I/O queues close.
    dead: AtomicBool,
    /// Connected I/O queue IDs, as a bit set indexed by `qid - 1`.
    io_queues: Mutex<Vec<bool>>,
    /// A Namespace Attribute Changed notice waits for an Asynchronous Event Request to carry it.
    ns_notice: AtomicBool,
    /// The Changed Namespace List log page: the IDs changed since the host last read it.
    changed_ns: Mutex<Vec<u32>>,
    /// An ANA change notice waits for an Asynchronous Event Request to carry it.
    ana_notice: AtomicBool,
    /// Reservation notices not yet read from the Reservation Notification log page: count, type, NSID.
    resv_log: Mutex<ResvLog>,
    /// A Reservation Log Page Available notice waits for an Asynchronous Event Request.
    resv_notice: AtomicBool,
    /// Reservation Notification Mask (feature 82h): bit 1 registration preempted, 2 reservation released,
    /// 3 reservation preempted; one mask for all namespaces.
    resv_mask: AtomicU32,
}

/// The Reservation Notification log page's queue for one controller.
#[derive(Debug, Default)]
struct ResvLog {
    /// The Log Page Count of the last notice logged.
    count: u64,
    entries: std::collections::VecDeque<(u64, u8, u32)>,
}

/// Notices a controller keeps before the oldest are dropped (the host reads them one per Get Log Page).
const RESV_LOG_MAX: usize = 255;

/// The most IDs the Changed Namespace List holds; beyond, it says "more than that" (0xFFFFFFFF first).
const CHANGED_NS_MAX: usize = 1024;

impl Controller {
    /// A controller that allows I/O queues 1 to `max_io_queues`.
    pub(crate) fn new(
        cntlid: u16,
        hostnqn: String,
        hostid: [u8; 16],
        listener: SocketAddr,
        kato_ms: u32,
        now_ms: u64,
        max_io_queues: u16,
    ) -> Self {
        Controller {
            cntlid,
            hostnqn,
            hostid,
            listener,
            kato_ms: AtomicU32::new(kato_ms),
            last_activity_ms: AtomicU64::new(now_ms),
            ready: AtomicBool::new(false),
            dead: AtomicBool::new(false),
            io_queues: Mutex::new(vec![false; usize::from(max_io_queues)]),
            ns_notice: AtomicBool::new(false),
            changed_ns: Mutex::new(Vec::new()),
            ana_notice: AtomicBool::new(false),
            resv_log: Mutex::new(ResvLog::default()),
            resv_notice: AtomicBool::new(false),
            resv_mask: AtomicU32::new(0),
        }
    }

    /// Logs a reservation notice of `kind` on namespace `nsid`, unless the host masked that kind.
    pub(crate) fn reservation_notice(&self, nsid: u32, kind: u8) {
        if self.resv_mask.load(Ordering::Relaxed) & (1 << kind) != 0 {
            return;
        }
        let mut log = self.resv_log.lock().unwrap_or_else(|e| e.into_inner());
        log.count = log.count.wrapping_add(1).max(1);
        let count = log.count;
        if log.entries.len() == RESV_LOG_MAX {
            log.entries.pop_front();
        }
        log.entries.push_back((count, kind, nsid));
        drop(log);
        self.resv_notice.store(true, Ordering::Release);
    }

    /// The Reservation Notification log page (64 bytes): the oldest notice, which it removes (all zeroes when
    /// there is none).
    pub(crate) fn take_reservation_log(&self) -> [u8; 64] {
        let mut log = self.resv_log.lock().unwrap_or_else(|e| e.into_inner());
        let mut page = [0u8; 64];
        if let Some((count, kind, nsid)) = log.entries.pop_front() {
            page[0..8].copy_from_slice(&count.to_le_bytes());
            page[8] = kind;
            page[9] = log.entries.len().min(255) as u8;
            page[12..16].copy_from_slice(&nsid.to_le_bytes());
        }
        page
    }

    /// Whether a Reservation Log Page Available notice waits.
    pub(crate) fn resv_notice_pending(&self) -> bool {
        self.resv_notice.load(Ordering::Acquire)
    }

    /// Takes the waiting reservation notice.
    pub(crate) fn take_resv_notice(&self) -> bool {
        self.resv_notice.swap(false, Ordering::AcqRel)
    }

    /// The Reservation Notification Mask.
    pub(crate) fn resv_mask(&self) -> u32 {
        self.resv_mask.load(Ordering::Relaxed)
    }

    /// Sets the Reservation Notification Mask (bits 1 to 3).
    pub(crate) fn set_resv_mask(&self, mask: u32) {
        self.resv_mask.store(mask & 0xe, Ordering::Relaxed);
    }

    /// An ANA state of its path changed: a notice waits for an AER.
    pub(crate) fn ana_changed(&self) {
        self.ana_notice.store(true, Ordering::Release);
    }

    /// Whether an ANA change notice waits (cheap: the admin queue reads it on every poll).
    pub(crate) fn ana_notice_pending(&self) -> bool {
        self.ana_notice.load(Ordering::Acquire)
    }

    /// Takes the waiting ANA change notice.
    pub(crate) fn take_ana_notice(&self) -> bool {
        self.ana_notice.swap(false, Ordering::AcqRel)
    }

    /// Namespace `nsid` was added or removed: the list grows and a notice waits for an AER.
    pub(crate) fn namespace_changed(&self, nsid: u32) {
        {
            let mut list = self.changed_ns.lock().unwrap_or_else(|e| e.into_inner());
            if list.first() != Some(&u32::MAX) && !list.contains(&nsid) {
                if list.len() == CHANGED_NS_MAX {
                    *list = vec![u32::MAX];
                } else {
                    list.push(nsid);
                    list.sort_unstable();
                }
            }
        }
        self.ns_notice.store(true, Ordering::Release);
    }

    /// Whether a Namespace Attribute Changed notice waits (cheap: the admin queue reads it on every poll).
    pub(crate) fn ns_notice_pending(&self) -> bool {
        self.ns_notice.load(Ordering::Acquire)
    }

    /// Takes the waiting notice (an AER is about to carry it).
    pub(crate) fn take_ns_notice(&self) -> bool {
        self.ns_notice.swap(false, Ordering::AcqRel)
    }

    /// The Changed Namespace List log page; `clear` (RAE 0) empties it.
    pub(crate) fn changed_ns_log(&self, clear: bool) -> Vec<u32> {
        let mut list = self.changed_ns.lock().unwrap_or_else(|e| e.into_inner());
        if clear {
            std::mem::take(&mut *list)
        } else {
            list.clone()
        }
    }

    #[cfg(test)]
    pub(crate) fn new_for_test(cntlid: u16) -> Self {
        Controller::new(
            cntlid,
            "nqn.test.host".into(),
            [0; 16],
            "127.0.0.1:4420".parse().expect("an address"),
            0,
            0,
            4,
        )
    }

    /// Keep Alive Timeout in milliseconds (0: off).
    pub(crate) fn kato_ms(&self) -> u32 {
        self.kato_ms.load(Ordering::Relaxed)
    }

    /// Sets the Keep Alive Timeout (Set Features Keep Alive Timer).
    pub(crate) fn set_kato_ms(&self, ms: u32) {
        self.kato_ms.store(ms, Ordering::Relaxed);
    }

    /// Records that a queue received a command at `now_ms`.
    ///
    /// Called once per poll that received something, by each queue; it writes the shared line only when the
    /// value moved by a millisecond or more, so queues on different reactors rarely contend for it.
    pub(crate) fn touch(&self, now_ms: u64) {
        if self.last_activity_ms.load(Ordering::Relaxed) < now_ms {
            self.last_activity_ms.store(now_ms, Ordering::Relaxed);
        }
    }

    /// Whether the keep-alive timer expired at `now_ms`.
    pub(crate) fn keep_alive_expired(&self, now_ms: u64) -> bool {
        let kato = u64::from(self.kato_ms());
        kato != 0 && now_ms.saturating_sub(self.last_activity_ms.load(Ordering::Relaxed)) > kato
    }

    /// When (in the target's milliseconds) the keep-alive timer expires unless a command comes first; `None`
    /// with keep-alive off.
    pub(crate) fn keep_alive_deadline_ms(&self) -> Option<u64> {
        let kato = u64::from(self.kato_ms());
        (kato != 0).then(|| self.last_activity_ms.load(Ordering::Relaxed) + kato + 1)
    }

    /// CSTS.RDY.
    pub(crate) fn is_ready(&self) -> bool {
        self.ready.load(Ordering::Acquire)
    }

    /// Sets CSTS.RDY (the admin queue's CC state machine does).
    pub(crate) fn set_ready(&self, ready: bool) {
        self.ready.store(ready, Ordering::Release);
    }

    /// Whether the controller was torn down.
    pub(crate) fn is_dead(&self) -> bool {
        self.dead.load(Ordering::Acquire)
    }

    /// Tears the controller down: its I/O queues close on their next poll.
    pub(crate) fn kill(&self) {
        self.dead.store(true, Ordering::Release);
        self.ready.store(false, Ordering::Release);
    }

    /// Claims I/O queue `qid`; `false` if it is out of range or already connected.
    pub(crate) fn claim_io_queue(&self, qid: u16) -> bool {
        let mut q = self.io_queues.lock().unwrap_or_else(|e| e.into_inner());
        match q.get_mut(usize::from(qid).wrapping_sub(1)) {
            Some(used) if !*used => {
                *used = true;
                true
            }
            _ => false,
        }
    }

    /// The number of I/O queues the controller allows.
    pub(crate) fn max_io_queues(&self) -> usize {
        self.io_queues
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .len()
    }

    /// Releases I/O queue `qid` (its connection closed).
    pub(crate) fn release_io_queue(&self, qid: u16) {
        let mut q = self.io_queues.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(used) = q.get_mut(usize::from(qid).wrapping_sub(1)) {
            *used = false;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn changed_namespaces_are_listed_once_and_cleared_by_a_read() {
        let c = Controller::new_for_test(1);
        assert!(!c.ns_notice_pending());
        c.namespace_changed(3);
        c.namespace_changed(1);
        c.namespace_changed(3);
        assert!(c.take_ns_notice());
        assert!(!c.take_ns_notice());
        assert_eq!(c.changed_ns_log(false), vec![1, 3]);
        assert_eq!(c.changed_ns_log(true), vec![1, 3]);
        assert!(c.changed_ns_log(false).is_empty());
        for id in 1..=2000 {
            c.namespace_changed(id);
        }
        assert_eq!(c.changed_ns_log(true), vec![u32::MAX]);
    }

    #[test]
    fn keep_alive_and_queue_claims() {
        let c = Controller::new(
            1,
            "h".into(),
            [0; 16],
            "127.0.0.1:4420".parse().unwrap(),
            100,
            1000,
            2,
        );
        assert!(!c.keep_alive_expired(1100));
        assert!(c.keep_alive_expired(1101));
        c.touch(1050);
        assert!(!c.keep_alive_expired(1150));
        c.set_kato_ms(0);
        assert!(!c.keep_alive_expired(u64::MAX));
        assert!(!c.claim_io_queue(0));
        assert!(c.claim_io_queue(2));
        assert!(!c.claim_io_queue(2));
        assert!(!c.claim_io_queue(3));
        c.release_io_queue(2);
        assert!(c.claim_io_queue(2));
    }
}
