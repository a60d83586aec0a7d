//! What the sidecar's integration tests share: a sidecar served in this process.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::time::Duration;

use hotstart_sidecar::{DrainReport, Sidecar, SidecarConfig};

/// A sidecar served on a runtime of its own until dropped.
pub struct Running {
    pub http: SocketAddr,
    pub peer: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    done: Option<std::thread::JoinHandle<hotstart_sidecar::Result<DrainReport>>>,
}

impl Running {
    pub fn start(cfg: SidecarConfig) -> Running {
        let (addrs_tx, addrs_rx) = std::sync::mpsc::channel();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let done = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .expect("runtime");
            rt.block_on(async move {
                let s = Sidecar::bind(cfg).await?;
                let _ = addrs_tx.send((s.http_addr(), s.peer_addr()));
                s.run(async {
                    let _ = stopped.await;
                })
                .await
            })
        });
        let Ok((http, peer)) = addrs_rx.recv() else {
            match done.join().expect("sidecar thread") {
                Err(e) => panic!("sidecar did not bind: {e}"),
                Ok(_) => panic!("sidecar stopped before it bound"),
            }
        };
        let r = Running {
            http,
            peer,
            stop: Some(stop),
            done: Some(done),
        };
        r.wait_ready();
        r
    }

    pub fn wait_ready(&self) {
        for _ in 0..600 {
            if hotstart_testkit::get(self.http, "/readyz", Duration::from_secs(5))
                .is_ok_and(|r| r.status == 200)
            {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("sidecar not ready");
    }

    pub fn stop(mut self) -> DrainReport {
        let _ = self.stop.take().map(|s| s.send(()));
        self.done
            .take()
            .expect("running")
            .join()
            .expect("sidecar thread")
            .expect("sidecar run")
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(d) = self.done.take() {
            let _ = d.join();
        }
    }
}
