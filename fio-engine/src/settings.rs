//! The engine's options (fio's `--enghelp` lists them), checked once per job.

use std::net::SocketAddr;

use nvpoll::send::SendMode;
use nvpoll::trid::TransportId;
use nvpoll_tcp::host::ConnectOptions;
use nvpoll_tcp::multipath::PathPolicy;

use crate::error::Error;

/// One engine option: its name, fio's short label, its default and its help text, as fio shows them.
pub struct OptionDoc {
    /// The option's name in a job file.
    pub name: &'static str,
    /// Another name fio accepts for it (SPDK's plugin's name), if any.
    pub alias: Option<&'static str>,
    /// fio's label.
    pub lname: &'static str,
    /// The default, if any.
    pub default: Option<&'static str>,
    /// The help text.
    pub help: &'static str,
}

/// Every engine option, in the order of [`RawOptions`]'s fields.
pub const OPTIONS: [OptionDoc; 9] = [
    OptionDoc {
        name: "hostnqn",
        alias: None,
        lname: "NVMe host NQN",
        default: None,
        help: "Host NQN to present (default: the filename's hostnqn=, else /etc/nvme/hostnqn, else one \
               derived from the machine's UUID)",
    },
    OptionDoc {
        name: "psk_path",
        alias: None,
        lname: "NVMe/TCP TLS PSK file",
        default: None,
        help: "File holding a TLS 1.3 PSK in the NVMe interchange format (NVMeTLSkey-1:01:...:): every \
               queue runs TLS with the identity derived from it (NVMe0R01 HOSTNQN SUBNQN)",
    },
    OptionDoc {
        name: "send_mode",
        alias: None,
        lname: "NVMe/TCP send mode",
        default: Some("deferred"),
        help: "When a queue sends what it posted: deferred (when fio reaps: everything queued since, in \
               one write and, with TLS, few 16 KiB records), inline (from queue) or adaptive (inline \
               while idle, deferred under load)",
    },
    OptionDoc {
        name: "digest",
        alias: Some("digest_enable"),
        lname: "NVMe/TCP digests",
        default: Some("none"),
        help: "CRC32C digests to ask for: none, header, data or both",
    },
    OptionDoc {
        name: "dhchap_secret",
        alias: None,
        lname: "DH-HMAC-CHAP host secret",
        default: None,
        help: "DH-HMAC-CHAP host secret (DHHC-1:hh:...:) or a file holding it: every queue \
               authenticates in band when the controller asks",
    },
    OptionDoc {
        name: "dhchap_ctrl_secret",
        alias: None,
        lname: "DH-HMAC-CHAP controller secret",
        default: None,
        help: "With dhchap_secret: the controller's secret (or a file), to authenticate the controller \
               too (bidirectional)",
    },
    OptionDoc {
        name: "paths",
        alias: None,
        lname: "NVMe/TCP multipath",
        default: None,
        help: "More paths to the same subsystem, comma-separated ADDR:PORT ([ADDR]:PORT for IPv6): the \
               filename's controller and these are joined into one multipath controller, and each job's \
               queue fails over between them",
    },
    OptionDoc {
        name: "path_policy",
        alias: None,
        lname: "NVMe/TCP multipath policy",
        default: Some("queue-depth"),
        help: "With paths: where each command goes, queue-depth (the path with the fewest outstanding) \
               or round-robin",
    },
    OptionDoc {
        name: "idle",
        alias: None,
        lname: "What a reaping job does when nothing completed",
        default: Some("yield"),
        help: "spin (poll without pause: lowest latency when each job has a CPU of its own; with more \
               jobs than CPUs the jobs yield instead, and the engine says so) or yield (sched_yield between \
               empty polls: for more jobs than cores, as numjobs=128)",
    },
];

/// The options as fio parsed them (strings, `None` when unset), in [`OPTIONS`] order.
#[derive(Clone, Debug, Default)]
pub struct RawOptions(pub [Option<String>; OPTIONS.len()]);

/// What a reaping job does when a poll found nothing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Idle {
    /// Poll again at once.
    Spin,
    /// `sched_yield` first.
    Yield,
}

impl Idle {
    /// What a job that asked for `self` does while `jobs` jobs of this fio process are open and it may run on
    /// `cpus` CPUs. A spinning job keeps its CPU for its whole time slice, so at iodepth 1 a core of spinning
    /// jobs completes one I/O per round trip to the target whichever job holds it: what one job does
    /// (measured in docs/fio.md; SPDK's plugin, which always spins, does the same). With more jobs than CPUs, `spin` therefore yields between empty polls as
    /// `yield` does; with a CPU a job it spins.
    pub fn for_cpus(self, jobs: usize, cpus: usize) -> Idle {
        if self == Idle::Spin && jobs > cpus {
            Idle::Yield
        } else {
            self
        }
    }

