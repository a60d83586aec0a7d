//! [`Faults`]: make a store fail the way real ones do, on command.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::Arc;

use bytes::{Bytes, BytesMut};
use futures::future::BoxFuture;
use futures::stream::{self, BoxStream};
use futures::{FutureExt, StreamExt, TryStreamExt};
use object_store::path::Path;
use parking_lot::Mutex;

use super::{Interceptor, Op, injected};

/// Fails chosen requests and damages GET bodies. Rules can change while the store is in use.
#[derive(Debug, Default)]
pub struct Faults {
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// Calls seen per kind since the rule for that kind was set.
    calls: HashMap<Op, u64>,
    /// Per kind: fail calls numbered `from..=to` (1-based) since the rule was set.
    fail: HashMap<Op, (u64, u64)>,
    /// Drop this many bytes from the end of every GET body.
    truncate_by: u64,
    /// Flip one bit in every GET body.
    corrupt: bool,
}

impl Faults {
    /// The `n`th call of kind `op` from now on fails (once).
    pub fn fail_nth(&self, op: Op, n: u64) {
        let mut s = self.state.lock();
        s.calls.insert(op, 0);
        s.fail.insert(op, (n, n));
    }

    /// Every call of kind `op` from the `n`th on fails, until [`Faults::heal`].
    pub fn fail_from(&self, op: Op, n: u64) {
        let mut s = self.state.lock();
        s.calls.insert(op, 0);
        s.fail.insert(op, (n, u64::MAX));
    }

    /// Every GET body comes back `n` bytes short (a connection cut mid-response).
    pub fn truncate_gets(&self, n: u64) {
        self.state.lock().truncate_by = n;
    }

    /// Every GET body comes back with one bit flipped (silent corruption).
    pub fn corrupt_gets(&self) {
        self.state.lock().corrupt = true;
    }

    /// Removes every rule: the store behaves again.
    pub fn heal(&self) {
        *self.state.lock() = State::default();
    }
}

impl Interceptor for Faults {
    fn before(
        self: Arc<Self>,
        op: Op,
        path: &Path,
        _bytes: u64,
    ) -> BoxFuture<'static, object_store::Result<()>> {
        let fail = {
            let mut s = self.state.lock();
            match s.fail.get(&op).copied() {
                Some((from, to)) => {
                    let n = s.calls.entry(op).or_default();
                    *n += 1;
                    (from..=to).contains(n).then_some(*n)
                }
                None => None,
            }
        };
        let path = path.to_string();
        async move {
            match fail {
                Some(n) => Err(injected(format!(
                    "injected failure of {op:?} call {n} on {path}"
                ))),
                None => Ok(()),
            }
        }
        .boxed()
    }

    fn get_body(
        self: Arc<Self>,
        _path: &Path,
        _range: Range<u64>,
        body: BoxStream<'static, object_store::Result<Bytes>>,
    ) -> BoxStream<'static, object_store::Result<Bytes>> {
        let (truncate_by, corrupt) = {
            let s = self.state.lock();
            (s.truncate_by, s.corrupt)
        };
        if truncate_by == 0 && !corrupt {
            return body;
        }
        // Damage needs the whole body: collect it, then hand it back altered.
        stream::once(async move {
            let mut all: BytesMut = body
                .try_fold(BytesMut::new(), |mut acc, b| async move {
                    acc.extend_from_slice(&b);
                    Ok(acc)
                })
                .await?;
            let keep = all.len().saturating_sub(truncate_by as usize);
            all.truncate(keep);
            if corrupt && !all.is_empty() {
                let mid = all.len() / 2;
                all[mid] ^= 0x01;
            }
            Ok(all.freeze())
        })
        .boxed()
    }
}
