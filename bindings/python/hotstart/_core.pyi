"""Type stubs of the native module `hotstart._core` (the engine binding). Private: use
`hotstart.Checkpointer` and `hotstart.torch`."""

from typing import Callable, Dict, List, Optional, Sequence, Tuple, TypedDict, Union, final

__all__ = ["CUDA_BUILT", "Engine", "SaveHandle", "__version__", "env_ensure"]

__version__: str
CUDA_BUILT: bool

# (name, safetensors dtype, shape, address, byte length, device: -1 host or CUDA ordinal)
_TensorSpec = Tuple[str, str, Sequence[int], int, int, int]
# (name, address, byte length, device)
_DestSpec = Tuple[str, int, int, int, Optional[int]]

class _Manifest(TypedDict):
    step: int
    rank: int
    world_size: int
    # (name, safetensors dtype, shape), in file order
    tensors: List[Tuple[str, str, List[int]]]
    # each tensor's byte range in the file, in the same order
    ranges: List[Tuple[int, int]]
    file_len: int
    extras: Dict[str, bytes]

@final
class SaveHandle:
    @property
    def step(self) -> int: ...
    def wait_staged(self) -> None: ...
    def wait_persisted(self, tier: Optional[str] = None) -> None: ...
    def wait(self) -> None: ...
    def done(self) -> bool: ...
    def staged(self) -> bool: ...
    def exception(self) -> Optional[BaseException]: ...
    def status(self) -> Dict[str, object]: ...

@final
class Engine:
    def __new__(
        cls,
        job: str,
        rank: int,
        world_size: int,
        *,
        store: Optional[str] = None,
        local_dir: Optional[str] = None,
        sidecar: Optional[str] = None,
        keep: int = 3,
        max_inflight: int = 2,
        when_full: str = "block",
        chunk_size: Optional[int] = None,
        threads: int = 0,
        sidecar_wait: float = 60.0,
    ) -> Engine: ...
    def reader(self, rank: int, world_size: int) -> Engine: ...
    @property
    def job(self) -> str: ...
    @property
    def rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def tiers(self) -> List[str]: ...
    @property
    def skipped(self) -> int: ...
    def save(
        self,
        step: int,
        tensors: Sequence[_TensorSpec],
        extras: Dict[str, bytes],
        keep: Sequence[object],
    ) -> SaveHandle: ...
    def manifest(self, step: int, rank: Optional[int] = None) -> _Manifest: ...
    def load(self, step: int, destinations: Sequence[_DestSpec]) -> List[str]: ...
    def restore(
        self,
        step: Optional[int],
        plan: Callable[[_Manifest, Optional[int]], Union[Sequence[_DestSpec], Tuple[int, int, bool]]],
    ) -> Tuple[int, List[str], Optional[str]]: ...
    def latest_step(self) -> Optional[int]: ...
    def latest_step_below(self, step: int) -> Optional[int]: ...
    def latest_checkpoint(self) -> Optional[Tuple[int, int]]: ...
    def latest_checkpoint_below(self, step: int) -> Optional[Tuple[int, int]]: ...
    def steps(self) -> List[int]: ...
    def wait(self) -> None: ...
    def gc(self) -> Dict[str, List[int]]: ...

def env_ensure(
    store: str,
    locks: List[str],
    target: str,
    command: List[str],
    *,
    python: Optional[str] = None,
    relocatable: bool = False,
    cache_dir: Optional[str] = None,
    cache_size: Optional[int] = None,
    hardlinks: bool = True,
) -> str: ...
