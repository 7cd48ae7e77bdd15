//! The NVMe PSK interchange-key and identity parsers on arbitrary input: never panic, and whatever
//! parses re-encodes to the same string (the base64 engine is strict, so there is one spelling).
#![no_main]

use libfuzzer_sys::fuzz_target;
use nvpoll_tls::{ConfiguredKey, Derivation, IdentityVersion, ParsedIdentity};

fuzz_target!(|data: &[u8]| {
    let _ = ParsedIdentity::parse(data);
    let Ok(s) = std::str::from_utf8(data) else {
        return;
    };
    match ConfiguredKey::parse(s) {
        Ok(key) => {
            assert_eq!(&*key.to_interchange(), s);
            let (identity, psk) =
                key.derive(IdentityVersion::V1, "nqn.h", "nqn.s", Derivation::Rfc8446);
            let parsed = ParsedIdentity::parse(identity.as_bytes()).expect("our identity parses");
            assert_eq!(parsed.hash, psk.hash());
        }
        Err(e) => {
            // Error text must never echo the key field (a real one is 48 or 68 base64 characters): it is
            // short, and does not contain such a field.
            let text = e.to_string();
            assert!(text.len() < 100, "{text}");
            let base64ish = |f: &&str| {
                f.len() >= 40 && f.bytes().all(|b| b.is_ascii_alphanumeric() || b"+/=".contains(&b))
            };
            if let Some(field) = s.split(':').nth(2).filter(base64ish) {
                assert!(!text.contains(field), "{text}");
            }
        }
    }
});
