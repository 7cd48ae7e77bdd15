//! How a target is set up in code: [`TargetConfig`] (listeners, subsystems, limits, send mode), [`TargetTls`]
//! and [`TlsMode`]. The JSON configuration file ([`crate::config`]) builds one of these.

use std::fmt;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use nvpoll::send::SendMode;

use crate::error::{Error, Setting};
use crate::events::{EventHook, TargetEvent};
use crate::subsystem::{self, HostKey, SubsystemConfig};

/// Whether a listener speaks TLS.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum TlsMode {
    /// Plain TCP only.
    #[default]
    Off,
    /// The first bytes decide: a TLS record (0x16) starts the handshake, a plain ICReq proceeds without TLS.
    Optional,
    /// Every host must start with a TLS handshake.
    Required,
}

impl TlsMode {
    /// The name used on command lines and in configuration files.
    pub fn as_str(self) -> &'static str {
        match self {
            TlsMode::Off => "off",
            TlsMode::Optional => "optional",
            TlsMode::Required => "required",
        }
    }
}

impl std::str::FromStr for TlsMode {
    type Err = Error;

    fn from_str(s: &str) -> Result<TlsMode, Error> {
        match s {
            "off" => Ok(TlsMode::Off),
            "optional" => Ok(TlsMode::Optional),
            "required" => Ok(TlsMode::Required),
            _ => Err(Error::TlsMode(s.to_string())),
        }
    }
}

impl fmt::Display for TlsMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One address the target listens on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ListenerConfig {
    /// Address and port (port 0: any free port).
    pub address: SocketAddr,
    /// Plain, TLS optional or TLS required.
    pub tls: TlsMode,
}

/// Everything a target serves and how.
#[derive(Clone)]
pub struct TargetConfig {
    /// The first address to listen on; its TLS mode follows [`TargetConfig::tls`].
    pub listen: SocketAddr,
    /// More listeners, each with its own TLS mode, all served by the same reactors.
    pub listeners: Vec<ListenerConfig>,
    /// The NVM subsystems (the discovery subsystem is always added).
    pub subsystems: Vec<SubsystemConfig>,
    /// MAXH2CDATA announced in ICResp: the largest H2CData PDU hosts send (default 128 KiB).
    pub maxh2cdata: u32,
    /// In-capsule data accepted per command (default 8 KiB; Identify IOCCSZ is this plus the 64-byte command).
    pub incapsule_data: u32,
    /// Maximum Data Transfer Size as a power of two of 4 KiB pages (default 8: 1 MiB), for subsystems that do
    /// not set their own.
    pub mdts: u8,
    /// Entries per queue, admin and I/O (CAP.MQES + 1, default 128), for subsystems that do not set their own.
    pub queue_entries: u16,
    /// I/O queues per controller (default 128, as nvmet and SPDK grant), for subsystems that do not set their
    /// own.
    pub max_io_queues: u16,
    /// Time a new connection has for ICReq and Fabrics Connect (default 10 s).
    pub connect_timeout: Duration,
    /// Time a host has for each step of a DH-HMAC-CHAP transaction, from its Connect or its previous
    /// authentication command to the next one, at least (default 60 s, what the Linux host gives each admin
    /// command; twice the controller's keep-alive timeout when that is longer). A host's ffdhe8192 arithmetic
    /// can take seconds: the Linux host in an emulated guest took 16.7 s for its first.
    pub auth_step_timeout: Duration,
    /// Who hears about connections.
    pub events: Option<EventHook>,
    /// When responses leave (see [`nvpoll::send`]): inline as each is made, at the end-of-iteration flush, or
    /// adaptive (inline while the connection has nothing else to answer). Deferred by default.
    pub send_mode: SendMode,
    /// TLS on the first listener ([`TargetConfig::listen`]) and PSKs valid for several subsystems; `None`:
    /// that listener is plain. Subsystems carry their own host keys too ([`SubsystemConfig::host_keys`]).
    pub tls: Option<TargetTls>,
    /// The TCP congestion control of every listener and so of every connection accepted on it
    /// (`setsockopt(TCP_CONGESTION)`, e.g. `cubic`; `system` keeps the system's on every connection). `None`
    /// (the default): the system's (`net.ipv4.tcp_congestion_control`), except that a connection from this
    /// machine under BBR gets cubic ([`nvpoll_wire::conn::loopback_congestion`]). The target sends the data of
    /// reads, so this decides how they are paced: under BBR on loopback, where the minimum RTT is about a
    /// microsecond, BBR's window holds a few segments and 128 KiB reads ran at half the speed they reach under
    /// cubic.
    pub tcp_congestion: Option<String>,
    /// With TLS: when each connection renews its keys (default: a KeyUpdate asking the host too after 2^23
    /// records under one key, or an hour). A host that ends a connection at our KeyUpdate (kernel TLS without
    /// re-keying) is said once in the log, and its later connections are closed at the count instead (the
    /// host reconnects with fresh keys). The count can be changed while running
    /// ([`crate::TargetHandle::set_tls_key_update`]).
    pub tls_key_renewal: nvpoll_wire::KeyRenewal,
}

