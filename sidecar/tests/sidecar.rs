//! The engine in sidecar mode against sidecars run in this process: what the save handle
//! reports, loads as views of shared memory, peers found by DNS, a training process that lies
//! on the Unix socket, and loads when the sidecar is gone.

#[path = "../../ckpt/tests/common/mod.rs"]
mod common;
mod support;

use std::net::{SocketAddr, TcpListener};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::time::Duration;

use common::*;
use hotstart_ckpt::format::{Layout, Manifest, Region};
use hotstart_ckpt::{
    Destination, Dtype, Engine, EngineConfig, Error, Phase, StepSel, Tensor, TierKind,
};
use hotstart_proto::shm::Segment;
use hotstart_proto::wire::{Conn, FdStream, LocalMsg, Side};
use hotstart_sidecar::{ClusterKey, Held, Identity, PeerClient, Settings, Token};
use support::Running;

/// A sidecar's settings; port 0 lets the kernel pick its peer port when it binds, so a sidecar
/// restarted in a test never races another socket for a port chosen in advance.
fn settings(node: &str, ip: &str, port: u16, socket: &Path) -> Settings {
    Settings {
        node_id: Some(node.into()),
        listen: Some(format!("{ip}:{port}")),
        http: Some(format!("{ip}:0")),
        socket: Some(socket.to_path_buf()),
        memory_budget: Some("256MiB".parse().unwrap()),
        token: Some(Token::new("t0ken").unwrap()),
        probe_interval: Some("200ms".parse().unwrap()),
        recovery_timeout: Some("5s".parse().unwrap()),
        ..Settings::default()
    }
}

fn sidecar_engine(socket: &Path, job: &str) -> Engine {
    let mut cfg = EngineConfig::new(job, 0, 1).sidecar(socket);
    cfg.chunk_size = 256 << 10;
    Engine::new(cfg).expect("engine attached to the sidecar")
}

#[test]
fn the_handle_reports_every_tier_and_loads_are_views_of_shared_memory() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("s.sock");
    let mut s = settings("solo", "127.0.0.1", 0, &socket);
    s.disk_dir = Some(dir.path().join("disk"));
    s.store = Some(format!("{}", dir.path().join("store").display()));
    let sidecar = Running::start(s.resolve().unwrap());
    let engine = sidecar_engine(&socket, "views");
    assert_eq!(
        engine.tiers(),
        [TierKind::Memory, TierKind::Disk, TierKind::Store]
    );
    assert_eq!(engine.sidecar(), Some(socket.as_path()));

    let sets: Vec<_> = (1..=2).map(|step| sample_tensors(step, 1 << 20)).collect();
    for (i, set) in sets.iter().enumerate() {
        let step = i as u64 + 1;
        let h = engine.save(step, to_tensors(set), extras(step)).unwrap();
        h.wait().unwrap();
        let st = h.status();
        for t in [&st.staged, &st.memory, &st.disk, &st.store] {
            assert!(matches!(t, Phase::Done), "{st:?}");
        }
        assert!(matches!(st.peers, Phase::Off), "no peers configured");
    }
    assert_eq!(engine.latest_complete_step().unwrap(), Some(2));
    // Where a job goes back to when a rank cannot restore step 2.
    assert_eq!(engine.latest_complete_step_below(2).unwrap(), Some(1));
    assert_eq!(engine.latest_complete_step_below(1).unwrap(), None);
    let l = engine.load(StepSel::Latest, Destination::Owned).unwrap();
    assert_eq!(l.step, 2);
    assert_loaded(&l, &sets[1], &extras(2));
    assert!(l.chunk_sources.iter().all(|s| *s == TierKind::Memory));
    // Owned tensors are views of the sealed segment: they outlive the engine and the sidecar.
    let big = l
        .tensors
        .iter()
        .find(|t| t.name == "big")
        .unwrap()
        .data
        .clone();
    let l1 = engine.load(StepSel::Step(1), Destination::Owned).unwrap();
    assert_loaded(&l1, &sets[0], &extras(1));
    // Into caller buffers: one copy, every byte.
    load_into_buffers(&engine, StepSel::Latest, &sets[1]);
    // Buffers decided from the restored step's manifest, in the same single request.
    let mut planned: Vec<(String, Vec<u8>)> = Vec::new();
    let slot = &mut planned;
    let plan = Destination::Planned(Box::new(move |m, file| {
        assert!(
            file.is_none(),
            "a step in the sidecar's memory comes with no file"
        );
        *slot = m
            .tensors
            .iter()
            .map(|t| (t.name.clone(), vec![0; t.len() as usize]))
            .collect();
        Ok(Destination::Buffers(
            slot.iter_mut()
                .map(|(n, b)| (n.clone(), &mut b[..]))
                .collect(),
        ))
    }));
    let l = engine.load(StepSel::Latest, plan).unwrap();
    assert!(l.step == 2 && l.tensors.is_empty());
    for t in &sets[1] {
        assert!(
            planned.iter().any(|(n, b)| n == &t.0 && b == &t.3),
            "{}",
            t.0
        );
    }
    // A step nobody has, and a bad destination, are errors before anything is mapped.
    assert!(
        engine
            .load(StepSel::Step(9), Destination::Owned)
            .unwrap_err()
            .is_not_found()
    );
    let mut small = [0u8; 3];
    let bad = [("big".to_string(), &mut small[..])].into_iter().collect();
    assert!(matches!(
        engine.load(StepSel::Latest, Destination::Buffers(bad)),
        Err(Error::Destination { .. })
    ));
    drop(engine);
    let report = sidecar.stop();
    assert!(report.complete());
    assert!(big[..] == sets[1].last().unwrap().3[..]);
}

