//! Every command gets exactly one answer: the stateful session fuzzer of `exactly_once` against the target,
//! briefly (CI). `cargo bench -p nvpoll-target --bench exactly_once` runs it at length.

use nvpoll_testkit::exactly_once;
use nvpoll_testkit::target as target_common;

use target_common::TestTarget;

/// Seeds and rounds for CI: a few seconds. NVPOLL_EXACTLY_ONCE_SEED picks one seed (to repeat a failure).
fn seeds() -> Vec<u64> {
    match std::env::var("NVPOLL_EXACTLY_ONCE_SEED") {
        Ok(s) => vec![u64::from_str_radix(s.trim_start_matches("0x"), 16).expect("a hex seed")],
        Err(_) => vec![0x33, 0x5eed_0001, 0xdc_e107_0b1c],
    }
}

#[test]
fn every_command_is_answered_exactly_once() {
    let t = TestTarget::start(|c| c);
    for seed in seeds() {
        let tally =
            exactly_once::run(t.addr, seed, 20, 400, None).unwrap_or_else(|e| panic!("{e}"));
        eprintln!("seed {seed:#x}: {tally}");
        assert!(tally.commands > 0 && tally.answers > 0);
    }
    let c = t.counters();
    assert_eq!(c.internal_errors, 0, "{c}");
}
