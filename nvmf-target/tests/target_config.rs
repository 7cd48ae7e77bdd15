//! The target's configuration file: a good file becomes the TargetConfig it describes and serves our
//! initiator (plain, and over TLS with a key from a key file); every malformed file is refused with an error
//! that names the field and its line, and never shows what a key file holds.

use nvpoll_testkit::target as target_common;

use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use nvpoll::api::Controller;
use nvpoll::send::SendMode;
use nvpoll::spec::Status;
use nvpoll_target::config::{self, no_pcie, ConfigError};
use nvpoll_target::{Backing, HostAccess, NamespaceConfig, SubsystemLimits, TargetConfig, TlsMode};
use nvpoll_tcp::host::{ConnectOptions, TcpController};
use nvpoll_tcp::tls::{ConfiguredKey, IdentityVersion};
use target_common::{pool, TestTarget};

const KEY: &str = "NVMeTLSkey-1:01:VRLbtnN9AQb2WXW3c9+wEf/DRLz0QuLdbYvEhwtdWwNf9LrZ:";
/// The base64 part of KEY: what must never appear in an error.
const KEY_BODY: &str = "VRLbtnN9AQb2WXW3c9+wEf/DRLz0QuLdbYvEhwtdWwNf9LrZ";
const A: &str = "nqn.2024-01.io.nvpoll:a";
const B: &str = "nqn.2024-01.io.nvpoll:b";
const H1: &str = "nqn.2024-01.io.nvpoll:h1";
const H2: &str = "nqn.2024-01.io.nvpoll:h2";
const H3: &str = "nqn.2024-01.io.nvpoll:h3";

/// A folder of its own for one test, removed at the end.
struct TempDir(PathBuf);