    /// What the engine tells a user whose spinning jobs yield ([`Idle::for_cpus`]).
    pub fn spin_advice(jobs: usize, cpus: usize) -> String {
        let s = if cpus == 1 { "" } else { "s" };
        format!(
            "nvpoll: idle=spin with {jobs} jobs on {cpus} CPU{s}: the jobs yield between empty polls instead \
             (a spinning job keeps its CPU for its whole time slice, so at a low iodepth the CPU would complete \
             about one I/O per round trip whichever job holds it); spin needs a CPU per job (cpus_allowed)"
        )
    }
}

/// The engine's options, checked.
#[derive(Clone, Debug)]
pub struct Settings {
    /// `hostnqn`
    pub hostnqn: Option<String>,
    /// `psk_path`, and the key it holds.
    pub psk: Option<(String, String)>,
    /// `send_mode`
    pub send_mode: SendMode,
    /// `digest`: header, data.
    pub digests: (bool, bool),
    /// `dhchap_secret` and `dhchap_ctrl_secret`, as secrets.
    pub dhchap: Option<(String, Option<String>)>,
    /// `paths`
    pub paths: Vec<SocketAddr>,
    /// `path_policy`
    pub policy: PathPolicy,
    /// `idle`
    pub idle: Idle,
}

fn secret(option: &'static str, v: &str) -> Result<String, Error> {
    if v.trim_start().starts_with("DHHC-1:") {
        return Ok(v.trim().to_string());
    }
    std::fs::read_to_string(v)
        .map(|t| t.trim().to_string())
        .map_err(|source| Error::Secret {
            option,
            value: v.into(),
            source,
        })
}

impl Settings {
    /// Checks the options; the error names the option and what it accepts.
    pub fn parse(raw: &RawOptions) -> Result<Settings, Error> {
        let [hostnqn, psk_path, send_mode, digest, dh, dh_ctrl, paths, policy, idle] = &raw.0;
        let psk = match psk_path.as_deref().filter(|p| !p.is_empty()) {
            None => None,
            Some(p) => {
                let text = std::fs::read_to_string(p).map_err(|source| Error::PskRead {
                    path: p.into(),
                    source,
                })?;
                let key = text.trim().to_string();
                nvpoll_tcp::tls::ConfiguredKey::parse(&key).map_err(|source| Error::PskKey {
                    path: p.into(),
                    source,
                })?;
                Some((p.to_string(), key))
            }
        };
        let send_mode = match send_mode.as_deref() {
            None | Some("") => SendMode::Deferred,
            Some(m) => m.parse().map_err(Error::SendMode)?,
        };
        let digests = match digest.as_deref().map(str::to_ascii_lowercase).as_deref() {
            None | Some("") | Some("none") => (false, false),
            Some("header") => (true, false),
            Some("data") => (false, true),
            Some("both") => (true, true),
            Some(other) => {
                return Err(Error::BadOption {
                    option: "digest",
                    value: other.into(),
                    expected: "none, header, data or both",
                })
            }
        };
        let dhchap = match dh.as_deref().filter(|s| !s.is_empty()) {
            None if dh_ctrl.as_deref().is_some_and(|s| !s.is_empty()) => {
                return Err(Error::CtrlSecretAlone)
            }
            None => None,
            Some(s) => Some((
                secret("dhchap_secret", s)?,
                dh_ctrl
                    .as_deref()
                    .filter(|s| !s.is_empty())
                    .map(|c| secret("dhchap_ctrl_secret", c))
                    .transpose()?,
            )),
        };
        let paths = match paths.as_deref().filter(|s| !s.is_empty()) {
            None => Vec::new(),
            Some(list) => list
                .split(',')
                .map(|p| {
                    p.trim()
                        .parse::<SocketAddr>()
                        .map_err(|_| Error::BadPath(p.into()))
                })
                .collect::<Result<_, _>>()?,
        };
        let policy = match policy.as_deref() {
            None | Some("") => PathPolicy::default(),
            Some(p) => [PathPolicy::QueueDepth, PathPolicy::RoundRobin]
                .into_iter()
                .find(|c| c.name().eq_ignore_ascii_case(p))
                .ok_or_else(|| Error::BadOption {
                    option: "path_policy",
                    value: p.into(),
                    expected: "queue-depth or round-robin",
                })?,
        };
        let idle = match idle.as_deref() {
            None | Some("") | Some("yield") => Idle::Yield,
            Some("spin") => Idle::Spin,
            Some(other) => {
                return Err(Error::BadOption {
                    option: "idle",
                    value: other.into(),
                    expected: "spin or yield",
                })
            }
        };
        Ok(Settings {
            hostnqn: hostnqn.clone().filter(|s| !s.is_empty()),
            psk,
            send_mode,
            digests,
            dhchap,
            paths,
            policy,
            idle,
        })
    }