#[test]
fn peers_found_through_dns_hold_the_replicas() {
    // Both listen on the same port of two loopback addresses; "localhost" resolves to the
    // first only, so the second finds it by name, and the first finds only itself (skipped).
    let port = hotstart_testkit::free_port().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let mut a = settings("node-a", "127.0.0.1", port, &dir.path().join("a.sock"));
    a.peers_dns = Some(format!("localhost:{port}"));
    let mut b = settings("node-b", "127.0.0.2", port, &dir.path().join("b.sock"));
    b.peers_dns = Some(format!("localhost:{port}"));
    let sa = Running::start(a.resolve().unwrap());
    let sb = Running::start(b.resolve().unwrap());

    let engine = sidecar_engine(&dir.path().join("b.sock"), "dns");
    assert_eq!(engine.tiers(), [TierKind::Memory, TierKind::Peer]);
    let set = sample_tensors(3, 1 << 20);
    let h = engine.save(1, to_tensors(&set), extras(1)).unwrap();
    h.wait_persisted(TierKind::Peer).unwrap();
    let key = ClusterKey::new(b"t0ken");
    let me = Identity {
        node: "tester".into(),
        domain: String::new(),
    };
    let held = PeerClient::connect(
        sa.peer,
        None,
        &key,
        &me,
        Some("node-a"),
        Duration::from_secs(5),
    )
    .unwrap()
    .inventory(Some("dns"))
    .unwrap();
    assert_eq!(held.len(), 1, "{held:?}");
    assert_eq!(
        (held[0].origin.as_str(), held[0].held, held[0].step),
        ("node-b", Held::Memory, 1)
    );
    drop(engine);
    drop(sb);
    drop(sa);
}

/// A tensor set's staged file: the header and the tensors back to back.
fn file_of(layout: &Layout, set: &[(String, Dtype, Vec<u64>, Vec<u8>)]) -> Vec<u8> {
    let mut f = layout.header.clone();
    for t in set {
        f.extend_from_slice(&t.3);
    }
    f
}