impl TempDir {
    fn new(name: &str) -> TempDir {
        let dir = std::env::temp_dir().join(format!("nvpoll-config-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }

    /// Writes `contents` to `name` with `mode`; returns its path.
    fn file(&self, name: &str, contents: &[u8], mode: u32) -> PathBuf {
        let p = self.0.join(name);
        std::fs::write(&p, contents).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
        p
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// A port nobody listens on now.
fn free_port() -> SocketAddr {
    let probe = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    probe.local_addr().unwrap()
}

/// The line (from 1) where `needle` first appears in `text`.
fn line_of(text: &str, needle: &str) -> usize {
    let at = text
        .find(needle)
        .unwrap_or_else(|| panic!("{needle} not in the text"));
    1 + text[..at].matches('\n').count()
}

fn opts(addr: SocketAddr, subnqn: &str, hostnqn: &str) -> ConnectOptions {
    let mut o = ConnectOptions::new(addr, subnqn, hostnqn);
    o.timeout = Duration::from_secs(30);
    o
}

#[test]
fn a_good_file_becomes_its_target_config_and_serves_our_initiator() {
    let dir = TempDir::new("good");
    dir.file("h1.key", format!("\n  {KEY}\n").as_bytes(), 0o600);
    let image = dir.file("disk.img", &vec![0u8; 2 << 20], 0o644);
    let tls_addr = free_port();
    let text = format!(
        r#"{{
  "listeners": [ {{"address": "127.0.0.1:0"}}, {{"address": "{tls_addr}", "tls": "required"}} ],
  "max_io_queues": 64, "queue_size": 256, "mdts": 7,
  "send_mode": "adaptive", "tcp_congestion": "reno",
  "subsystems": [
    {{
      "nqn": "{A}", "serial": "A0001", "model": "config test",
      "hosts": [ {{"nqn": "{H1}", "psk_file": "h1.key"}}, {{"nqn": "{H2}"}} ],
      "max_io_queues": 8, "queue_size": 64, "mdts": 5,
      "namespaces": [
        {{"nsid": 1, "ram": "1M", "block_size": 512}},
        {{"file": "disk.img"}},
        {{"nsid": 7, "ram": 65536, "block_size": 4096}}
      ]
    }},
    {{
      "nqn": "{B}", "allow_any_host": true, "listeners": ["{tls_addr}"],
      "namespaces": [ {{"ram": "4M"}} ]
    }}
  ]
}}"#
    );
    let path = dir.file("target.json", text.as_bytes(), 0o644);
    let cfg: TargetConfig = config::load(&path, &no_pcie).expect("a good file");

    assert_eq!(cfg.listen, "127.0.0.1:0".parse().unwrap());
    assert!(cfg.tls.is_none(), "the first listener is plain");
    assert_eq!(cfg.listeners.len(), 1);
    assert_eq!(
        (cfg.listeners[0].address, cfg.listeners[0].tls),
        (tls_addr, TlsMode::Required)
    );
    assert_eq!(
        (cfg.max_io_queues, cfg.queue_entries, cfg.mdts),
        (64, 256, 7)
    );
    assert_eq!(cfg.send_mode, SendMode::Adaptive);
    assert_eq!(cfg.tcp_congestion.as_deref(), Some("reno"));
    assert_eq!(cfg.subsystems.len(), 2);
    let a = &cfg.subsystems[0];
    assert_eq!(
        (a.nqn.as_str(), a.serial.as_str(), a.model.as_str()),
        (A, "A0001", "config test")
    );
    assert_eq!(a.hosts, HostAccess::Only(vec![H1.into(), H2.into()]));
    assert_eq!(a.host_keys.len(), 1);
    assert_eq!(a.host_keys[0].hostnqn, H1);
    assert!(a.host_keys[0].key == ConfiguredKey::parse(KEY).unwrap());
    assert_eq!(
        a.limits,
        SubsystemLimits {
            max_io_queues: Some(8),
            queue_entries: Some(64),
            mdts: Some(5)
        }
    );
    assert_eq!(a.listeners, None, "every listener");
    assert_eq!(
        a.namespaces,
        [
            NamespaceConfig {
                backing: Backing::Ram(1 << 20),
                block_size: 512,
                nsid: Some(1),
                ana_group: 1,
                uuid: None,
            },
            NamespaceConfig {
                backing: Backing::File(image),
                block_size: 512,
                nsid: None,
                ana_group: 1,
                uuid: None,
            },
            NamespaceConfig {
                backing: Backing::Ram(65536),
                block_size: 4096,
                nsid: Some(7),
                ana_group: 1,
                uuid: None,
            },
        ]
    );
    let b = &cfg.subsystems[1];
    assert_eq!(b.hosts, HostAccess::AnyHost);
    assert_eq!(b.listeners, Some(vec![tls_addr]));
    assert!(b.host_keys.is_empty());

    // And it serves: H2 plainly on the first listener, H1 over TLS with the key from its file.
    let t = TestTarget::start_with(cfg);
    let ctrl = TcpController::connect(opts(t.addr, A, H2), pool()).expect("H2 attaches");
    let nsids: Vec<u32> = ctrl.namespaces().iter().map(|n| n.nsid).collect();
    assert_eq!(nsids, [1, 2, 7]);
    assert_eq!(
        ctrl.namespaces()[1].blocks,
        (2 << 20) / 512,
        "the file's size"
    );
    assert_eq!(ctrl.io_queues_allowed(), 8);
    let key = ConfiguredKey::parse(KEY).unwrap();
    let secure = TcpController::connect(
        opts(tls_addr, A, H1).with_tls_key(&key, IdentityVersion::V1),
        pool(),
    )
    .expect("H1 attaches over TLS");
    assert_eq!(secure.namespaces().len(), 3);
    // H3 is not allowed on A.
    match TcpController::connect(opts(t.addr, A, H3), pool()) {
        Err(nvpoll_tcp::Error::Refused(r)) => {
            assert!(r.status.is(Status::CONNECT_INVALID_HOST), "{r:?}");
            assert!(r.to_string().contains("does not allow host"), "{r}");
        }
        other => panic!("H3 should be refused, got {other:?}"),
    }
    // B is only on the TLS listener.
    assert!(TcpController::connect(opts(t.addr, B, H3), pool()).is_err());
}

/// The error for `text` (as if read from /etc/nvpoll/target.json), with the checks every error passes: the
/// field and line are in its Display, after the file's name.
fn refused(text: &str, field: &str, line: usize) -> ConfigError {
    let e = config::parse(text, Path::new("/etc/nvpoll/target.json"), &no_pcie)
        .expect_err("the configuration is refused");
    assert_eq!(e.field(), field, "{e}");
    assert_eq!(e.line(), Some(line), "{e}");
    let shown = e.to_string();
    assert!(
        shown.starts_with(&format!("/etc/nvpoll/target.json:{line}:")),
        "{shown}"
    );
    assert!(
        field.is_empty() || shown.contains(&format!(" {field}: ")),
        "{shown}"
    );
    e
}

#[test]
fn an_unknown_field_is_named_with_its_line() {
    let text = r#"{
  "listeners": [
    {"address": "127.0.0.1:4420", "tsl": "required"}
  ]
}"#;
    let e = refused(text, "listeners[0].tsl", line_of(text, "\"tsl\""));
    assert!(e.message().contains("unknown field `tsl`"), "{e}");
    assert!(
        e.column().is_some(),
        "syntax-level errors have a column: {e}"
    );
}

#[test]
fn a_wrong_type_is_named_with_its_line() {
    let text = r#"{
  "listeners": [ {"address": "127.0.0.1:4420"} ],
  "subsystems": [
    {"nqn": "nqn.2024-01.io.nvpoll:a",
     "queue_size": "big"}
  ]
}"#;
    let e = refused(text, "subsystems[0].queue_size", line_of(text, "\"big\""));
    assert!(e.message().contains("expected u16"), "{e}");
}

#[test]
fn a_bad_nqn_is_named_with_its_line() {
    let text = r#"{
  "listeners": [ {"address": "127.0.0.1:4420"} ],
  "subsystems": [
    {"nqn": "nqn.2024-01.io.nvpoll:fine"},
    {
      "nqn": "not-an-nqn"
    }
  ]
}"#;
    let e = refused(text, "subsystems[1].nqn", line_of(text, "not-an-nqn"));
    assert!(e.message().contains("nqn.yyyy-mm"), "{e}");
}

