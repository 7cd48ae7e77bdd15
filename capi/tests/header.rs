//! include/nvpoll.h is what cbindgen makes of the sources now: regenerate it and compare (CI's "header is
//! current" check). `NVPOLL_BLESS=1 cargo test -p nvpoll-capi --test header` writes it instead.

use std::path::Path;

#[test]
fn the_committed_header_is_current() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let config = cbindgen::Config::from_file(dir.join("cbindgen.toml")).expect("cbindgen.toml");
    let mut fresh = Vec::new();
    cbindgen::Builder::new()
        .with_config(config)
        .with_src(dir.join("src/lib.rs"))
        .generate()
        .expect("cbindgen parses the sources")
        .write(&mut fresh);
    let path = dir.join("include/nvpoll.h");
    if std::env::var_os("NVPOLL_BLESS").is_some() {
        std::fs::write(&path, &fresh).expect("write include/nvpoll.h");
        return;
    }
    let committed = std::fs::read(&path).unwrap_or_default();
    assert!(
        committed == fresh,
        "capi/include/nvpoll.h is not what cbindgen makes of capi/src: run \
         `NVPOLL_BLESS=1 cargo test -p nvpoll-capi --test header` and commit the header"
    );
}
