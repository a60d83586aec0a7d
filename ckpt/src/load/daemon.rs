//! What the sidecar calls on a rank's persistence core: a step read into memory it provides,
//! and the file of a step on this node's disk opened to hand to a restarted process.

use super::*;

impl Persistence {
    /// Reads this rank's `step` from the tiers that hold it into memory that `alloc` gives for
    /// the file's length (told the nearest tier that holds it), verified chunk by chunk as
    /// [`Engine::load`](crate::Engine::load) does; returns the manifest, the memory and the
    /// tier each chunk came from. This is how the sidecar brings a step back into its memory.
    pub fn read_into<B: AsMut<[u8]>, E: From<Error>>(
        &self,
        step: u64,
        alloc: impl FnOnce(usize, TierKind) -> std::result::Result<B, E>,
    ) -> std::result::Result<(Manifest, B, Vec<TierKind>), E> {
        self.read_into_prefilled(step, alloc, |_, _, _| Vec::new())
    }

    /// [`Persistence::read_into`], where `prefill` may first fill chunks of the memory from
    /// elsewhere (told the manifest and the nearest tier): it returns, for each chunk, the
    /// tier it filled it from after checking it against the manifest, or `None` (a shorter
    /// list leaves the rest to read). Only the chunks it did not fill are read from the tiers.
    /// How the sidecar takes a step's chunks from the peers that share them before the store.
    pub fn read_into_prefilled<B: AsMut<[u8]>, E: From<Error>>(
        &self,
        step: u64,
        alloc: impl FnOnce(usize, TierKind) -> std::result::Result<B, E>,
        prefill: impl FnOnce(&Manifest, TierKind, &mut [u8]) -> Vec<Option<TierKind>>,
    ) -> std::result::Result<(Manifest, B, Vec<TierKind>), E> {
        let inner = self;
        let (manifest, tiers) = inner.sources(step)?;
        let tiers = as_sources(&tiers);
        let len = file_len(&manifest)?;
        let mut buf = alloc(len, tiers[0].kind())?;
        let n = manifest.chunks.len();
        let mut filled = prefill(&manifest, tiers[0].kind(), &mut buf.as_mut()[..len]);
        filled.resize(n, None);
        let rest: Vec<usize> = (0..n).filter(|&i| filled[i].is_none()).collect();
        let direct = (0..n).map(|_| Vec::new()).collect();
        // Into host memory only: the GPU contexts stay unmade.
        let read = if rest.is_empty() {
            Vec::new()
        } else {
            inner.read_chunks(
                &Gpu::new(),
                step,
                &manifest,
                &tiers,
                &mut buf.as_mut()[..len],
                direct,
                false,
                (rest.len() < n).then_some(&rest[..]),
            )?
        };
        let mut read = read.into_iter();
        let sources = filled
            .into_iter()
            .map(|f| f.or_else(|| read.next()).unwrap_or(TierKind::Store))
            .collect();
        Ok((manifest, buf, sources))
    }
}

impl Persistence {
    /// The manifest, file and tier of `step` where the tier a load would take as its reference
    /// keeps local files and the file has the manifest's length.
    pub(super) fn local_step(&self, step: u64) -> Option<(Manifest, std::path::PathBuf, TierKind)> {
        let key = format::data_key(&self.job, step, self.rank);
        for tier in &self.tiers {
            // A tier that is not local ends the search before its manifest is read (a round
            // trip to a remote store): it would be the reference if it holds the step.
            let path = tier.local_path(&key)?;
            if let Ok(Some(m)) = self.read_manifest(tier.as_ref(), step) {
                let len = std::fs::metadata(&path).ok()?.len();
                return (len == m.file_len).then_some((m, path, tier.kind()));
            }
        }
        None
    }

    /// This rank's `step` where the tier a load would take it from keeps it in a local file
    /// (disk tier, or a store that is a local directory): its manifest, the file opened for
    /// reading (`O_DIRECT` where the file system takes it) and that tier. What the sidecar
    /// hands a training process to load itself, verifying every chunk; None where the step's
    /// nearest tier is not local.
    pub fn open_local_file(
        &self,
        step: u64,
    ) -> Result<Option<(Manifest, std::fs::File, TierKind)>> {
        let Some((m, path, kind)) = self.local_step(step) else {
            return Ok(None);
        };
        let file = hotstart_store::uring::open_for_reading(&path, &self.uring)
            .map_err(|e| Error::store("open", path.display().to_string(), e))?;
        Ok(Some((m, file, kind)))
    }
}