#[test]
fn a_duplicate_nsid_is_named_with_its_line() {
    let text = r#"{
  "listeners": [ {"address": "127.0.0.1:4420"} ],
  "subsystems": [ {
    "nqn": "nqn.2024-01.io.nvpoll:a",
    "namespaces": [
      {"nsid": 3, "ram": "1M"},
      {"nsid": 3, "ram": "2M"}
    ]
  } ]
}"#;
    let e = refused(
        text,
        "subsystems[0].namespaces[1].nsid",
        line_of(text, "\"2M\""),
    );
    assert!(e.message().contains("namespace ID 3 is used twice"), "{e}");
}

#[test]
fn a_missing_key_file_is_named_with_its_line() {
    let dir = TempDir::new("missing-key");
    let missing = dir.0.join("nope.key");
    let text = format!(
        r#"{{
  "listeners": [ {{"address": "127.0.0.1:4420"}} ],
  "subsystems": [ {{
    "nqn": "{A}",
    "hosts": [ {{"nqn": "{H1}"}},
      {{"nqn": "{H2}", "psk_file": "{}"}} ]
  }} ]
}}"#,
        missing.display()
    );
    let e = refused(
        &text,
        "subsystems[0].hosts[1].psk_file",
        line_of(&text, "psk_file"),
    );
    assert!(e.message().contains(&missing.display().to_string()), "{e}");
    assert!(e.message().contains("No such file"), "{e}");
}

