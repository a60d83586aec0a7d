//! The chunk-sharing design at 1,000 and 10,000 nodes, on paper: a piece-level simulation fed
//! with the rates `hotstart-benches swarm` shapes and measures (store link, node links, how
//! fast one node processes the artifact). Its store bytes agree with the measured swarms; its
//! times assume every node has cores of its own, which the measured swarms (N nodes on this
//! machine's two cores) do not have.
//!
//! **The design it simulates.** Up to `--cell` nodes, a node knows every other one and asks a
//! piece's owner (rendezvous over the nodes), and every holder passes a piece on to at most
//! `--fanout` nodes at once (the sidecar's upload slots and redirects), as the sidecar does
//! today. Past that, nodes are
//! grouped into cells of `--cell` nodes (probes and connections stay within the cell, plus the
//! few nodes it reaches in other cells): each piece has a global owner (rendezvous over the
//! cells, then over that cell's nodes), which alone reads it from the store; the piece's owner
//! in every other cell fetches it from the global owner, and the nodes of a cell from their
//! cell's owner. The store sends each piece once; a node uploads its cell's share of the
//! artifact to its cell (about the artifact once) plus the pieces it owns globally to one node
//! per cell.
//!
//! **The model.** Every transfer of a piece is store-and-forward: it starts when the piece is
//! at the sender and both the sender's uplink and the receiver's downlink are free, and holds
//! both for `size / min(up, down)` plus one link latency. Links serve one transfer at a time in
//! the order transfers become possible (list scheduling: a little pessimistic against TCP
//! sharing a link among several). The store is a sender whose uplink is the store link. A node
//! is ready when it has every piece and has processed them at its measured rate (processing
//! overlaps with arrival). Every node asks for the pieces in the same order, its owned pieces
//! first. The cost of a node that is not there (a dead owner) and of hedging are left out: they
//! move a few pieces, not the shape.

use std::collections::BinaryHeap;

#[derive(Debug, clap::Args)]
pub struct ModelArgs {
    /// Node counts to simulate.
    #[arg(long, value_delimiter = ',', default_value = "4,8,16,1000,10000")]
    nodes: Vec<usize>,
    /// The artifact, in MiB.
    #[arg(long, default_value_t = 64)]
    artifact_mib: u64,
    /// Piece size, in MiB.
    #[arg(long, default_value_t = 4)]
    piece_mib: u64,
    /// The store link, in MB/s.
    #[arg(long, default_value_t = 100.0)]
    store_mbs: f64,
    /// Each node's link, each way, in MB/s.
    #[arg(long, default_value_t = 125.0)]
    node_mbs: f64,
    /// How fast one node processes the artifact (decompress, check, write), in MB/s: on this
    /// machine an environment restore from a local directory runs at about 250 MB/s (502 MB
    /// in 1.95 s, `hotstart-benches env`).
    #[arg(long, default_value_t = 250.0)]
    process_mbs: f64,
    /// One-way latency of a link, in ms.
    #[arg(long, default_value_t = 0.5)]
    latency_ms: f64,
    /// Nodes per cell.
    #[arg(long, default_value_t = 128)]
    cell: usize,
    /// Peers a holder of a piece sends it to at once (the sidecar's upload slots per piece).
    #[arg(long, default_value_t = 3)]
    fanout: usize,
}

/// What the simulation found for one N.
#[derive(Debug, Clone, Copy)]
pub struct Outcome {
    pub n: usize,
    /// Seconds until the last node is ready, sharing.
    pub shared: f64,
    /// The same, every node reading the store.
    pub alone: f64,
    /// Bytes the store sent, over the artifact.
    pub store_ratio: f64,
    /// Most bytes one node uploaded, over the artifact.
    pub max_upload_ratio: f64,
    /// Peers one node connects to (at most).
    pub connections: usize,
}

/// A sender or receiver link, free from `free` on.
#[derive(Debug, Clone, Copy, Default)]
struct Link {
    free: f64,
}

