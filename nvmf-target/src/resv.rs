//! Persistent reservations of one namespace: Reservation Register, Acquire (with preempt and preempt-and-abort),
//! Release (and clear) and Report, every reservation type, and the rules they put on I/O.
//!
//! Hosts are known by the 128-bit host identifier they gave in Connect, so a host's controllers (one per
//! listener, say) share one registration. The state lives with the namespace, which every controller of the
//! subsystem on every listener shares; a lock serialises the reservation commands, and I/O reads one flag
//! while no reservation is held.
//!
//! Persist Through Power Loss: on a file namespace the state can be kept in a file beside it
//! (`FILE.nvpoll-resv`, JSON, replaced atomically at every change while PTPL is on) and is read back when a
//! target opens the file again. Two target processes exporting one file do not share a reservation state:
//! the first to open the file takes `FILE.nvpoll-resv.lock`; the other exports the namespace without
//! reservations (Identify's RESCAP 0, the commands refused with Invalid Command Opcode) and says so at startup.
//! RAM, device and block-device namespaces (and files in a directory the target may not write) keep
//! reservations for as long as the target runs (PTPL off, not settable).

use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use nvpoll::spec::Status;
use serde::{Deserialize, Serialize};

/// Write Exclusive.
pub(crate) const WRITE_EXCLUSIVE: u8 = 1;
/// Exclusive Access.
pub(crate) const EXCLUSIVE_ACCESS: u8 = 2;
/// Write Exclusive - Registrants Only.
pub(crate) const WRITE_EXCLUSIVE_REG_ONLY: u8 = 3;
/// Exclusive Access - Registrants Only.
pub(crate) const EXCLUSIVE_ACCESS_REG_ONLY: u8 = 4;
/// Write Exclusive - All Registrants.
pub(crate) const WRITE_EXCLUSIVE_ALL_REGS: u8 = 5;
/// Exclusive Access - All Registrants.
pub(crate) const EXCLUSIVE_ACCESS_ALL_REGS: u8 = 6;

/// Reservation notification log page types.
pub(crate) const NOTICE_REGISTRATION_PREEMPTED: u8 = 1;
pub(crate) const NOTICE_RESERVATION_RELEASED: u8 = 2;
pub(crate) const NOTICE_RESERVATION_PREEMPTED: u8 = 3;

/// Ignore Existing Key (command dword 10 bit 3).
const IEKEY: u32 = 1 << 3;

/// A host that must be told something about this namespace: its host identifier and the notice type.
pub(crate) type Notify = (HostId, u8);

/// A 128-bit host identifier.
pub(crate) type HostId = [u8; 16];

fn conflict() -> Status {
    Status::RESERVATION_CONFLICT.with_dnr()
}