#[test]
fn a_key_file_others_may_read_is_refused_without_showing_it() {
    let dir = TempDir::new("open-key");
    let key = dir.file("h1.key", KEY.as_bytes(), 0o644);
    let text = format!(
        r#"{{
  "listeners": [ {{"address": "127.0.0.1:4420"}} ],
  "subsystems": [ {{
    "nqn": "{A}",
    "hosts": [
      {{"nqn": "{H1}", "psk_file": "{}"}}
    ]
  }} ]
}}"#,
        key.display()
    );
    let e = refused(
        &text,
        "subsystems[0].hosts[0].psk_file",
        line_of(&text, "psk_file"),
    );
    let shown = e.to_string();
    assert!(shown.contains(&key.display().to_string()), "{shown}");
    assert!(shown.contains("0644"), "{shown}");
    assert!(shown.contains("chmod 600"), "{shown}");
    assert!(
        !shown.contains(KEY_BODY) && !shown.contains("NVMeTLSkey"),
        "{shown}"
    );
    assert!(!format!("{e:?}").contains(KEY_BODY));
    assert!(
        matches!(
            e.cause(),
            Some(nvpoll_target::Error::KeyFile {
                fault: nvpoll_target::KeyFileFault::OpenToOthers { mode: 0o644 },
                ..
            })
        ),
        "{e:?}"
    );
    // Made private, the same file is taken; a file that holds something else is refused without quoting it.
    std::fs::set_permissions(&key, std::fs::Permissions::from_mode(0o600)).unwrap();
    let cfg = config::parse(&text, Path::new("/etc/nvpoll/target.json"), &no_pcie).unwrap();
    assert_eq!(cfg.subsystems[0].host_keys.len(), 1);
    std::fs::write(&key, format!("{KEY_BODY}\n")).unwrap();
    let e = refused(
        &text,
        "subsystems[0].hosts[0].psk_file",
        line_of(&text, "psk_file"),
    );
    assert!(!e.to_string().contains(KEY_BODY), "{e}");
}

#[test]
fn two_backings_for_one_namespace_are_refused() {
    let text = r#"{
  "listeners": [ {"address": "127.0.0.1:4420"} ],
  "subsystems": [ {
    "nqn": "nqn.2024-01.io.nvpoll:a",
    "namespaces": [
      {"ram": "1M",
       "file": "/dev/null"}
    ]
  } ]
}"#;
    let e = refused(
        text,
        "subsystems[0].namespaces[0].file",
        line_of(text, "\"file\""),
    );
    assert!(e.message().contains("ram already"), "{e}");
    // And none at all.
    let text = text.replace(
        "{\"ram\": \"1M\",\n       \"file\": \"/dev/null\"}",
        "{\"nsid\": 2}",
    );
    let e = refused(
        &text,
        "subsystems[0].namespaces[0]",
        line_of(&text, "\"nsid\""),
    );
    assert!(e.message().contains("one of ram, file or pcie"), "{e}");
}

