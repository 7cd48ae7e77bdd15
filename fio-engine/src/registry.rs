//! The controllers of the process, shared by fio's jobs (threads): one attach per controller and set of
//! connection options, one I/O queue pair per job and file, and one thread that keeps the admin queues alive
//! (keep-alive, asynchronous events, reconnects) while the jobs poll only their own queues.

use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

use nvpoll::api::{Controller, ControllerInfo, QueuePair};
use nvpoll::mem::DmaPool;
use nvpoll::send::SendMode;
use nvpoll::trid::TransportId;
use nvpoll_pcie::{PcieController, PcieOptions};
use nvpoll_tcp::host::TcpController;
use nvpoll_tcp::multipath::MultipathController;

use crate::error::Error;
use crate::settings::Settings;

/// A queue pair of any transport, owned by one fio job.
pub type AnyQueuePair = Box<dyn QueuePair + Send>;

enum AnyController {
    Tcp(Box<TcpController>),
    Multipath(Box<MultipathController>),
    Pcie(Box<PcieController>),
}

impl AnyController {
    fn info(&self) -> &ControllerInfo {
        match self {
            AnyController::Tcp(c) => c.info(),
            AnyController::Multipath(c) => c.info(),
            AnyController::Pcie(c) => c.info(),
        }
    }

    fn poll_admin(&mut self) -> nvpoll::Result<()> {
        match self {
            AnyController::Tcp(c) => Controller::poll_admin(c.as_mut()),
            AnyController::Multipath(c) => Controller::poll_admin(c.as_mut()),
            AnyController::Pcie(c) => Controller::poll_admin(c.as_mut()),
        }
    }

    fn shutdown(self) -> nvpoll::Result<()> {
        match self {
            AnyController::Tcp(c) => Controller::shutdown(*c),
            AnyController::Multipath(c) => Controller::shutdown(*c),
            AnyController::Pcie(c) => Controller::shutdown(*c),
        }
    }
}

/// One attached controller, shared by the jobs that use it; shut down when the last one lets go.
pub struct Attached {
    key: String,
    /// How the controller is named in messages (its transport ID).
    pub name: String,
    /// What attach learnt (namespaces, largest transfer).
    pub info: ControllerInfo,
    ctrl: Mutex<Option<AnyController>>,
}

