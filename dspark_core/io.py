"""Crash-safe file helpers: every write goes to a temp file in the same folder, is flushed to disk (fsync), then
``os.replace``-d over the target and the folder's entry flushed too: after a crash the file is the old one or the
new one, whole."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterator

from dspark_core.errors import UserError


@contextlib.contextmanager
def atomic_path(path: str | Path, suffix: str = "") -> Iterator[Path]:
    """Yield a temp path beside ``path``; on success it replaces ``path`` atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=suffix or ".tmp", dir=path.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        if tmp_path.exists():
            os.chmod(tmp_path, 0o666 & ~_umask())  # mkstemp makes 0600; give the usual file mode
            fsync_path(tmp_path)
        os.replace(tmp_path, path)
        fsync_dir(path.parent)
    finally:
        if tmp_path.exists():
            tmp_path.unlink()


@contextlib.contextmanager
def atomic_dir(path: str | Path) -> Iterator[Path]:
    """Yield an empty temp dir beside ``path``; on success it replaces ``path`` (old one removed).

    What a killed earlier writer of ``path`` left beside it (its ``.<name>.*.tmp`` / ``.<name>.old-*``) is removed
    first: a stage's output has one writer, so such leftovers belong to no one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in [*path.parent.glob(f".{path.name}.*.tmp"), *path.parent.glob(f".{path.name}.old-*")]:
        shutil.rmtree(stale) if stale.is_dir() and not stale.is_symlink() else stale.unlink()
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes it private; the final dir gets the usual mode
    try:
        yield tmp
        old = None
        if path.exists() or path.is_symlink():
            old = path.parent / f".{path.name}.old-{os.getpid()}"
            os.replace(path, old)
        os.replace(tmp, path)
        if old is not None:
            shutil.rmtree(old) if old.is_dir() and not old.is_symlink() else old.unlink()
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def fsync_path(path: str | Path) -> None:
    """Flush a written file (or, opened read-only, a folder's entries) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | Path) -> None:
    """Flush a folder's entries (a rename into it) to disk; a no-op where folders cannot be opened."""
    try:
        fsync_path(path)
    except OSError:  # e.g. Windows cannot open a folder
        pass


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def git_ignored_dir(path: str | Path) -> Path:
    """Create folder ``path`` (and its parents) holding a ``.gitignore`` of ``*``: git, and so ``dvc exp run``,
    leave the folder and everything in it out, wherever it lies. Returns the path."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    if not (path / ".gitignore").is_file():
        (path / ".gitignore").write_text("*\n")
    return path


def write_json(path: str | Path, obj: Any) -> None:
    with atomic_path(path, ".json") as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=True, default=_json_default) + "\n")


def read_json(path: str | Path) -> Any:
    path = Path(path)
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: file not found") from None
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: not valid JSON ({e})") from None


def _json_default(x: Any) -> Any:
    if hasattr(x, "tolist"):
        return x.tolist()
    if isinstance(x, Path):
        return str(x)
    raise TypeError(f"cannot serialise {type(x).__name__}")


def package_dir(package: str, field: str | None = None) -> Path:
    """Directory of an installed package, found without importing it (``field`` names the param in errors)."""
    import importlib.util

    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        where = f"{field}: " if field else ""
        raise UserError(f"{where}package {package!r} is not installed "
                        f"(pip install --no-deps {package.replace('_', '-')})")
    return Path(next(iter(spec.submodule_search_locations)))


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def sha256_json(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=_json_default).encode()).hexdigest()


def save_safetensors(tensors: dict[str, Any], path: str | Path, metadata: dict[str, str] | None = None) -> None:
    """``safetensors.torch.save_file`` with the same bytes for the same input: the library writes the header's
    metadata map in a random order (so DVC would see a changed output and rerun what depends on it); the header is
    rewritten in place with the metadata keys sorted (same length, same format)."""
    from safetensors.torch import save_file

    save_file(tensors, str(path), metadata=metadata)
    if metadata and len(metadata) > 1:
        with open(path, "r+b") as fh:
            size = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(size))
            header["__metadata__"] = dict(sorted(header["__metadata__"].items()))
            raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
            if len(raw) > size:  # cannot happen for the same content; keep the library's bytes then
                return
            fh.seek(8)
            fh.write(raw.ljust(size))


def write_parquet(table: Any, path: str | Path) -> None:
    """``pq.write_table`` with a CRC-32 in every page header, so :func:`read_parquet` detects a damaged page."""
    import pyarrow.parquet as pq

    pq.write_table(table, path, write_page_checksum=True)


def read_parquet(path: str | Path, columns: list[str] | None = None, fix: str = "rerun the stage that writes it"):
    """``pq.read_table`` that checks the page checksums (files written by :func:`write_parquet`; older files have
    none to check) and turns a damaged or unreadable file into one :class:`UserError` naming it and ``fix``."""
    import pyarrow.parquet as pq

    with _parquet_errors(path, fix):
        return pq.read_table(path, columns=columns, page_checksum_verification=True)


def parquet_schema(path: str | Path, fix: str = "rerun the stage that writes it"):
    """``pq.read_schema`` with an unreadable file as one :class:`UserError` (see :func:`read_parquet`)."""
    import pyarrow.parquet as pq

    with _parquet_errors(path, fix):
        return pq.read_schema(path)


@contextlib.contextmanager
def _parquet_errors(path: str | Path, fix: str) -> Iterator[None]:
    import pyarrow as pa

    try:
        yield
    except (pa.ArrowInvalid, OSError) as e:
        raise UserError(f"{path}: damaged or not a Parquet file ({str(e).splitlines()[0][:120]}); {fix}") from None
