"""Dependency snapshots: restore an installed environment instead of reinstalling it.

>>> import hotstart.env
>>> r = hotstart.env.ensure(
...     store="s3://bucket/envs", lock="requirements.txt", target="/opt/venv",
...     command=["sh", "-c", "python3 -m venv /opt/venv && /opt/venv/bin/pip install -r requirements.txt"],
... )
>>> r.action, r.seconds        # ("restored", 0.8) on a hit; ("installed", ...) on a miss

The same as ``hotstart env ensure`` (see its ``--help``): the key is blake3 over the lock files'
bytes, the interpreter, the platform, the install command and (unless ``relocatable``) the
target. A hit restores the snapshot into a temporary directory renamed into place; a miss runs
the install command (its output goes to this process's stdout and stderr), then captures and
publishes the target for every later call on any node.

``lazy=True`` is not available from Python: a lazy mount must be served by a process for as long
as the job reads from it. Run ``hotstart env ensure --lazy ...`` beside the job instead.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, Dict, Optional, Sequence, Union

from . import _core
from .errors import ConfigError

__all__ = ["EnsureResult", "ensure"]

PathLike = Union[str, "os.PathLike[str]"]


@dataclass(frozen=True)
class EnsureResult:
    """What :func:`ensure` did."""

    #: ``"present"`` (the target already held it), ``"restored"`` or ``"installed"``.
    action: str
    #: The snapshot key, 64 hex digits.
    key: str
    #: The absolute target.
    target: str
    #: Wall time of the whole call.
    seconds: float
    #: Regular files and bytes of file content restored (0 unless restored).
    files: int = 0
    bytes: int = 0
    #: On a miss: whether this call published the snapshot (False if another node was first, or
    #: if publishing failed: see ``details["publish_error"]``).
    published: Optional[bool] = None
    #: Every figure ``hotstart env ensure --json`` prints (fetched chunks, hard links,
    #: relocation, upload figures).
    details: Dict[str, Any] = field(default_factory=dict, repr=False)


def ensure(
    store: str,
    lock: Union[PathLike, Sequence[PathLike]],
    target: PathLike,
    command: Sequence[str],
    *,
    lazy: bool = False,
    python: Optional[str] = None,
    relocatable: bool = False,
    cache_dir: Optional[PathLike] = None,
    cache_size: Optional[int] = None,
    hardlinks: bool = True,
) -> EnsureResult:
    """Makes ``target`` hold the environment of ``lock`` and ``command``.

    ``store`` is a directory, ``file://`` or ``s3://bucket/prefix`` URL; ``lock`` one or more
    lock or requirements files; ``command`` the install command (it sees ``HOTSTART_ENV_TARGET``
    and ``HOTSTART_ENV_KEY``); ``python`` the interpreter (default ``python3``);
    ``relocatable`` leaves the target out of the key. ``cache_dir`` is the node-local cache
    (default ``$HOTSTART_CACHE_DIR``, else ``~/.cache/hotstart``), ``cache_size`` its bytes.

    Raises :class:`~hotstart.errors.InstallFailed` (with ``returncode``),
    :class:`~hotstart.errors.TargetInUse`, :class:`~hotstart.errors.CorruptSnapshot`,
    :class:`~hotstart.errors.ConfigError` (also for ``lazy=True``) or
    :class:`~hotstart.errors.StoreError`.
    """
    if lazy:
        raise ConfigError(
            "lazy=True is not available from Python: a lazy mount must be served by a process "
            "for as long as the job reads from it; run `hotstart env ensure --lazy ...` beside "
            "the job instead"
        )
    if isinstance(lock, (str, os.PathLike)):
        locks = [os.fspath(lock)]
    else:
        locks = [os.fspath(p) for p in lock]
    if isinstance(command, str):
        raise ConfigError("command must be a list of arguments, e.g. ['sh', '-c', '...']")
    out: Dict[str, Any] = json.loads(
        _core.env_ensure(
            store,
            locks,
            os.fspath(target),
            list(command),
            python=python,
            relocatable=relocatable,
            cache_dir=None if cache_dir is None else os.fspath(cache_dir),
            cache_size=cache_size,
            hardlinks=hardlinks,
        )
    )
    return EnsureResult(
        action=out["action"],
        key=out["key"],
        target=out["target"],
        seconds=out["seconds"],
        files=out.get("files", 0),
        bytes=out.get("bytes", 0),
        published=out.get("published"),
        details=out,
    )