/// TLS of the first listener, and host keys shared by several subsystems.
#[derive(Clone, Debug)]
pub struct TargetTls {
    /// Refuse hosts that do not start with a TLS handshake. When `false` (optional), the first bytes decide:
    /// a TLS record (0x16) starts the handshake, a plain ICReq proceeds without TLS.
    pub required: bool,
    /// Host keys, each valid for every subsystem of `subnqns`.
    pub keys: Vec<HostKey>,
    /// The subsystems (the discovery subsystem among them if wanted) the keys are valid for.
    pub subnqns: Vec<String>,
}

impl TargetTls {
    /// TLS with one configured PSK (`NVMeTLSkey-1:...`) per host NQN. The target accepts, for each host and
    /// each of `subnqns`, the v0 and v1 identities derived from that host's key (RFC 8446 derivation).
    pub fn with_host_keys(
        required: bool,
        keys: &[(String, nvpoll_tls::ConfiguredKey)],
        subnqns: &[String],
    ) -> TargetTls {
        TargetTls {
            required,
            keys: keys
                .iter()
                .map(|(h, k)| HostKey {
                    hostnqn: h.clone(),
                    key: k.clone(),
                })
                .collect(),
            subnqns: subnqns.to_vec(),
        }
    }

    pub(crate) fn mode(&self) -> TlsMode {
        if self.required {
            TlsMode::Required
        } else {
            TlsMode::Optional
        }
    }
}

impl fmt::Debug for TargetConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TargetConfig")
            .field("listen", &self.listen)
            .field("listeners", &self.listeners)
            .field("subsystems", &self.subsystems)
            .field("maxh2cdata", &self.maxh2cdata)
            .field("incapsule_data", &self.incapsule_data)
            .field("mdts", &self.mdts)
            .field("queue_entries", &self.queue_entries)
            .field("max_io_queues", &self.max_io_queues)
            .field("connect_timeout", &self.connect_timeout)
            .field("auth_step_timeout", &self.auth_step_timeout)
            .field("tcp_congestion", &self.tcp_congestion)
            .field("tls_key_renewal", &self.tls_key_renewal)
            .finish_non_exhaustive()
    }
}

impl TargetConfig {
    /// A target on `listen` with the defaults and no subsystem yet.
    pub fn new(listen: SocketAddr) -> TargetConfig {
        TargetConfig {
            listen,
            listeners: Vec::new(),
            subsystems: Vec::new(),
            maxh2cdata: 128 * 1024,
            incapsule_data: 8192,
            mdts: 8,
            queue_entries: 128,
            max_io_queues: 128,
            connect_timeout: Duration::from_secs(10),
            auth_step_timeout: Duration::from_secs(60),
            events: None,
            send_mode: SendMode::Deferred,
            tls: None,
            tcp_congestion: None,
            tls_key_renewal: nvpoll_wire::KeyRenewal::default(),
        }
    }

    /// Adds a subsystem.
    pub fn subsystem(mut self, s: SubsystemConfig) -> TargetConfig {
        self.subsystems.push(s);
        self
    }

    /// Adds a listener.
    pub fn listener(mut self, address: SocketAddr, tls: TlsMode) -> TargetConfig {
        self.listeners.push(ListenerConfig { address, tls });
        self
    }

    /// Sets the event callback.
    pub fn on_event(
        mut self,
        f: impl Fn(&TargetEvent<'_>) + Send + Sync + 'static,
    ) -> TargetConfig {
        self.events = Some(Arc::new(f));
        self
    }

    pub(crate) fn limits(&self) -> Result<Limits, Error> {
        if self.maxh2cdata < nvpoll_wire::pdu::MIN_MAXH2CDATA
            || self.maxh2cdata % 4 != 0
            || self.maxh2cdata > 16 << 20
        {
            return Err(Error::out_of_range(Setting::MaxH2cData, self.maxh2cdata));
        }
        if self.incapsule_data < 1024
            || self.incapsule_data % 16 != 0
            || self.incapsule_data > 1 << 20
        {
            return Err(Error::out_of_range(
                Setting::InCapsuleData,
                self.incapsule_data,
            ));
        }
        let defaults = subsystem::Limits {
            max_io_queues: self.max_io_queues,
            queue_entries: self.queue_entries,
            mdts: self.mdts,
        };
        defaults.check()?;
        Ok(Limits {
            maxh2cdata: self.maxh2cdata,
            incapsule_data: self.incapsule_data,
            connect_timeout: self.connect_timeout,
            auth_step_timeout: self.auth_step_timeout,
            defaults,
        })
    }
}

/// The checked numbers of a [`TargetConfig`].
#[derive(Clone, Copy, Debug)]
pub(crate) struct Limits {
    pub maxh2cdata: u32,
    pub incapsule_data: u32,
    pub connect_timeout: Duration,
    pub auth_step_timeout: Duration,
    /// What subsystems get unless they say otherwise.
    pub defaults: subsystem::Limits,
}