/// Simulates `n` nodes; see the module docs.
pub fn simulate(args: &ModelArgs, n: usize) -> Outcome {
    let piece = (args.piece_mib << 20) as f64;
    let pieces = args.artifact_mib.div_ceil(args.piece_mib).max(1) as usize;
    let (store_bps, node_bps) = (args.store_mbs * 1e6, args.node_mbs * 1e6);
    let lat = args.latency_ms / 1e3;
    let cell = args.cell.max(1).min(n);
    let cells = n.div_ceil(cell);
    // Rendezvous stand-ins: spread evenly, as hashing does for many pieces.
    let global_owner = |p: usize| (p * 7919) % n;
    let cell_of = |node: usize| node / cell;
    // The piece's owner in cell `c`: the global owner in its own cell.
    let owner_in = |p: usize, c: usize| {
        if c == cell_of(global_owner(p)) {
            return global_owner(p);
        }
        let members = (c * cell)..((c + 1) * cell).min(n);
        members.start + (p * 104_729 + c) % members.len()
    };
    // (when possible, sender, receiver, piece): a min-heap by time.
    #[derive(PartialEq)]
    struct Ev(f64, usize, usize, usize);
    impl Eq for Ev {}
    impl PartialOrd for Ev {
        fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
            Some(self.cmp(o))
        }
    }
    impl Ord for Ev {
        fn cmp(&self, o: &Self) -> std::cmp::Ordering {
            o.0.total_cmp(&self.0).then(o.3.cmp(&self.3))
        }
    }
    const STORE: usize = usize::MAX;
    let mut up = vec![Link::default(); n];
    let mut down = vec![Link::default(); n];
    let mut store_up = Link::default();
    let mut uploaded = vec![0f64; n];
    let mut arrived = vec![vec![f64::INFINITY; pieces]; n];
    let mut heap = BinaryHeap::new();
    for p in 0..pieces {
        heap.push(Ev(0.0, STORE, global_owner(p), p));
    }
    // Who still waits for each piece: the other cells' owners (from the global owner's tree),
    // and each cell's members (from its owner's tree); a cursor into each list.
    let cell_members = |c: usize| (c * cell)..((c + 1) * cell).min(n);
    let mut cross: Vec<(Vec<usize>, usize)> = (0..pieces)
        .map(|p| {
            let home = cell_of(global_owner(p));
            let targets = (0..cells)
                .filter(|&c| c != home)
                .map(|c| owner_in(p, c))
                .collect();
            (targets, 0)
        })
        .collect();
    let mut inner: Vec<Vec<(Vec<usize>, usize)>> = (0..pieces)
        .map(|p| {
            (0..cells)
                .map(|c| {
                    let o = owner_in(p, c);
                    (cell_members(c).filter(|&m| m != o).collect(), 0)
                })
                .collect()
        })
        .collect();
    let mut store_bytes = 0f64;
    while let Some(Ev(at, from, to, p)) = heap.pop() {
        let sender_free = if from == STORE {
            store_up.free
        } else {
            up[from].free
        };
        let start = at.max(sender_free).max(down[to].free);
        if start > at {
            // A link is busy: try again when both are free, so that transfers take links in
            // the order they can start.
            heap.push(Ev(start, from, to, p));
            continue;
        }
        let rate = if from == STORE {
            store_bps.min(node_bps)
        } else {
            node_bps
        };
        let end = start + piece / rate + lat;
        if from == STORE {
            store_up.free = end - lat;
            store_bytes += piece;
        } else {
            up[from].free = end - lat;
            uploaded[from] += piece;
        }
        down[to].free = end - lat;
        if arrived[to][p] <= end {
            continue;
        }
        arrived[to][p] = end;
        // Every holder passes the piece on to up to `fanout` more (the relay tree a busy
        // sender's redirects make): other cells' owners first, then its own cell.
        let c = cell_of(to);
        let give = |list: &mut (Vec<usize>, usize), heap: &mut BinaryHeap<Ev>| {
            for _ in 0..args.fanout {
                if list.1 >= list.0.len() {
                    break;
                }
                heap.push(Ev(end, to, list.0[list.1], p));
                list.1 += 1;
            }
        };
        if to == owner_in(p, c) {
            give(&mut cross[p], &mut heap);
        }
        give(&mut inner[p][c], &mut heap);
    }
    // Ready: every piece arrived and processed in order of arrival at the node's rate.
    let per_piece = piece / (args.process_mbs * 1e6);
    let ready = |times: &Vec<f64>| {
        let mut t: Vec<f64> = times.clone();
        t.sort_by(f64::total_cmp);
        t.iter().fold(0f64, |done, &at| done.max(at) + per_piece)
    };
    let shared = arrived.iter().map(ready).fold(0f64, f64::max);
    let artifact = piece * pieces as f64;
    let alone = (artifact * n as f64 / store_bps).max(artifact / node_bps) + per_piece + lat;
    let connections = (cell - 1) + cells.saturating_sub(1);
    Outcome {
        n,
        shared,
        alone,
        store_ratio: store_bytes / artifact,
        max_upload_ratio: uploaded.iter().fold(0f64, |a, &b| a.max(b)) / artifact,
        connections,
    }
}

pub fn run(args: &ModelArgs) -> anyhow::Result<()> {
    println!(
        "### Chunk sharing at scale (simulated)\n\n\
         {} MiB artifact in {} MiB pieces; store link {} MB/s, node links {} MB/s, one node \
         processes {} MB/s; cells of {} nodes; link latency {} ms.\n\n\
         | N | last node ready, sharing | each from the store | store sent ÷ artifact | most one node uploads ÷ artifact | peers one node talks to |\n\
         |---:|---:|---:|---:|---:|---:|",
        args.artifact_mib,
        args.piece_mib,
        args.store_mbs,
        args.node_mbs,
        args.process_mbs,
        args.cell,
        args.latency_ms
    );
    for &n in &args.nodes {
        let o = simulate(args, n);
        println!(
            "| {} | {:.2} s | {:.1} s | {:.2} | {:.2} | {} |",
            o.n, o.shared, o.alone, o.store_ratio, o.max_upload_ratio, o.connections
        );
    }
    Ok(())
}