fn invalid_field() -> Status {
    Status::INVALID_FIELD.with_dnr()
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct State {
    generation: u32,
    /// Registered hosts, in order of registration.
    regs: Vec<(HostId, u64)>,
    /// The holder (for the All Registrants types, the registrant that stands for all) and the type.
    holder: Option<(HostId, u8)>,
    ptpl: bool,
}

impl State {
    fn key_of(&self, host: &HostId) -> Option<u64> {
        self.regs.iter().find(|(h, _)| h == host).map(|&(_, k)| k)
    }

    fn all_registrants(&self) -> bool {
        matches!(
            self.holder,
            Some((_, WRITE_EXCLUSIVE_ALL_REGS | EXCLUSIVE_ACCESS_ALL_REGS))
        )
    }

    /// Whether `host` holds the reservation (every registrant does, for the All Registrants types).
    fn holds(&self, host: &HostId) -> bool {
        match self.holder {
            None => false,
            Some(_) if self.all_registrants() => self.key_of(host).is_some(),
            Some((h, _)) => h == *host,
        }
    }

    /// Removes `host`'s registration; a reservation it held goes (or passes to another registrant, for the
    /// All Registrants types). Notices for the others go to `notify`.
    fn unregister(&mut self, host: &HostId, notify: &mut Vec<Notify>) {
        self.regs.retain(|(h, _)| h != host);
        let Some((holder, rtype)) = self.holder else {
            return;
        };
        if holder != *host {
            return;
        }
        if self.all_registrants() {
            self.holder = self.regs.first().map(|&(h, _)| (h, rtype));
        } else {
            self.holder = None;
            if matches!(rtype, WRITE_EXCLUSIVE_REG_ONLY | EXCLUSIVE_ACCESS_REG_ONLY) {
                self.released(host, notify);
            }
        }
    }

    /// The reservation was released: the other registrants are told.
    fn released(&self, by: &HostId, notify: &mut Vec<Notify>) {
        for (h, _) in &self.regs {
            if h != by {
                notify.push((*h, NOTICE_RESERVATION_RELEASED));
            }
        }
    }

    /// Unregisters every host registered with `key` (other than `except`), telling them; `false` if none was.
    fn unregister_by_key(
        &mut self,
        key: u64,
        except: Option<&HostId>,
        sender: &HostId,
        notify: &mut Vec<Notify>,
    ) -> bool {
        let victims: Vec<HostId> = self
            .regs
            .iter()
            .filter(|(h, k)| *k == key && Some(h) != except)
            .map(|&(h, _)| h)
            .collect();
        for h in &victims {
            self.unregister(h, notify);
            if h != sender {
                notify.push((*h, NOTICE_REGISTRATION_PREEMPTED));
            }
        }
        !victims.is_empty()
    }
}

/// The saved form of the state (PTPL).
#[derive(Serialize, Deserialize)]
struct Saved {
    generation: u32,
    registrants: Vec<SavedRegistrant>,
    holder: Option<SavedHolder>,
}

#[derive(Serialize, Deserialize)]
struct SavedRegistrant {
    hostid: String,
    rkey: u64,
}

#[derive(Serialize, Deserialize)]
struct SavedHolder {
    hostid: String,
    rtype: u8,
}

fn hex(id: &HostId) -> String {
    id.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Option<HostId> {
    if s.len() != 32 {
        return None;
    }
    let mut id = [0u8; 16];
    for (i, b) in id.iter_mut().enumerate() {
        *b = u8::from_str_radix(s.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(id)
}

/// The reservations of one namespace.
#[derive(Debug)]
pub(crate) struct Reservations {
    state: Mutex<State>,
    /// A reservation is held: I/O must be checked against it.
    held: AtomicBool,
    /// The state file and the lock that makes this process its only writer (file namespaces).
    persist: Option<(PathBuf, File)>,
    /// Why this namespace has no reservations here, if it has none.
    off: Option<String>,
}

impl Reservations {
    /// Reservations kept in memory only (RAM and device namespaces).
    pub(crate) fn in_memory() -> Reservations {
        Reservations {
            state: Mutex::new(State::default()),
            held: AtomicBool::new(false),
            persist: None,
            off: None,
        }
    }

    /// Reservations of the namespace in file `path`: the state file beside it is read if it is there, and
    /// written while PTPL is on. If another process has the file's lock, reservations are off here.
    pub(crate) fn for_file(path: &Path) -> io::Result<Reservations> {
        let state_path = PathBuf::from(format!("{}.nvpoll-resv", path.display()));
        let lock_path = PathBuf::from(format!("{}.nvpoll-resv.lock", path.display()));
        // A block device keeps its reservations in memory: no state files beside it in /dev.
        if !std::fs::metadata(path)?.is_file() {
            return Ok(Reservations::in_memory());
        }
        let lock = match std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
        {
            Ok(f) => f,
            // A directory we may not write: no persistence, reservations in memory.
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::PermissionDenied | io::ErrorKind::ReadOnlyFilesystem
                ) =>
            {
                return Ok(Reservations::in_memory())
            }
            Err(e) => return Err(e),
        };
        if let Err(e) =
            rustix::fs::flock(&lock, rustix::fs::FlockOperation::NonBlockingLockExclusive)
        {
            if e == rustix::io::Errno::WOULDBLOCK {
                let mut r = Reservations::in_memory();
                r.off = Some(format!(
                    "another process holds {} (it exports this file too, and two processes cannot share \
                     one reservation state)",
                    lock_path.display()
                ));
                return Ok(r);
            }
            return Err(e.into());
        }
        let mut state = State::default();
        match std::fs::read(&state_path) {
            Ok(bytes) => {
                let saved: Saved = serde_json::from_slice(&bytes).map_err(|e| {
                    io::Error::new(
                        io::ErrorKind::InvalidData,
                        format!("{}: {e}", state_path.display()),
                    )
                })?;
                state.generation = saved.generation;
                state.ptpl = true;
                for r in saved.registrants {
                    let id = unhex(&r.hostid).ok_or_else(|| {
                        io::Error::new(
                            io::ErrorKind::InvalidData,
                            format!(
                                "{}: bad host identifier {:?}",
                                state_path.display(),
                                r.hostid
                            ),
                        )
                    })?;
                    state.regs.push((id, r.rkey));
                }
                if let Some(h) = saved.holder {
                    let id = unhex(&h.hostid).filter(|id| state.key_of(id).is_some());
                    if id.is_none() || !(1..=6).contains(&h.rtype) {
                        return Err(io::Error::new(
                            io::ErrorKind::InvalidData,
                            format!("{}: bad holder", state_path.display()),
                        ));
                    }
                    state.holder = id.map(|id| (id, h.rtype));
                }
            }
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(e),
        }
        let held = state.holder.is_some();
        Ok(Reservations {
            state: Mutex::new(state),
            held: AtomicBool::new(held),
            persist: Some((state_path, lock)),
            off: None,
        })
    }

    fn describe_file(&self) -> String {
        self.persist
            .as_ref()
            .map_or_else(String::new, |(p, _)| p.display().to_string())
    }

    /// Why reservations are off for this namespace in this process, if they are.
    pub(crate) fn off(&self) -> Option<&str> {
        self.off.as_deref()
    }

    /// Identify Namespace RESCAP: every type, Ignore Existing Key as NVMe 1.3 defines it, and PTPL where the
    /// state can persist; 0 when reservations are off.
    pub(crate) fn rescap(&self) -> u8 {
        if self.off.is_some() {
            return 0;
        }
        0x80 | 0x7e | u8::from(self.persist.is_some())
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The status an I/O command from `host` gets because of a reservation; `None` when it may run. `write`:
    /// the write command group (Write, Write Zeroes, Dataset Management, Flush); otherwise a read.
    #[inline]
    pub(crate) fn access(&self, host: &HostId, write: bool) -> Option<Status> {
        if !self.held.load(Ordering::Acquire) {
            return None;
        }
        self.access_slow(host, write)
    }

    #[cold]
    fn access_slow(&self, host: &HostId, write: bool) -> Option<Status> {
        let s = self.lock();
        let (_, rtype) = s.holder?;
        if s.holds(host) {
            return None;
        }
        let registered = s.key_of(host).is_some();
        let refused = match rtype {
            WRITE_EXCLUSIVE => write,
            EXCLUSIVE_ACCESS => true,
            WRITE_EXCLUSIVE_REG_ONLY | WRITE_EXCLUSIVE_ALL_REGS => write && !registered,
            _ => !registered,
        };
        refused.then(conflict)
    }

    /// Runs `f` on the state; on success the generation moves if `bump`, the held flag follows, and the state
    /// is saved while PTPL is on.
    fn change(
        &self,
        bump: bool,
        f: impl FnOnce(&mut State, &mut Vec<Notify>) -> Result<(), Status>,
    ) -> Result<Vec<Notify>, Status> {
        if self.off.is_some() {
            return Err(Status::INVALID_OPCODE.with_dnr());
        }
        let mut s = self.lock();
        let before = s.clone();
        let mut notify = Vec::new();
        f(&mut s, &mut notify)?;
        if bump {
            s.generation = s.generation.wrapping_add(1);
        }
        self.held.store(s.holder.is_some(), Ordering::Release);
        if *s != before {
            if let Err(e) = self.save(&s, before.ptpl) {
                // The change stands in memory; a host that asked for persistence must hear it failed.
                eprintln!(
                    "nvpoll-target: reservations: saving {} failed: {e}",
                    self.describe_file()
                );
                return Err(Status::INTERNAL_ERROR);
            }
        }
        Ok(notify)
    }

    fn save(&self, s: &State, was_persistent: bool) -> io::Result<()> {
        let Some((path, _)) = &self.persist else {
            return Ok(());
        };
        if !s.ptpl {
            if was_persistent {
                match std::fs::remove_file(path) {
                    Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
                    _ => {}
                }
            }
            return Ok(());
        }
        let saved = Saved {
            generation: s.generation,
            registrants: s
                .regs
                .iter()
                .map(|(h, k)| SavedRegistrant {
                    hostid: hex(h),
                    rkey: *k,
                })
                .collect(),
            holder: s.holder.map(|(h, t)| SavedHolder {
                hostid: hex(&h),
                rtype: t,
            }),
        };
        let tmp = PathBuf::from(format!("{}.tmp", path.display()));
        {
            let mut f = File::create(&tmp)?;
            io::Write::write_all(&mut f, &serde_json::to_vec_pretty(&saved)?)?;
            f.sync_all()?;
        }
        std::fs::rename(&tmp, path)?;
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            File::open(dir)?.sync_all()?;
        }
        Ok(())
    }

    /// Reservation Register. `data`: CRKEY, NRKEY.
    pub(crate) fn register(
        &self,
        host: &HostId,
        cdw10: u32,
        data: &[u8],
    ) -> Result<Vec<Notify>, Status> {
        let (crkey, nrkey) = (u64_at(data, 0), u64_at(data, 8));
        let iekey = cdw10 & IEKEY != 0;
        let cptpl = cdw10 >> 30;
        if cptpl == 1 || (cptpl == 3 && self.persist.is_none()) {
            return Err(invalid_field());
        }
        self.change(true, |s, notify| {
            match cdw10 & 7 {
                0 => match s.key_of(host) {
                    Some(k) if k != nrkey => return Err(conflict()),
                    Some(_) => {}
                    None => s.regs.push((*host, nrkey)),
                },
                1 => match s.key_of(host) {
                    Some(k) if iekey || k == crkey => s.unregister(host, notify),
                    _ => return Err(conflict()),
                },
                2 => match s.key_of(host) {
                    Some(k) if iekey || k == crkey => {
                        for r in s.regs.iter_mut().filter(|(h, _)| h == host) {
                            r.1 = nrkey;
                        }
                    }
                    _ => return Err(conflict()),
                },
                _ => return Err(invalid_field()),
            }
            match cptpl {
                2 => s.ptpl = false,
                3 => s.ptpl = true,
                _ => {}
            }
            Ok(())
        })
    }

    /// Reservation Acquire. `data`: CRKEY, PRKEY.
    pub(crate) fn acquire(
        &self,
        host: &HostId,
        cdw10: u32,
        data: &[u8],
    ) -> Result<Vec<Notify>, Status> {
        let (crkey, prkey) = (u64_at(data, 0), u64_at(data, 8));
        let rtype = (cdw10 >> 8) as u8;
        let action = cdw10 & 7;
        if cdw10 & IEKEY != 0 || !(1..=6).contains(&rtype) || action > 2 {
            return Err(invalid_field());
        }
        self.change(action != 0, |s, notify| {
            if s.key_of(host) != Some(crkey) {
                return Err(conflict());
            }
            if action == 0 {
                return match s.holder {
                    None => {
                        s.holder = Some((*host, rtype));
                        Ok(())
                    }
                    Some((_, t)) if s.holds(host) && t == rtype => Ok(()),
                    Some(_) => Err(conflict()),
                };
            }
            // Preempt, and preempt and abort: this target has no command running on the namespace between
            // polls (each completes before the next is read), so there is nothing left to abort.
            let Some((holder, old_type)) = s.holder else {
                return if s.unregister_by_key(prkey, None, host, notify) {
                    Ok(())
                } else {
                    Err(conflict())
                };
            };
            if s.all_registrants() {
                if prkey == 0 {
                    s.holder = Some((*host, rtype));
                    let others: Vec<HostId> = s
                        .regs
                        .iter()
                        .map(|&(h, _)| h)
                        .filter(|h| h != host)
                        .collect();
                    for h in others {
                        s.regs.retain(|(r, _)| *r != h);
                        notify.push((h, NOTICE_REGISTRATION_PREEMPTED));
                    }
                    return Ok(());
                }
                return if s.unregister_by_key(prkey, None, host, notify) {
                    Ok(())
                } else {
                    Err(conflict())
                };
            }
            if holder == *host {
                // The holder changes its own reservation's type.
                s.holder = Some((*host, rtype));
                if old_type != rtype {
                    s.released(host, notify);
                }
                return Ok(());
            }
            let holder_key = s.key_of(&holder);
            if holder_key == Some(prkey) {
                s.holder = Some((*host, rtype));
                s.unregister_by_key(prkey, Some(host), host, notify);
                for (h, _) in &s.regs {
                    if h != host {
                        notify.push((*h, NOTICE_RESERVATION_PREEMPTED));
                    }
                }
                if old_type != rtype {
                    s.released(host, notify);
                }
                return Ok(());
            }
            if prkey == 0 {
                return Err(invalid_field());
            }
            if s.unregister_by_key(prkey, None, host, notify) {
                Ok(())
            } else {
                Err(conflict())
            }
        })
    }

    /// Reservation Release (action 0) or Clear (1). `data`: CRKEY.
    pub(crate) fn release(
        &self,
        host: &HostId,
        cdw10: u32,
        data: &[u8],
    ) -> Result<Vec<Notify>, Status> {
        let crkey = u64_at(data, 0);
        let rtype = (cdw10 >> 8) as u8;
        let action = cdw10 & 7;
        if cdw10 & IEKEY != 0 || action > 1 {
            return Err(invalid_field());
        }
        self.change(action == 1, |s, notify| {
            if s.key_of(host) != Some(crkey) {
                return Err(conflict());
            }
            if action == 1 {
                for (h, _) in &s.regs {
                    if h != host {
                        notify.push((*h, NOTICE_RESERVATION_PREEMPTED));
                    }
                }
                s.regs.clear();
                s.holder = None;
                return Ok(());
            }
            let Some((_, t)) = s.holder else {
                return Ok(());
            };
            if !s.holds(host) {
                return Ok(());
            }
            if t != rtype {
                return Err(invalid_field());
            }
            s.holder = None;
            if t != WRITE_EXCLUSIVE && t != EXCLUSIVE_ACCESS {
                s.released(host, notify);
            }
            Ok(())
        })
    }

    /// Reservation Report: the status data structure, extended (128-bit host identifiers) with `eds`, cut to
    /// `len` bytes. Without `eds` every registrant's identifier must fit in 64 bits (its upper half zero).
    pub(crate) fn report(&self, eds: bool, len: usize) -> Result<Vec<u8>, Status> {
        if self.off.is_some() {
            return Err(Status::INVALID_OPCODE.with_dnr());
        }
        let s = self.lock();
        let (header, entry) = if eds { (64, 64) } else { (24, 24) };
        if !eds && s.regs.iter().any(|(h, _)| h[8..] != [0; 8]) {
            return Err(Status::HOST_ID_INCONSISTENT_FORMAT.with_dnr());
        }
        let mut b = vec![0u8; header + entry * s.regs.len()];
        b[0..4].copy_from_slice(&s.generation.to_le_bytes());
        b[4] = s.holder.map_or(0, |(_, t)| t);
        b[5..7].copy_from_slice(&(s.regs.len() as u16).to_le_bytes());
        b[9] = u8::from(s.ptpl);
        for (i, (h, k)) in s.regs.iter().enumerate() {
            let e = &mut b[header + entry * i..header + entry * (i + 1)];
            // The dynamic controller model: no one controller stands for the host.
            e[0..2].copy_from_slice(&0xffffu16.to_le_bytes());
            e[2] = u8::from(s.holds(h));
            if eds {
                e[8..16].copy_from_slice(&k.to_le_bytes());
                e[16..32].copy_from_slice(h);
            } else {
                e[8..16].copy_from_slice(&h[..8]);
                e[16..24].copy_from_slice(&k.to_le_bytes());
            }
        }
        b.truncate(len);
        Ok(b)
    }

    /// Persist Through Power Loss, for Get Features (Reservation Persistence).
    pub(crate) fn ptpl(&self) -> bool {
        self.lock().ptpl
    }

    /// Set Features (Reservation Persistence): `false` where the state cannot persist.
    pub(crate) fn set_ptpl(&self, on: bool) -> Result<(), Status> {
        if on && self.persist.is_none() {
            return Err(invalid_field());
        }
        self.change(false, |s, _| {
            s.ptpl = on;
            Ok(())
        })
        .map(|_| ())
    }
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut x = [0u8; 8];
    if let Some(s) = b.get(at..at + 8) {
        x.copy_from_slice(s);
    }
    u64::from_le_bytes(x)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn keys(crkey: u64, other: u64) -> Vec<u8> {
        [crkey.to_le_bytes(), other.to_le_bytes()].concat()
    }

    const A: HostId = [0xa; 16];
    const B: HostId = [0xb; 16];
    const C: HostId = [0xc; 16];

    #[test]
    fn register_acquire_release_and_access() {
        let r = Reservations::in_memory();
        assert!(
            r.access(&A, true).is_none(),
            "no reservation: all may write"
        );
        r.register(&A, 0, &keys(0, 1)).unwrap();
        r.register(&B, 0, &keys(0, 2)).unwrap();
        // Registering again with another key conflicts; with the same key it is fine.
        assert_eq!(r.register(&A, 0, &keys(0, 9)), Err(conflict()));
        r.register(&A, 0, &keys(0, 1)).unwrap();
        // Acquire needs the host's own key.
        assert_eq!(
            r.acquire(&A, (WRITE_EXCLUSIVE as u32) << 8, &keys(2, 0)),
            Err(conflict())
        );
        r.acquire(&A, (WRITE_EXCLUSIVE as u32) << 8, &keys(1, 0))
            .unwrap();
        assert!(r.access(&A, true).is_none());
        assert_eq!(
            r.access(&B, true),
            Some(conflict()),
            "write exclusive: B may not write"
        );
        assert!(r.access(&B, false).is_none(), "but may read");
        assert!(r.access(&C, false).is_none());
        // B cannot acquire while A holds it; releasing with the wrong type is refused.
        assert_eq!(
            r.acquire(&B, (WRITE_EXCLUSIVE as u32) << 8, &keys(2, 0)),
            Err(conflict())
        );
        assert_eq!(
            r.release(&A, (EXCLUSIVE_ACCESS as u32) << 8, &keys(1, 0)),
            Err(invalid_field())
        );
        r.release(&A, (WRITE_EXCLUSIVE as u32) << 8, &keys(1, 0))
            .unwrap();
        assert!(r.access(&B, true).is_none());
        let rep = r.report(true, 4096).unwrap();
        assert_eq!(u16::from_le_bytes([rep[5], rep[6]]), 2);
        assert_eq!(rep[4], 0, "no reservation type");
    }

    #[test]
    fn registrants_only_and_all_registrants() {
        let r = Reservations::in_memory();
        r.register(&A, 0, &keys(0, 1)).unwrap();
        r.register(&B, 0, &keys(0, 2)).unwrap();
        r.acquire(&A, (EXCLUSIVE_ACCESS_REG_ONLY as u32) << 8, &keys(1, 0))
            .unwrap();
        assert!(
            r.access(&B, false).is_none() && r.access(&B, true).is_none(),
            "a registrant may"
        );
        assert_eq!(
            r.access(&C, false),
            Some(conflict()),
            "a stranger may not even read"
        );
        // Unregistering the holder of a Registrants Only reservation releases it, and B hears of it.
        let n = r.register(&A, 1, &keys(1, 0)).unwrap();
        assert_eq!(n, vec![(B, NOTICE_RESERVATION_RELEASED)]);
        assert!(r.access(&C, true).is_none());
        // All registrants: every registrant holds it; it stays while one is left.
        r.register(&A, 0, &keys(0, 1)).unwrap();
        r.acquire(&B, (WRITE_EXCLUSIVE_ALL_REGS as u32) << 8, &keys(2, 0))
            .unwrap();
        let rep = r.report(true, 4096).unwrap();
        assert_eq!(rep[4], WRITE_EXCLUSIVE_ALL_REGS);
        assert_eq!((rep[64 + 2], rep[128 + 2]), (1, 1), "both hold it");
        r.register(&B, 1, &keys(2, 0)).unwrap();
        assert_eq!(r.access(&C, true), Some(conflict()));
        assert!(r.access(&A, true).is_none());
    }

    #[test]
    fn preempt_takes_the_reservation_and_fences_the_holder() {
        let r = Reservations::in_memory();
        r.register(&A, 0, &keys(0, 1)).unwrap();
        r.register(&B, 0, &keys(0, 2)).unwrap();
        r.acquire(&A, (WRITE_EXCLUSIVE as u32) << 8, &keys(1, 0))
            .unwrap();
        let gen = u32::from_le_bytes(r.report(true, 4).unwrap()[..4].try_into().unwrap());
        // B preempts A (PRKEY = A's key): A is unregistered and told; B holds an Exclusive Access.
        let n = r.acquire(&B, 2 << 8 | 2, &keys(2, 1)).unwrap();
        assert!(n.contains(&(A, NOTICE_REGISTRATION_PREEMPTED)));
        assert_eq!(r.access(&A, false), Some(conflict()));
        assert!(r.access(&B, true).is_none());
        let rep = r.report(true, 4096).unwrap();
        assert_eq!(u32::from_le_bytes(rep[..4].try_into().unwrap()), gen + 1);
        assert_eq!(
            u16::from_le_bytes([rep[5], rep[6]]),
            1,
            "only B is registered"
        );
        // A, fenced, cannot take it back with its old key.
        assert_eq!(r.acquire(&A, 2 << 8 | 1, &keys(1, 2)), Err(conflict()));
        // PRKEY 0 against a holder that is not all registrants is an invalid field.
        r.register(&C, 0, &keys(0, 3)).unwrap();
        assert_eq!(r.acquire(&C, 2 << 8 | 1, &keys(3, 0)), Err(invalid_field()));
        // Clear: everyone goes, and the others hear it.
        let n = r.release(&B, 1, &keys(2, 0)).unwrap();
        assert_eq!(n, vec![(C, NOTICE_RESERVATION_PREEMPTED)]);
        assert_eq!(r.report(true, 4096).unwrap().len(), 64);
    }

    #[test]
    fn report_formats_and_host_identifier_sizes() {
        let r = Reservations::in_memory();
        let mut short = [0u8; 16];
        short[..8].copy_from_slice(&0x1122_3344_5566_7788u64.to_le_bytes());
        r.register(&short, 0, &keys(0, 5)).unwrap();
        let rep = r.report(false, 4096).unwrap();
        assert_eq!(rep.len(), 48);
        assert_eq!(&rep[24 + 8..24 + 16], &short[..8]);
        assert_eq!(
            u64::from_le_bytes(rep[24 + 16..24 + 24].try_into().unwrap()),
            5
        );
        r.register(&A, 0, &keys(0, 6)).unwrap();
        assert_eq!(
            r.report(false, 4096),
            Err(Status::HOST_ID_INCONSISTENT_FORMAT.with_dnr())
        );
        let rep = r.report(true, 100).unwrap();
        assert_eq!(rep.len(), 100, "cut to the transfer");
    }

    #[test]
    fn ptpl_state_survives_reopening_and_a_second_opener_is_refused() {
        let dir = std::env::temp_dir().join(format!("nvpoll-resv-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("ns.img");
        std::fs::write(&file, [0u8; 4096]).unwrap();
        {
            let r = Reservations::for_file(&file).unwrap();
            assert_eq!(r.rescap() & 1, 1, "PTPL capable");
            // CPTPL 3: persist.
            r.register(&A, 3 << 30, &keys(0, 7)).unwrap();
            r.acquire(&A, (EXCLUSIVE_ACCESS as u32) << 8, &keys(7, 0))
                .unwrap();
            let other = Reservations::for_file(&file).unwrap();
            assert!(
                other.off().is_some(),
                "the second opener has no reservations"
            );
            assert_eq!(other.rescap(), 0);
            assert_eq!(
                other.register(&B, 0, &keys(0, 1)),
                Err(Status::INVALID_OPCODE.with_dnr())
            );
        }
        let r = Reservations::for_file(&file).unwrap();
        assert!(r.ptpl());
        assert_eq!(
            r.access(&B, false),
            Some(conflict()),
            "the reservation came back"
        );
        assert!(r.access(&A, true).is_none());
        // PTPL off: the state file goes, and a reopening starts empty.
        r.set_ptpl(false).unwrap();
        drop(r);
        let r = Reservations::for_file(&file).unwrap();
        assert!(!r.ptpl() && r.access(&B, true).is_none());
        drop(r);
        // RAM cannot persist.
        assert_eq!(
            Reservations::in_memory().register(&A, 3 << 30, &keys(0, 1)),
            Err(invalid_field())
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