impl Attached {
    /// Whether this is a local PCIe controller (whose data buffers must be mapped for its device).
    pub fn is_pcie(&self) -> bool {
        matches!(self.lock().as_ref(), Some(AnyController::Pcie(_)))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Option<AnyController>> {
        // A job that panicked while holding the lock left the controller as it was: carry on.
        self.ctrl.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Connects (creates) one I/O queue pair of `depth` for a job.
    pub fn create_queue_pair(&self, depth: u16, mode: SendMode) -> Result<AnyQueuePair, Error> {
        let mut g = self.lock();
        let ctrl = g.as_mut().ok_or(Error::ShutDown)?;
        let failed = |e| Error::CreateQueuePair {
            name: self.name.clone(),
            source: e,
        };
        let mut qp: AnyQueuePair = match ctrl {
            AnyController::Tcp(c) => {
                Box::new(c.connect_io_queue(depth).map_err(|e| failed(e.into()))?)
            }
            AnyController::Multipath(c) => {
                Box::new(c.connect_io_queue(depth).map_err(|e| failed(e.into()))?)
            }
            AnyController::Pcie(c) => {
                Box::new(c.create_queue_pair(depth).map_err(|e| failed(e.into()))?)
            }
        };
        if !matches!(ctrl, AnyController::Pcie(_)) {
            qp.set_send_mode(mode)
                .map_err(|source| Error::SetSendMode {
                    name: self.name.clone(),
                    source,
                })?;
        }
        Ok(qp)
    }

    /// Makes `pool`'s memory reachable by the controller's device (PCIe: maps it into its IOMMU domain).
    pub fn map_pool(&self, pool: &DmaPool) -> Result<(), Error> {
        match self.lock().as_ref() {
            Some(AnyController::Pcie(c)) => {
                c.device()
                    .map_pool(pool)
                    .map_err(|source| Error::MapBuffers {
                        name: self.name.clone(),
                        source,
                    })
            }
            _ => Ok(()),
        }
    }

    /// Undoes [`Attached::map_pool`].
    pub fn unmap_pool(&self, pool: &DmaPool) {
        if let Some(AnyController::Pcie(c)) = self.lock().as_ref() {
            if let Err(e) = c.device().unmap_pool(pool) {
                log::warn!("{}: unmapping a job's I/O buffers: {e}", self.name);
            }
        }
    }
}

impl Drop for Attached {
    fn drop(&mut self) {
        let ctrl = self
            .ctrl
            .get_mut()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        if let Some(c) = ctrl {
            if let Err(e) = c.shutdown() {
                log::warn!("{}: shutdown: {e}", self.name);
            }
        }
    }
}

/// The attached controllers, by key; entries whose controller is gone are dropped on the next attach.
static REGISTRY: Mutex<Vec<(String, Weak<Attached>)>> = Mutex::new(Vec::new());

/// The admin queues' poll interval: well inside any keep-alive timeout (nvpoll's default is 10 s).
const ADMIN_POLL: Duration = Duration::from_millis(50);

/// The controller `trid` names, attached with `settings` if no job has attached it so far.
pub fn attach(trid: &TransportId, settings: &Settings) -> Result<Arc<Attached>, Error> {
    let key = settings.controller_key(trid);
    let mut reg = REGISTRY.lock().unwrap_or_else(|p| p.into_inner());
    reg.retain(|(_, w)| w.strong_count() > 0);
    if let Some(a) = reg
        .iter()
        .find(|(k, _)| *k == key)
        .and_then(|(_, w)| w.upgrade())
    {
        return Ok(a);
    }
    let name = trid.to_string();
    // Admin commands and Identify pages; the jobs bring the memory of their I/O.
    let pool = DmaPool::builder()
        .class(4096, 64)
        .hugepages(nvpoll::mem::HugepageMode::Off)
        .build()
        .map_err(|source| Error::AdminMemory {
            name: name.clone(),
            source,
        })?;
    let ctrl = match trid {
        TransportId::Pcie { bdf } => AnyController::Pcie(Box::new(
            PcieController::open(*bdf, pool, PcieOptions::default())
                .map_err(|source| Error::OpenPcie { bdf: *bdf, source })?,
        )),
        TransportId::Tcp { .. } => {
            let mut paths = settings.connect_options(trid)?;
            if paths.len() == 1 {
                let o = paths.pop().expect("one path");
                AnyController::Tcp(Box::new(TcpController::connect(o, pool).map_err(
                    |source| Error::Connect {
                        name: name.clone(),
                        multipath: false,
                        source,
                    },
                )?))
            } else {
                AnyController::Multipath(Box::new(
                    MultipathController::connect(paths, pool, settings.policy).map_err(
                        |source| Error::Connect {
                            name: name.clone(),
                            multipath: true,
                            source,
                        },
                    )?,
                ))
            }
        }
    };
    log::info!("attached {name}");
    let a = Arc::new(Attached {
        key: key.clone(),
        name,
        info: ctrl.info().clone(),
        ctrl: Mutex::new(Some(ctrl)),
    });
    reg.push((key, Arc::downgrade(&a)));
    start_admin_poller();
    Ok(a)
}

fn start_admin_poller() {
    static STARTED: OnceLock<()> = OnceLock::new();
    STARTED.get_or_init(|| {
        let spawned = std::thread::Builder::new()
            .name("nvpoll-fio-admin".into())
            .spawn(admin_poller);
        if let Err(e) = spawned {
            log::warn!("no admin poller thread ({e}): keep-alive may lapse on long jobs");
        }
    });
}

fn admin_poller() {
    let mut failed: Vec<String> = Vec::new();
    loop {
        std::thread::sleep(ADMIN_POLL);
        let live: Vec<Arc<Attached>> = {
            let reg = REGISTRY.lock().unwrap_or_else(|p| p.into_inner());
            reg.iter().filter_map(|(_, w)| w.upgrade()).collect()
        };
        for a in live {
            let result = match a.lock().as_mut() {
                Some(c) => c.poll_admin(),
                None => Ok(()),
            };
            match result {
                Err(e) if !failed.contains(&a.key) => {
                    log::error!("{}: admin queue: {e}", a.name);
                    failed.push(a.key.clone());
                }
                Ok(()) => failed.retain(|k| *k != a.key),
                Err(_) => {}
            }
        }
    }
}