#[test]
fn a_training_process_that_lies_about_its_segment_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("s.sock");
    let sidecar = Running::start(settings("solo", "127.0.0.1", 0, &socket).resolve().unwrap());
    let set = sample_tensors(1, 600 << 10);
    let tensors: Vec<Tensor> = to_tensors(&set);
    let layout = Layout::new("liar", 1, 1, &tensors).unwrap();
    let file = file_of(&layout, &set);
    let chunk = 256 << 10;
    // What `Filled` carries: the layout, the chunk hashes left for the sidecar (all zero).
    let unhashed = |step: u64| {
        let zero = vec![blake3::Hash::from_bytes([0; 32]); file.len().div_ceil(chunk)];
        let m = Manifest::new("liar", step, 0, 1, &layout, chunk as u64, &zero, &extras(1));
        String::from_utf8(m.to_json()).unwrap()
    };
    let manifest = unhashed(1);
    let attach = || {
        let mut c = Conn::new(
            FdStream::new(UnixStream::connect(&socket).unwrap()),
            "s",
            Side::Local,
        );
        c.send(&LocalMsg::Attach {
            version: hotstart_proto::PROTOCOL_VERSION,
            job: "liar".into(),
            rank: 0,
            world_size: 1,
        })
        .unwrap();
        assert!(matches!(
            c.recv::<LocalMsg>().unwrap(),
            LocalMsg::Attached { .. }
        ));
        c
    };
    let stage = |c: &mut Conn<FdStream>, step: u64| {
        c.send(&LocalMsg::Stage {
            step,
            len: file.len() as u64,
            wait: false,
            ahead: false,
        })
        .unwrap();
        assert!(matches!(
            c.recv::<LocalMsg>().unwrap(),
            LocalMsg::Segment { .. }
        ));
        Segment::from_fd(c.take_fd().unwrap()).unwrap()
    };
    let write = |seg: &Segment, bytes: &[u8]| {
        let map = seg.map_writable().unwrap();
        // SAFETY: this test's own mapping, written by this thread only.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), map.as_ptr(), bytes.len()) };
        map
    };
    let refused = |c: &mut Conn<FdStream>| match c.recv::<LocalMsg>().unwrap() {
        LocalMsg::Failed { reason } => reason,
        other => panic!("{other:?}"),
    };

    // Still mapped writable at commit: the sidecar cannot tell yet, but it never hands such a
    // segment out. A restore cannot seal it, drops it from memory and finds nothing else (no
    // other tier here).
    let mut c = attach();
    let seg = stage(&mut c, 1);
    let map = write(&seg, &file);
    drop(seg);
    c.send(&LocalMsg::Filled {
        manifest: manifest.clone(),
    })
    .unwrap();
    c.send(&LocalMsg::Commit).unwrap();
    assert!(matches!(c.recv::<LocalMsg>().unwrap(), LocalMsg::Committed));
    let mut r = attach();
    r.send(&LocalMsg::Restore {
        step: Some(1),
        file: true,
        regions: None,
    })
    .unwrap();
    assert!(matches!(
        r.recv::<LocalMsg>().unwrap(),
        LocalMsg::NotFound { step: Some(1) }
    ));
    drop((map, c, r));
    // A commit before the segment was said to be filled: refused, not held.
    let mut c = attach();
    let seg = stage(&mut c, 1);
    drop(write(&seg, &file));
    drop(seg);
    c.send(&LocalMsg::Commit).unwrap();
    let why = refused(&mut c);
    assert!(why.contains("commit before filled"), "{why}");
    // A manifest of another rank: refused.
    let mut c = attach();
    let seg = stage(&mut c, 1);
    drop(write(&seg, &file));
    drop(seg);
    let other = manifest
        .replace("\"rank\": 0", "\"rank\": 1")
        .replace("\"world_size\": 1", "\"world_size\": 2");
    c.send(&LocalMsg::Filled { manifest: other }).unwrap();
    c.send(&LocalMsg::Commit).unwrap();
    assert!(!refused(&mut c).is_empty());
    // A training process that dies mid-stage: nothing held, its memory given back.
    let mut c = attach();
    let seg = stage(&mut c, 1);
    drop(seg);
    drop(c);
    // The honest way works, and nothing from the liars was kept.
    let engine = sidecar_engine(&socket, "liar");
    assert!(
        engine
            .load(StepSel::Latest, Destination::Owned)
            .unwrap_err()
            .is_not_found()
    );
    engine.save(1, tensors, extras(1)).unwrap().wait().unwrap();
    let l = engine.load(StepSel::Latest, Destination::Owned).unwrap();
    assert_loaded(&l, &set, &extras(1));
    let page = hotstart_testkit::get(sidecar.http, "/metrics", Duration::from_secs(5))
        .unwrap()
        .text();
    let v = |n: &str| hotstart_sidecar::metrics::sample(&page, n).unwrap();
    assert_eq!(v("hotstart_failures_total{kind=\"restore\"}"), 1.0);
    assert_eq!(v("hotstart_memory_shards{origin=\"local\"}"), 1.0);

    // `Filled`, then gone before the commit (killed right after `wait_staged`): the bytes are
    // whole, so the sidecar commits the step all the same.
    let fill_and_go = |step: u64, keep_mapped: bool| {
        let mut c = attach();
        let seg = stage(&mut c, step);
        let map = write(&seg, &file);
        drop(seg);
        c.send(&LocalMsg::Filled {
            manifest: unhashed(step),
        })
        .unwrap();
        let map = if keep_mapped { Some(map) } else { None };
        drop(c);
        map
    };
    let newest = |want: u64| {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            let got = engine.latest_complete_step().unwrap();
            if got == Some(want) || std::time::Instant::now() > deadline {
                return got;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    assert!(fill_and_go(2, false).is_none());
    assert_eq!(newest(2), Some(2));
    assert_loaded(
        &engine.load(StepSel::Step(2), Destination::Owned).unwrap(),
        &set,
        &extras(1),
    );
    // The same while the segment is still mapped writable somewhere: it cannot be sealed, so
    // it is not held (nothing that may still change is ever committed). Step 4, filled and
    // gone after it, is.
    let still_mapped = fill_and_go(3, true);
    assert!(fill_and_go(4, false).is_none());
    assert_eq!(newest(4), Some(4));
    assert!(
        engine
            .load(StepSel::Step(3), Destination::Owned)
            .unwrap_err()
            .is_not_found()
    );
    drop(still_mapped);
}

#[test]
fn without_the_sidecar_loads_come_from_the_engines_own_tiers() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("s.sock");
    let disk = dir.path().join("disk");
    let mut s = settings("solo", "127.0.0.1", 0, &socket);
    s.disk_dir = Some(disk.clone());
    let sidecar = Running::start(s.resolve().unwrap());
    let mut cfg = EngineConfig::new("gone", 0, 1).sidecar(&socket).disk(&disk);
    cfg.chunk_size = 256 << 10;
    let engine = Engine::new(cfg).unwrap();
    let set = sample_tensors(4, 1 << 20);
    engine
        .save(5, to_tensors(&set), extras(5))
        .unwrap()
        .wait()
        .unwrap();
    let (peer, http) = (sidecar.peer, sidecar.http);
    assert!(sidecar.stop().complete());
    // A stopped sidecar has closed its listeners: its addresses bind again at once.
    for addr in [peer, http] {
        TcpListener::bind(addr).unwrap_or_else(|e| panic!("{addr} still bound after stop: {e}"));
    }
    let l = engine.load(StepSel::Latest, Destination::Owned).unwrap();
    assert_loaded(&l, &set, &extras(5));
    assert!(l.chunk_sources.iter().all(|s| *s == TierKind::Disk));
    // So does every question about the job's steps, as a loop asks them before it loads.
    assert_eq!(engine.latest_complete_step().unwrap(), Some(5));
    assert_eq!(engine.latest_complete_step_below(6).unwrap(), Some(5));
    assert_eq!(engine.steps().unwrap(), vec![5]);
    assert_eq!(engine.latest_checkpoint().unwrap(), Some((5, 1)));
    assert_eq!(engine.manifest(5, 0).unwrap().step, 5);
    // Without tiers of its own, an engine without its sidecar cannot load, and says why.
    let mut alone = EngineConfig::new("gone", 0, 1).sidecar(&socket);
    alone.sidecar_wait = Duration::ZERO;
    match Engine::new(alone) {
        Err(Error::Sidecar { reason, .. }) => assert!(reason.contains("connect"), "{reason}"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_step_only_on_the_sidecars_disk_is_read_from_its_file_and_a_bad_chunk_from_the_store() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("s.sock");
    let disk = dir.path().join("disk");
    let start = || {
        let mut s = settings("solo", "127.0.0.1", 0, &socket);
        s.disk_dir = Some(disk.clone());
        s.store = Some(format!("{}", dir.path().join("store").display()));
        Running::start(s.resolve().unwrap())
    };
    let sidecar = start();
    let engine = sidecar_engine(&socket, "handed");
    let set = sample_tensors(3, 1 << 20);
    let h = engine.save(3, to_tensors(&set), extras(3)).unwrap();
    h.wait_persisted(TierKind::Store).unwrap();
    drop(engine);
    assert!(sidecar.stop().complete());

    // A new sidecar over the same disk and store: its memory holds nothing, its disk the step.
    let sidecar = start();
    let engine = sidecar_engine(&socket, "handed");
    let l = engine.load(StepSel::Latest, Destination::Owned).unwrap();
    assert_loaded(&l, &set, &extras(3));
    assert!(
        l.chunk_sources.iter().all(|s| *s == TierKind::Disk),
        "{:?}",
        l.chunk_sources
    );
    let l = load_into_buffers(&engine, StepSel::Step(3), &set);
    assert!(
        l.chunk_sources.iter().all(|s| *s == TierKind::Disk),
        "{:?}",
        l.chunk_sources
    );
    // Handed over, not copied into the sidecar's memory: nothing held there yet.
    assert_eq!(
        metric(sidecar.http, r#"hotstart_memory_shards{origin="local"}"#),
        0.0
    );

    // One flipped byte in the third chunk (256 KiB each) of the file on disk: the process finds
    // it, and takes that chunk from the segment the sidecar then makes (from disk and store).
    let file = disk.join("handed/step-3/rank-0.safetensors");
    let mut bytes = std::fs::read(&file).unwrap();
    bytes[2 * (256 << 10) + 17] ^= 0x40;
    std::fs::write(&file, bytes).unwrap();
    let l = load_into_buffers(&engine, StepSel::Step(3), &set);
    assert_eq!(l.chunk_sources[2], TierKind::Store, "{:?}", l.chunk_sources);
    assert_eq!(
        l.chunk_sources
            .iter()
            .filter(|k| **k == TierKind::Disk)
            .count(),
        l.chunk_sources.len() - 1,
        "{:?}",
        l.chunk_sources
    );
    // The sidecar now holds the step in memory, and serves it from there.
    assert_eq!(
        metric(sidecar.http, r#"hotstart_memory_shards{origin="local"}"#),
        1.0
    );
    let l = engine.load(StepSel::Step(3), Destination::Owned).unwrap();
    assert_loaded(&l, &set, &extras(3));
    assert!(
        l.chunk_sources.iter().all(|s| *s == TierKind::Memory),
        "{:?}",
        l.chunk_sources
    );

    // Through a new sidecar again, into new memory that privately maps the file it hands over
    // (as the Python package's new tensors are): the flipped chunk is found where it lies and
    // taken from the store into the mapping, the rest stays the file's; the file is unchanged.
    drop(engine);
    assert!(sidecar.stop().complete());
    let _sidecar = start();
    let engine = sidecar_engine(&socket, "handed");
    let corrupt = std::fs::read(&file).unwrap();
    let mut mapped: Option<PrivateMap> = None;
    let slot = &mut mapped;
    let plan = Destination::Planned(Box::new(move |m, file| {
        let file = file.expect("a restarted sidecar hands its disk's file over");
        let map = slot.insert(PrivateMap::of(file, m.file_len as usize));
        Ok(Destination::Held(map.bytes()))
    }));
    let l = engine.load(StepSel::Step(3), plan).unwrap();
    assert_eq!(l.chunk_sources[2], TierKind::Store, "{:?}", l.chunk_sources);
    assert!(
        l.chunk_sources
            .iter()
            .enumerate()
            .all(|(i, k)| i == 2 || *k == TierKind::Disk),
        "{:?}",
        l.chunk_sources
    );
    let mut want = corrupt.clone();
    want[2 * (256 << 10) + 17] ^= 0x40;
    assert!(
        mapped.unwrap().bytes() == &want[..],
        "the mapping holds the step"
    );
    assert!(
        std::fs::read(&file).unwrap() == corrupt,
        "the file is left as it was"
    );
}

/// A private, writable (copy-on-write) mapping of a whole file, unmapped when dropped.
struct PrivateMap(*mut u8, usize);

// SAFETY: the mapping is plain memory that this value alone reaches.
unsafe impl Send for PrivateMap {}

impl PrivateMap {
    fn of(file: &std::fs::File, len: usize) -> PrivateMap {
        use std::os::fd::AsRawFd;
        // SAFETY: a new private mapping of the file at an address of the kernel's choosing.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE,
                file.as_raw_fd(),
                0,
            )
        };
        assert!(p != libc::MAP_FAILED, "{}", std::io::Error::last_os_error());
        PrivateMap(p.cast(), len)
    }

    fn bytes(&mut self) -> &mut [u8] {
        // SAFETY: the mapping is `self.1` bytes long and lives as long as `self`.
        unsafe { std::slice::from_raw_parts_mut(self.0, self.1) }
    }
}

impl Drop for PrivateMap {
    fn drop(&mut self) {
        // SAFETY: unmaps this value's own mapping, which nothing borrows any more.
        unsafe { libc::munmap(self.0.cast(), self.1) };
    }
}

/// A metric of the sidecar serving `http`.
fn metric(http: SocketAddr, name: &str) -> f64 {
    let page = hotstart_testkit::get(http, "/metrics", Duration::from_secs(5))
        .unwrap()
        .text();
    hotstart_sidecar::metrics::sample(&page, name).unwrap_or(0.0)
}

/// Asserts that `l` holds exactly what step `l.step` saved (`sample_tensors(step, big)`).
fn assert_step(l: &hotstart_ckpt::Loaded, big: usize) {
    assert_loaded(l, &sample_tensors(l.step, big), &extras(l.step));
}

#[test]
fn saves_recycle_segments_and_readers_only_ever_see_whole_steps() {
    const BIG: usize = 3 << 20;
    let dir = tempfile::tempdir().unwrap();
    let (sa, sb) = (dir.path().join("a.sock"), dir.path().join("b.sock"));
    let mut b = settings("node-b", "127.0.0.1", 0, &sb);
    b.memory_budget = Some("64MiB".parse().unwrap());
    let b = Running::start(b.resolve().unwrap());
    let mut a = settings("node-a", "127.0.0.1", 0, &sa);
    a.memory_budget = Some("24MiB".parse().unwrap());
    a.disk_dir = Some(dir.path().join("disk"));
    a.replicas = Some(1);
    a.peers = Some(vec![format!("node-b={}", b.peer)]);
    let a = Running::start(a.resolve().unwrap());
    let engine = sidecar_engine(&sa, "recycle");

    // 50 saves, each persisted and replicated before the next: after the first two, every
    // save stages into the segment of an older step.
    for step in 1..=50 {
        let h = engine
            .save(step, to_tensors(&sample_tensors(step, BIG)), extras(step))
            .unwrap();
        h.wait().unwrap();
    }
    // New segments only until the budget is full of steps (a step's file is a little over
    // BIG), then older steps' segments; one segment a save, and one prepared after the last,
    // which the engine asks for in the background after that save.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let (created, recycled) = loop {
        let created = metric(a.http, "hotstart_memory_segments_created_total");
        let recycled = metric(a.http, "hotstart_memory_segments_recycled_total");
        if created + recycled >= 51.0 || std::time::Instant::now() > deadline {
            break (created, recycled);
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let most = ((24 << 20) / hotstart_proto::shm::slot_len(BIG + 1)) as f64;
    assert!(created <= most, "{created} segments created over 50 saves");
    assert_eq!(
        created + recycled,
        51.0,
        "{created} created, {recycled} recycled"
    );
    assert!(
        metric(a.http, "hotstart_memory_peak_bytes") <= (24 << 20) as f64,
        "the budget holds with the prepared segment"
    );
    // Every step that went through a recycled segment was committed whole: the newest from
    // memory, the older ones from disk and from the peer's replica, all bit-exact.
    let l = engine.load(StepSel::Latest, Destination::Owned).unwrap();
    assert_eq!(l.step, 50);
    assert_step(&l, BIG);
    let mut cfg = EngineConfig::new("recycle", 0, 1).disk(dir.path().join("disk"));
    cfg.chunk_size = 256 << 10;
    let from_disk = Engine::new(cfg).unwrap();
    for step in [49, 50] {
        assert_step(
            &from_disk
                .load(StepSel::Step(step), Destination::Owned)
                .unwrap(),
            BIG,
        );
    }

    // Saves go on while another process restores from A's memory and the peer fetches and
    // serves replicas: every load is one whole step, the one it names, bit-exact.
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|s| {
        let readers: Vec<_> = [&sa, &sb]
            .into_iter()
            .map(|sock| {
                let stop = &stop;
                s.spawn(move || {
                    let reader = sidecar_engine(sock, "recycle");
                    let mut seen = 0;
                    // At least once each, even if the saves are over before it starts.
                    while seen == 0 || !stop.load(std::sync::atomic::Ordering::Acquire) {
                        match reader.load(StepSel::Latest, Destination::Owned) {
                            Ok(l) => {
                                assert!(l.step >= 50, "step {} went back", l.step);
                                assert_step(&l, BIG);
                                seen += 1;
                            }
                            Err(e) => panic!("load during saves: {e}"),
                        }
                    }
                })
            })
            .collect();
        for step in 51..=70 {
            let h = engine
                .save(step, to_tensors(&sample_tensors(step, BIG)), extras(step))
                .unwrap();
            h.wait().unwrap();
        }
        stop.store(true, std::sync::atomic::Ordering::Release);
        for r in readers {
            r.join().unwrap();
        }
    });
    let l = engine.load(StepSel::Latest, Destination::Owned).unwrap();
    assert_eq!(l.step, 70);
    assert_step(&l, BIG);
    assert!(metric(a.http, "hotstart_memory_peak_bytes") <= (24 << 20) as f64);
    drop(engine);
    assert!(a.stop().complete());
    drop(b);
}

/// A sidecar killed just as it accepted a save's connection (a restart under a running job):
/// the save waits for the sidecar's next life instead of failing, and its bytes are the ones
/// loaded back.
#[test]
fn a_save_waits_out_a_sidecar_killed_as_it_accepted() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("s.sock");
    let first = Running::start(settings("solo", "127.0.0.1", 0, &socket).resolve().unwrap());
    // Attached to the first life; no save yet, so no segment of it is prepared ahead.
    let engine = sidecar_engine(&socket, "accepted");
    let set = sample_tensors(2, 1 << 20);
    first.stop();

    // The socket accepts the save's connection and drops it unanswered, then the sidecar comes
    // back on it.
    let _ = std::fs::remove_file(&socket);
    let fake = std::os::unix::net::UnixListener::bind(&socket).unwrap();
    let path = socket.clone();
    let back = std::thread::spawn(move || {
        drop(fake.accept().unwrap());
        drop(fake);
        std::fs::remove_file(&path).unwrap();
        Running::start(settings("solo", "127.0.0.1", 0, &path).resolve().unwrap())
    });
    let handle = engine.save(2, to_tensors(&set), extras(2)).unwrap();
    handle.wait().unwrap();
    let _again = back.join().unwrap();
    assert_eq!(engine.steps().unwrap(), [2]);
    let l = engine.load(StepSel::Step(2), Destination::Owned).unwrap();
    assert_loaded(&l, &set, &extras(2));
}

/// A job that comes back with another world size, through the sidecars: the newest checkpoint
/// whatever world size saved it, any rank's manifest (here from a peer's memory), the saved
/// ranks' bytes from wherever they are, and nothing made up once a rank's every copy is gone.
#[test]
fn a_job_of_another_size_finds_and_reads_the_checkpoint_through_the_sidecars() {
    let (pa, pb) = (
        hotstart_testkit::free_port().unwrap(),
        hotstart_testkit::free_port().unwrap(),
    );
    let dir = tempfile::tempdir().unwrap();
    let (sock_a, sock_b) = (dir.path().join("a.sock"), dir.path().join("b.sock"));
    let mut a = settings("node-a", "127.0.0.1", pa, &sock_a);
    a.peers = Some(vec![format!("node-b=127.0.0.1:{pb}")]);
    a.replicas = Some(0);
    let mut b = settings("node-b", "127.0.0.1", pb, &sock_b);
    b.peers = Some(vec![format!("node-a=127.0.0.1:{pa}")]);
    b.replicas = Some(0);
    b.disk_dir = Some(dir.path().join("disk-b"));
    let sa = Running::start(a.resolve().unwrap());
    let sb = Running::start(b.resolve().unwrap());
    sa.wait_ready();
    sb.wait_ready();
    // Each asks only the peers that answered its last probe: wait until they see each other.
    for s in [&sa, &sb] {
        let deadline = std::time::Instant::now() + Duration::from_secs(20);
        while metric(s.http, "hotstart_peers{state=\"up\"}") < 1.0 {
            assert!(
                std::time::Instant::now() < deadline,
                "the peers never saw each other"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    }
    let attach = |socket: &Path, rank: u32, world_size: u32| {
        let mut cfg = EngineConfig::new("grow", rank, world_size).sidecar(socket);
        cfg.chunk_size = 256 << 10;
        Engine::new(cfg).unwrap()
    };
    // Two ranks, one per node, save step 3 (and rank 0 an older step 2 alone: never complete).
    let sets: Vec<_> = (0..2).map(|r| sample_tensors(10 + r, 1 << 20)).collect();
    for (rank, socket) in [&sock_a, &sock_b].into_iter().enumerate() {
        let e = attach(socket, rank as u32, 2);
        e.save(3, to_tensors(&sets[rank]), extras(rank as u64))
            .unwrap()
            .wait()
            .unwrap();
    }
    attach(&sock_a, 0, 2)
        .save(2, to_tensors(&sets[0]), extras(0))
        .unwrap()
        .wait()
        .unwrap();

    // One rank, on node A: step 3 is no checkpoint of its own world size, but it is one of
    // world size 2, found through the peer's memory.
    let single = attach(&sock_a, 0, 1);
    assert_eq!(single.latest_complete_step().unwrap(), None);
    assert_eq!(single.latest_checkpoint().unwrap(), Some((3, 2)));
    assert_eq!(single.latest_checkpoint_below(3).unwrap(), None);
    // Rank 1's manifest is only in node B's memory (no replicas): A asks B for it.
    let m = single.manifest(3, 1).unwrap();
    assert_eq!((m.step, m.rank, m.world_size), (3, 1, 2));
    assert_eq!(m.decode_extras().unwrap(), extras(1));
    assert!(single.manifest(3, 2).unwrap_err().is_not_found());
    assert!(single.manifest(4, 0).unwrap_err().is_not_found());
    // A reader of part of rank 1's file (a reshard) gets from B only the chunks that hold it
    // and the header's, verified; a partial shard does not enter A's memory.
    let big = &sets[1].iter().find(|t| t.0 == "big").unwrap().3;
    let mut part = vec![0u8; 1000];
    let at = 600 << 10;
    let l = attach(&sock_a, 1, 2)
        .load(
            StepSel::Step(3),
            Destination::Regions(vec![("big".into(), Some(at as u64), &mut part[..])]),
        )
        .unwrap();
    assert!(part[..] == big[at..at + 1000]);
    let wanted = [Region {
        tensor: "big".into(),
        offset: at as u64,
        len: 1000,
    }];
    let fetched = m.chunks_for(&wanted).unwrap();
    assert!(fetched.len() < m.chunks.len(), "{fetched:?}");
    assert_eq!(l.chunk_sources, vec![TierKind::Peer; fetched.len()]);
    assert!(l.tensors.is_empty());
    // The saved ranks' bytes, read as those ranks of the saved world size: rank 1's from B.
    for (rank, set) in sets.iter().enumerate() {
        let l = attach(&sock_a, rank as u32, 2)
            .load(StepSel::Step(3), Destination::Owned)
            .unwrap();
        assert_loaded(&l, set, &extras(rank as u64));
        let from = if rank == 0 {
            TierKind::Memory
        } else {
            TierKind::Peer
        };
        assert!(
            l.chunk_sources.iter().all(|s| *s == from),
            "{:?}",
            l.chunk_sources
        );
    }

    // Rank 1 is now whole in A's memory: the same range is read from there, and the load
    // names the sources of the chunks it read, not of the whole segment.
    let mut again = vec![0u8; 1000];
    let l = attach(&sock_a, 1, 2)
        .load(
            StepSel::Step(3),
            Destination::Regions(vec![("big".into(), Some(at as u64), &mut again[..])]),
        )
        .unwrap();
    assert!(again == part);
    assert_eq!(l.chunk_sources, vec![TierKind::Memory; fetched.len()]);

    // Node B goes away, and rank 1 of step 3 with it, except the copy A fetched above: the
    // step is still complete from A alone. Once A restarts too (memory gone, no disk, no
    // store), no tier A can see holds rank 1: no checkpoint, not a made-up one.
    drop(sb);
    assert_eq!(single.latest_checkpoint().unwrap(), Some((3, 2)));
    drop(single);
    drop(sa);
    let mut a = settings("node-a", "127.0.0.1", pa, &sock_a);
    a.recovery_timeout = Some("1s".parse().unwrap());
    let sa = Running::start(a.resolve().unwrap());
    sa.wait_ready();
    let single = attach(&sock_a, 0, 1);
    assert_eq!(single.latest_checkpoint().unwrap(), None);
    assert!(single.manifest(3, 1).unwrap_err().is_not_found());
    drop(single);
    drop(sa);
}

/// The sidecar's disk keeps the newest `keep` steps whatever world size saved each: a job that
/// shrinks to one rank and grows back to two keeps the one rank's step as one of them, where
/// that rank's retention once took it for a torn save of its own world; and a step removed
/// goes whole, with the files of ranks the world saving now does not have.
#[test]
fn the_sidecars_disk_keeps_the_newest_steps_of_every_world_size() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("s.sock");
    let disk = dir.path().join("disk");
    let mut s = settings("solo", "127.0.0.1", 0, &socket);
    s.disk_dir = Some(disk.clone());
    s.keep = Some(2);
    let _sidecar = Running::start(s.resolve().unwrap());
    let files = |step: u64| -> Vec<String> {
        let dir = disk.join("elastic").join(format!("step-{step}"));
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .map(|d| {
                d.map(|e| e.unwrap().file_name().into_string().unwrap())
                    .filter(|n| !n.starts_with('.'))
                    .collect()
            })
            .unwrap_or_default();
        names.sort();
        names
    };
    let rank_files = |ranks: std::ops::Range<u32>| -> Vec<String> {
        ranks
            .flat_map(|r| {
                [
                    format!("rank-{r}.manifest.json"),
                    format!("rank-{r}.safetensors"),
                ]
            })
            .collect()
    };
    let save = |step: u64, world_size: u32| {
        for rank in 0..world_size {
            let mut cfg = EngineConfig::new("elastic", rank, world_size).sidecar(&socket);
            cfg.chunk_size = 256 << 10;
            let e = Engine::new(cfg).unwrap();
            let set = sample_tensors(step + rank as u64, 64 << 10);
            e.save(step, to_tensors(&set), extras(step))
                .unwrap()
                .wait_persisted(TierKind::Disk)
                .unwrap();
        }
    };
    // Retention runs after the save is on disk: once a step's files are gone, the passes that
    // removed them (and looked at every other step) are done.
    let removed = |step: u64| {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while !files(step).is_empty() {
            assert!(
                std::time::Instant::now() < deadline,
                "step {step} was never removed: {:?}",
                files(step)
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    save(100, 2);
    save(150, 1);
    save(200, 2);
    // Step 100 goes, and the one rank's step 150 stays, as one of the newest 2.
    removed(100);
    assert_eq!(files(150), rank_files(0..1));
    assert_eq!(files(200), rank_files(0..2));
    // Step 250 by the one rank again pushes out 150 (its own) and keeps 200 whole.
    save(250, 1);
    removed(150);
    assert_eq!(files(200), rank_files(0..2));
    assert_eq!(files(250), rank_files(0..1));
}

/// A sidecar that accepts connections and never answers (stopped with SIGSTOP, or hung) is
/// waited for as long as `sidecar_wait` allows, never forever, and then named as such.
#[test]
fn a_sidecar_that_never_answers_is_an_error_in_bounded_time() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("s.sock");
    // Connections queue in the backlog, accepted by the kernel, and nobody reads them.
    let _listener = std::os::unix::net::UnixListener::bind(&socket).unwrap();
    let mut cfg = EngineConfig::new("silent", 0, 1).sidecar(&socket);
    cfg.sidecar_wait = Duration::from_secs(1);
    match Engine::new(cfg) {
        Err(Error::Sidecar { reason, .. }) => {
            assert!(reason.contains("did not answer"), "{reason}")
        }
        other => panic!("{other:?}"),
    }
}

/// A peer that cannot be reached counts as a peer failure at every probe that finds it so, on
/// the node that cannot reach it (where the misconfiguration, if it is one, has to be seen).
#[test]
fn an_unreachable_peer_counts_as_a_peer_failure() {
    let dir = tempfile::tempdir().unwrap();
    let socket = dir.path().join("s.sock");
    let closed = hotstart_testkit::free_port().unwrap();
    let mut s = settings("node-a", "127.0.0.1", 0, &socket);
    s.peers = Some(vec![format!("node-b=127.0.0.1:{closed}")]);
    s.recovery_timeout = Some("1s".parse().unwrap());
    let sidecar = Running::start(s.resolve().unwrap());
    sidecar.wait_ready();
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while metric(sidecar.http, "hotstart_failures_total{kind=\"peer\"}") < 2.0 {
        assert!(
            std::time::Instant::now() < deadline,
            "no peer failure counted"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(metric(sidecar.http, "hotstart_peers{state=\"up\"}"), 0.0);
}
