//! The sidecar's configuration file (`hotstart serve --config`): TOML parsed, then resolved
//! into a configuration with every value checked, when it names no file to read and no peer by
//! a name that would need DNS.
#![no_main]

use std::net::IpAddr;

use hotstart_fuzz::set_bound;
use hotstart_sidecar::Settings;
use libfuzzer_sys::fuzz_target;

fn ip_literals_only(s: &Settings) -> bool {
    s.peers
        .iter()
        .flatten()
        .flat_map(|e| e.split(','))
        .all(|p| {
            let addr = p.split_once('=').map_or(p, |(_, a)| a).trim();
            addr.rsplit_once(':')
                .is_none_or(|(host, _)| host.trim_matches(['[', ']']).parse::<IpAddr>().is_ok())
        })
}

fuzz_target!(init: set_bound(16 << 20), |data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let Ok(mut settings) = Settings::from_toml(text) else { return };
    settings.token_file = None;
    if ip_literals_only(&settings) {
        let _ = settings.resolve();
    }
});