#[test]
fn sizes_listeners_and_duplicates_are_checked_with_their_lines() {
    let sub = |body: &str| {
        format!(
            "{{\n  \"listeners\": [ {{\"address\": \"127.0.0.1:4420\"}} ],\n  \"subsystems\": [\n{body}\n  ]\n}}"
        )
    };
    // A size that is not one.
    let text = sub(r#"    {"nqn": "nqn.2024-01.io.nvpoll:a", "namespaces": [ {"ram": "12Q"} ]}"#);
    let e = refused(
        &text,
        "subsystems[0].namespaces[0].ram",
        line_of(&text, "12Q"),
    );
    assert!(e.message().contains("not a size"), "{e}");
    // A RAM size that is not a whole number of blocks.
    let text = sub(
        r#"    {"nqn": "nqn.2024-01.io.nvpoll:a", "namespaces": [ {"ram": 6144, "block_size": 4096} ]}"#,
    );
    let e = refused(
        &text,
        "subsystems[0].namespaces[0].ram",
        line_of(&text, "6144"),
    );
    assert!(e.message().contains("multiple"), "{e}");
    // A listener the target does not have.
    let text = sub(r#"    {"nqn": "nqn.2024-01.io.nvpoll:a",
     "listeners": ["127.0.0.1:4421"]}"#);
    let e = refused(&text, "subsystems[0].listeners[0]", line_of(&text, "4421"));
    assert!(e.message().contains("not a listener of the target"), "{e}");
    // The same subsystem twice.
    let text = sub(r#"    {"nqn": "nqn.2024-01.io.nvpoll:a"},
    {"nqn": "nqn.2024-01.io.nvpoll:a"}"#);
    let e = refused(&text, "subsystems[1].nqn", 5);
    assert!(e.message().contains("configured twice"), "{e}");
    // The same listener twice.
    let text = "{\"listeners\": [\n {\"address\": \"127.0.0.1:4420\"},\n {\"address\": \"127.0.0.1:4420\"}\n]}";
    refused(text, "listeners[1].address", 3);
    // A limit the target would refuse.
    let text = sub(r#"    {"nqn": "nqn.2024-01.io.nvpoll:a", "mdts": 11}"#);
    let e = refused(&text, "subsystems[0].mdts", 4);
    assert!(e.message().contains("MDTS 11"), "{e}");
    // Syntax: a missing comma, with line and column.
    let text = "{\n  \"listeners\": [ {\"address\": \"127.0.0.1:4420\"} ]\n  \"mdts\": 5\n}";
    let e = refused(text, "", 3);
    assert_eq!(e.column(), Some(3), "{e}");
}

#[test]
fn pcie_namespaces_go_through_the_resolver() {
    let text = r#"{
  "listeners": [ {"address": "127.0.0.1:4420"} ],
  "subsystems": [ {"nqn": "nqn.2024-01.io.nvpoll:a",
    "namespaces": [ {"pcie": "0000:00:04.0"} ] } ]
}"#;
    let origin = Path::new("target.json");
    let e = config::parse(text, origin, &no_pcie).unwrap_err();
    assert_eq!(e.field(), "subsystems[0].namespaces[0].pcie");
    assert_eq!(e.line(), Some(4));
    assert!(e.message().contains("0000:00:04.0"), "{e}");
    assert!(
        matches!(e.cause(), Some(nvpoll_target::Error::NoPcieDriver { bdf }) if bdf == "0000:00:04.0"),
        "{e:?}"
    );
    let asked = std::sync::Mutex::new(Vec::new());
    let resolver = |bdf: &str| {
        asked.lock().unwrap().push(bdf.to_string());
        Ok(Backing::Ram(1 << 20))
    };
    // The resolver is Send + Sync: a Mutex is fine, a RefCell would not be.
    let cfg = config::parse(text, origin, &resolver).unwrap();
    assert_eq!(*asked.lock().unwrap(), ["0000:00:04.0"]);
    assert_eq!(
        cfg.subsystems[0].namespaces[0].backing,
        Backing::Ram(1 << 20)
    );
}

#[test]
fn a_file_that_cannot_be_read_is_named() {
    let e = config::load(Path::new("/nonexistent/nvpoll.json"), &no_pcie).unwrap_err();
    assert!(
        e.to_string()
            .starts_with("/nonexistent/nvpoll.json: cannot read it"),
        "{e}"
    );
}

#[test]
fn ana_groups_states_and_controller_ids_are_read_and_checked() {
    let text = r#"{
  "listeners": [ {"address": "127.0.0.1:4420"}, {"address": "127.0.0.1:4421"} ],
  "subsystems": [ {
    "nqn": "nqn.2024-01.io.nvpoll:mp",
    "cntlid_min": 100, "cntlid_max": 199,
    "ana": [ {"listener": "127.0.0.1:4421", "group": 2, "state": "non-optimized"},
             {"listener": "127.0.0.1:4420", "state": "inaccessible"} ],
    "namespaces": [ {"ram": "1M"}, {"ram": "1M", "ana_group": 2} ]
  } ]
}"#;
    let cfg = config::parse(text, Path::new("/etc/nvpoll/target.json"), &no_pcie).unwrap();
    let s = &cfg.subsystems[0];
    assert_eq!(s.cntlids, nvpoll_target::CntlidRange { min: 100, max: 199 });
    assert_eq!(s.namespaces[0].ana_group, 1);
    assert_eq!(s.namespaces[1].ana_group, 2);
    assert_eq!(s.ana.len(), 2);
    assert_eq!(s.ana[0].state, nvpoll::spec::AnaState::NonOptimized);
    assert_eq!(
        (s.ana[1].group, s.ana[1].state),
        (1, nvpoll::spec::AnaState::Inaccessible)
    );

    let bad_group = r#"{
  "listeners": [ {"address": "127.0.0.1:4420"} ],
  "subsystems": [ { "nqn": "nqn.2024-01.io.nvpoll:mp",
    "namespaces": [ {"ram": "1M",
                     "ana_group": 0} ] } ]
}"#;
    let e = refused(
        bad_group,
        "subsystems[0].namespaces[0].ana_group",
        line_of(bad_group, "\"ana_group\": 0"),
    );
    assert!(e.message().contains("ANA group 0"), "{e}");
    let bad_listener = r#"{
  "listeners": [ {"address": "127.0.0.1:4420"} ],
  "subsystems": [ { "nqn": "nqn.2024-01.io.nvpoll:mp",
    "ana": [ {"listener": "127.0.0.1:4999",
              "state": "inaccessible"} ] } ]
}"#;
    let e = refused(
        bad_listener,
        "subsystems[0].ana[0].listener",
        line_of(bad_listener, "127.0.0.1:4999"),
    );
    assert!(e.message().contains("not a listener"), "{e}");
    let bad_state = r#"{
  "listeners": [ {"address": "127.0.0.1:4420"} ],
  "subsystems": [ { "nqn": "nqn.2024-01.io.nvpoll:mp",
    "ana": [ {"listener": "127.0.0.1:4420",
              "state": "gone"} ] } ]
}"#;
    let e = refused(
        bad_state,
        "subsystems[0].ana[0].state",
        line_of(bad_state, "\"gone\""),
    );
    assert!(e.message().contains("must be one of"), "{e}");
    let bad_ids = r#"{
  "listeners": [ {"address": "127.0.0.1:4420"} ],
  "subsystems": [ { "nqn": "nqn.2024-01.io.nvpoll:mp",
    "cntlid_min": 300, "cntlid_max": 200 } ]
}"#;
    let e = refused(
        bad_ids,
        "subsystems[0].cntlid_min",
        line_of(bad_ids, "\"cntlid_min\""),
    );
    assert!(e.message().contains("controller IDs 300-200"), "{e}");
}

