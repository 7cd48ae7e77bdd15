//! Timers (the connect deadline, keep-alive, a removed subsystem or dead controller, the authentication step)
//! and what can wake a sleeping reactor for a session.

use std::time::{Duration, Instant};

use nvpoll::reactor::WakeSources;

use crate::events::TargetEvent;

use super::{Connected, Session, State};

impl Session {
    /// What can give this session work while its reactor sleeps (hybrid idle mode): its socket, and the
    /// deadline of its next timer (connect, keep-alive, closing). Changes made elsewhere (a stop, a removed
    /// subsystem, a torn-down controller, a namespace notice) wake the reactors through
    /// [`TargetShared::wake_all`](crate::shared::TargetShared::wake_all). Returns `false` while a flush runs
    /// on the flusher thread, which does not wake anyone: the session is then polled.
    pub(crate) fn wake_sources<'a>(&'a self, w: &mut WakeSources<'a>) -> bool {
        self.wake_sources_with(w, true)
    }

    /// [`Session::wake_sources`] without the socket's readability, for a group that watches the socket in an
    /// epoll set of its own; `false` also while it has bytes to send (the group polls it).
    pub(crate) fn wake_timers<'a>(&'a self, w: &mut WakeSources<'a>) -> bool {
        self.wake_sources_with(w, false)
    }

    fn wake_sources_with<'a>(&'a self, w: &mut WakeSources<'a>, socket: bool) -> bool {
        if self.flushing > 0 || self.auth_jobs > 0 {
            return false;
        }
        if let Some(deadline) = self.state.queue().and_then(|q| q.auth_deadline) {
            w.deadline(deadline);
        }
        if socket {
            self.conn.wake_sources(w);
        } else if self.conn.wants_flush() {
            return false;
        }
        if let Some((_, deadline)) = &self.closing {
            w.deadline(*deadline);
            return true;
        }
        if let Some(until) = self.state.disconnected() {
            w.deadline(until);
        }
        match &self.state {
            State::Setup(setup) => w.deadline(setup.connect_deadline),
            State::Connected(Connected { queue: q, .. }) if q.qid == 0 => {
                if let Some(ms) = q.ctrl.keep_alive_deadline_ms() {
                    w.deadline(self.target.epoch + Duration::from_millis(ms));
                }
            }
            State::Connected(_) => {}
        }
        true
    }

    /// Timers: the connect deadline, the keep-alive timeout on the admin queue, and the controller's death on
    /// I/O queues. Returns why the connection must close.
    pub(super) fn check_timers(&mut self, now_ms: u64) -> Option<String> {
        if self.target.stopping() {
            return Some("target stopping".into());
        }
        let q = match &self.state {
            State::Connected(c) => &c.queue,
            State::Setup(setup) => {
                return (Instant::now() >= setup.connect_deadline).then(|| {
                    format!(
                        "no ICReq and Connect within {:?}",
                        self.target.limits.connect_timeout
                    )
                });
            }
        };
        if q.subsys.is_removed() {
            return Some(format!("subsystem {} was removed", q.subsys.nqn));
        }
        if let (Some(a), Some(deadline)) = (&q.auth, q.auth_deadline) {
            if (a.in_progress() || !a.authenticated()) && Instant::now() >= deadline {
                let why = format!(
                    "DH-HMAC-CHAP: the host sent no next authentication message within {:?} ({a:?})",
                    q.auth_step
                );
                self.emit_auth_failed(&why);
                return Some(why);
            }
        }
        if q.qid == 0 {
            // Torn down from outside (a new I/O queue count): the host reconnects.
            if q.ctrl.is_dead() {
                return Some(format!("controller {} was torn down", q.ctrl.cntlid));
            }
            // Before the admin queue authenticated, the authentication's own deadline bounds it: a host can
            // send no Keep Alive then, and its first DH-HMAC-CHAP transaction may wait for its crypto
            // modules to load (seconds in an emulated guest).
            if q.authenticated() && q.ctrl.keep_alive_expired(now_ms) {
                self.target.emit(&TargetEvent::KeepAliveExpired {
                    peer: self.peer,
                    subnqn: &q.subsys.nqn,
                    cntlid: q.ctrl.cntlid,
                    kato_ms: q.ctrl.kato_ms(),
                });
                self.target
                    .stats
                    .keep_alive_expired
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                return Some(format!(
                    "keep-alive timeout ({} ms) expired",
                    q.ctrl.kato_ms()
                ));
            }
        } else if q.ctrl.is_dead() {
            return Some(format!("controller {} was torn down", q.ctrl.cntlid));
        }
        if now_ms >= self.next_key_check_ms {
            // A key's age is checked once a second (cheap: its count is checked at every record).
            self.next_key_check_ms = now_ms + 1000;
            if let Err(e) = self.conn.renew_keys_if_due(Instant::now()) {
                self.note_conn_failure(&e);
                return Some(super::close_reason(&e));
            }
        }
        None
    }
}