    /// What makes two jobs' controllers the same controller: the transport ID and every option that shapes
    /// the connection (not the send mode or idle, which are per queue pair). Secrets enter only as the file
    /// or a fingerprint-free marker, never as text that could reach a log.
    pub fn controller_key(&self, trid: &TransportId) -> String {
        if let TransportId::Pcie { .. } = trid {
            return trid.to_string();
        }
        let dh = self.dhchap.as_ref().map(|(h, c)| {
            // The key compares secrets without keeping them: a hash of both.
            use std::hash::{Hash, Hasher};
            let mut s = std::collections::hash_map::DefaultHasher::new();
            h.hash(&mut s);
            c.hash(&mut s);
            s.finish()
        });
        format!(
            "{trid} hostnqn={:?} psk={:?} digests={:?} dhchap={dh:?} paths={:?} policy={}",
            self.hostnqn,
            self.psk.as_ref().map(|p| &p.0),
            self.digests,
            self.paths,
            self.policy.name()
        )
    }

    /// The connect options of each path to the NVMe/TCP controller `trid` names: its own address first,
    /// then `paths`.
    pub fn connect_options(&self, trid: &TransportId) -> Result<Vec<ConnectOptions>, Error> {
        let mut first = ConnectOptions::from_trid(trid, self.hostnqn.as_deref())
            .map_err(Error::ConnectOptions)?;
        first.header_digest = self.digests.0;
        first.data_digest = self.digests.1;
        if let Some((h, c)) = &self.dhchap {
            first = first.with_dhchap(h, c.as_deref()).map_err(Error::Dhchap)?;
        }
        if let Some((p, key)) = &self.psk {
            first = first
                .with_psk_args(key, None, 0)
                .map_err(|source| Error::PskSetup {
                    path: p.clone(),
                    source,
                })?;
        }
        let mut all = vec![first.clone()];
        for addr in &self.paths {
            if *addr == first.addr {
                return Err(Error::OwnPath(*addr));
            }
            let mut o = first.clone();
            o.addr = *addr;
            all.push(o);
        }
        Ok(all)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(pairs: &[(&str, &str)]) -> RawOptions {
        let mut r = RawOptions::default();
        for (k, v) in pairs {
            let i = OPTIONS.iter().position(|o| o.name == *k).unwrap();
            r.0[i] = Some(v.to_string());
        }
        r
    }

    #[test]
    fn defaults_and_values() {
        let s = Settings::parse(&RawOptions::default()).unwrap();
        assert_eq!(s.send_mode, SendMode::Deferred);
        assert_eq!(s.digests, (false, false));
        assert_eq!(s.idle, Idle::Yield);
        let s = Settings::parse(&raw(&[
            ("send_mode", "deferred"),
            ("digest", "BOTH"),
            ("paths", "127.0.0.1:4421,[::1]:4422"),
            ("path_policy", "round-robin"),
            ("idle", "spin"),
        ]))
        .unwrap();
        assert_eq!(s.send_mode, SendMode::Deferred);
        assert_eq!(s.digests, (true, true));
        assert_eq!(s.paths.len(), 2);
        assert_eq!(s.policy, PathPolicy::RoundRobin);
        assert_eq!(s.idle, Idle::Spin);
        assert_eq!(
            Idle::Spin.for_cpus(128, 1),
            Idle::Yield,
            "128 spinning jobs on one CPU yield"
        );
        assert_eq!(Idle::Spin.for_cpus(2, 2), Idle::Spin);
        assert_eq!(Idle::Yield.for_cpus(1, 2), Idle::Yield);
        let warn = Idle::spin_advice(128, 1);
        assert!(
            warn.contains("128 jobs on 1 CPU:") && warn.contains("yield between empty polls"),
            "{warn}"
        );
    }

    #[test]
    fn bad_values_name_the_option() {
        for (k, v, needle) in [
            ("send_mode", "sometimes", "send_mode"),
            ("digest", "crc", "digest=crc"),
            ("paths", "127.0.0.1", "paths"),
            ("path_policy", "random", "path_policy"),
            ("idle", "sleep", "idle=sleep"),
            ("psk_path", "/nonexistent/key", "psk_path"),
            ("dhchap_ctrl_secret", "DHHC-1:00:x:", "needs dhchap_secret"),
        ] {
            let e = Settings::parse(&raw(&[(k, v)])).unwrap_err().to_string();
            assert!(e.contains(needle), "{k}={v}: {e}");
        }
    }

    #[test]
    fn the_controller_key_never_holds_a_secret() {
        let s = Settings::parse(&raw(&[(
            "dhchap_secret",
            "DHHC-1:00:c2VjcmV0c2VjcmV0c2VjcmV0c2VjcmV0c2VjcmV0:",
        )]))
        .unwrap();
        let trid: TransportId = "trtype:tcp traddr:127.0.0.1 subnqn:n".parse().unwrap();
        let k = s.controller_key(&trid);
        assert!(!k.contains("DHHC") && !k.contains("c2Vj"), "{k}");
    }
}