/// A congestion control the system lacks stops the target at bind, naming it.
#[test]
fn an_unknown_tcp_congestion_is_refused_at_bind() {
    let mut cfg = TargetConfig::new("127.0.0.1:0".parse().unwrap());
    cfg.tcp_congestion = Some("no-such-cc".into());
    let Err(e) = nvpoll_target::Target::bind(cfg) else {
        panic!("an unknown algorithm was accepted");
    };
    assert!(e.to_string().contains("'no-such-cc'"), "{e}");
}

#[test]
fn a_namespace_uuid_is_read_and_checked() {
    let text = r#"{
  "listeners": [ {"address": "127.0.0.1:4420"} ],
  "subsystems": [
    {"nqn": "nqn.2024-01.io.nvpoll:u",
     "namespaces": [ {"ram": "1M", "uuid": "91fdba0d-f87b-4c25-b80f-db7be1418b9e"}, {"ram": "1M"} ]}
  ]
}"#;
    let cfg = config::parse(text, Path::new("/etc/nvpoll/target.json"), &no_pcie).unwrap();
    let ns = &cfg.subsystems[0].namespaces;
    assert_eq!(
        ns[0].uuid,
        Some([
            0x91, 0xfd, 0xba, 0x0d, 0xf8, 0x7b, 0x4c, 0x25, 0xb8, 0x0f, 0xdb, 0x7b, 0xe1, 0x41,
            0x8b, 0x9e
        ])
    );
    assert_eq!(ns[1].uuid, None, "derived when not given");
    let bad = text.replace("91fdba0d-f87b-4c25-b80f-db7be1418b9e", "91fdba0d-f87b");
    let e = refused(
        &bad,
        "subsystems[0].namespaces[0].uuid",
        line_of(&bad, "\"ram\""),
    );
    assert!(e.message().contains("not a UUID"), "{e}");
}

#[test]
fn the_tls_key_update_count_is_read_and_checked() {
    let text = r#"{
  "listeners": [{"address": "127.0.0.1:4420", "tls": "required"}],
  "tls_key_update": 1000
}"#;
    let cfg = config::parse(text, Path::new("/etc/nvpoll/target.json"), &no_pcie).unwrap();
    assert_eq!(cfg.tls_key_renewal.records, 1000);
    let default = TargetConfig::new("127.0.0.1:0".parse().unwrap());
    assert_eq!(default.tls_key_renewal.records, 1 << 23);
    for bad in ["0", "8388609"] {
        let text = format!(
            "{{\n  \"listeners\": [{{\"address\": \"127.0.0.1:4420\"}}],\n  \"tls_key_update\": {bad}\n}}"
        );
        let e = refused(&text, "tls_key_update", 3);
        assert!(e.message().contains("8388608"), "{e}");
    }
}
