"""Where the cache stage keeps its stores, and what DVC sees of them: the hidden states exist once on disk.

The stage builds, resumes and keeps every store in ``cache.store_dir`` (null: ``<out_dir>_stores``, i.e.
``data/cache_stores``), a folder outside every DVC output, git-ignored by a ``.gitignore`` of its own. The stage's
DVC output ``cache.out_dir`` (``data/cache``) holds, for each split, a tree of hard links to the store that split's
consumer reads (:func:`publish`): the same files under a second name, no second copy. The repository's
``.dvc/config`` sets ``cache.type: hardlink,symlink``, so DVC's commit after the stage hard-links those files into
its cache as well (no copy), and ``dvc push`` / ``dvc pull`` move them as any output.

The output is not ``persist``ed. Before it reruns a stage, DVC "unprotects" a persisted output whose files are links
into its cache by copying every one of them (so that the stage could write into them), then hashes the copies after
the stage: with the store in place, every rerun of the cache stage -- a code edit under dspark_core/cache, a param
of the other split, a switch of ``train.hidden_states`` -- would first copy the whole store. A plain output is
deleted instead (its names only: the files live on in the home and in DVC's cache), and the stage links it again
from the home: the same inodes and modification times, whose hashes DVC's state database holds, so nothing is read
again. The stores never change in place either: zarr's ``LocalStore`` writes every chunk and ``zarr.json`` to a
temp file renamed over the old one (a new inode), so writing into a store whose files are also DVC's objects leaves
the objects as they were.

Two kinds of store a split: ``<split>.zarr`` with the hidden states, ``<split>.tokens.zarr`` token-only (its consumer
runs the target: ``train`` / ``eval_offline.hidden_states: online``). A consumer switched to online keeps the store
with hidden states: when it is complete and of the same content it is published as it is (online reads its tokens;
nothing is built), else a token-only store is built beside it; switching back publishes the kept store. Deleting
it is how its disk is freed (with ``dvc gc`` for DVC's names of its files): an online split never adopts one.

A home that lacks the store a split builds (a clone after ``dvc pull``, a queued experiment's temporary workspace, a
moved ``store_dir``, a workspace laid out before the home existed) adopts it (:func:`adopt`): a complete store of
the wanted content that the output folder still holds (without DVC nothing deletes it) is moved in; else the one
DVC's cache holds for the output's last committed hash (``dvc.lock``) is hard-linked in, object by object.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

from dspark_core.cache.store import mismatches, remove_store, token_only
from dspark_core.errors import UserError
from dspark_core.io import git_ignored_dir

COMPLETE = "a complete store of this content; nothing recomputed"
PARTIAL = ".partial"  # zarr's LocalStore writes to <file>.<uuid>.partial first: a killed write can leave one


def home_dir(cfg: Any) -> Path:
    """``cache.store_dir``, or ``<out_dir>_stores`` when it is null."""
    return Path(cfg.store_dir) if cfg.store_dir else Path(f"{str(cfg.out_dir).rstrip('/')}_stores")


def home_store(cfg: Any, split: str, kind: str) -> Path:
    """The home of ``split``'s store with hidden states (``kind`` cache) or its token-only store (online)."""
    return home_dir(cfg) / (f"{split}.zarr" if kind == "cache" else f"{split}.tokens.zarr")


def view_store(cfg: Any, split: str) -> Path:
    """Where ``split``'s consumers read its store: ``<out_dir>/<split>.zarr``, the DVC output's part."""
    return Path(cfg.out_dir) / f"{split}.zarr"


def prepare_home(cfg: Any) -> Path:
    """Create the home (git-ignored); refuse, in one line, a home on another file system than the output folder
    (a hard link cannot cross one)."""
    home, out = git_ignored_dir(home_dir(cfg)), existing_parent(Path(cfg.out_dir))
    if home.stat().st_dev != out.stat().st_dev:
        raise UserError(f"cache.store_dir {home} and cache.out_dir {cfg.out_dir} are on different file systems; the "
                        "output holds hard links of the stores: put store_dir beside out_dir (null: <out_dir>_stores)")
    return home


def existing_parent(path: Path) -> Path:
    """``path`` or its nearest parent that exists."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def store_attrs(path: Path) -> dict[str, Any] | None:
    """The manifest (zarr.json attributes) of the store at ``path``; None when there is no initialized store."""
    return _attrs_of(Path(path) / "zarr.json")


def _attrs_of(zarr_json: Path | None) -> dict[str, Any] | None:
    try:
        doc = json.loads(Path(zarr_json).read_text()) if zarr_json is not None else None
    except (OSError, ValueError):
        return None
    attrs = doc.get("attributes") if isinstance(doc, dict) else None
    return attrs if isinstance(attrs, dict) and attrs.get("initialized") else None


def holds(attrs: dict[str, Any] | None, manifest: dict[str, Any], complete: bool = False) -> bool:
    """Whether a store's ``attrs`` are of ``manifest``'s content (and complete, when asked)."""
    return attrs is not None and not mismatches(attrs, manifest) and (bool(attrs.get("complete")) or not complete)


def tree_files(path: Path) -> dict[str, Path]:
    """{path relative to ``path``: file} of every file under ``path``, zarr's unfinished temp files left out."""
    path = Path(path)
    return {str(f.relative_to(path)): f for f in sorted(path.rglob("*")) if f.is_file() and PARTIAL not in f.name}


def link_tree(files: dict[str, Path], dst: Path) -> None:
    """Make ``dst`` (which must not exist) a folder of hard links to ``files`` ({relative path: file}): built
    under a temp name beside it, then renamed into place, so it is whole or absent."""
    tmp = dst.with_name(f".{dst.name}.linking")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        for rel, src in files.items():
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            os.link(src, tmp / rel)
        tmp.mkdir(parents=True, exist_ok=True)  # an empty store still gets its folder
        tmp.rename(dst)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def adopt(cfg: Any, split: str, kind: str, manifest: dict[str, Any], replace: bool) -> str | None:
    """Give the home a store of ``manifest``'s content for ``split`` / ``kind`` when it lacks one: absent, or (when
    ``replace``: a store the build would rebuild anyway) of other content. A complete one is taken from the output
    folder (moved: names only) or from DVC's cache (:func:`committed_tree`, hard-linked); into an absent slot, the
    output folder's store of this kind moves whatever it holds (half-built, or of other settings: the build then
    resumes, rebuilds or refuses it as it would in the home). Returns where it came from and what it was (for the
    stage's line), or None when the home is left as it is."""
    home = home_store(cfg, split, kind)
    if holds(store_attrs(home), manifest) or (home.exists() and not replace):
        return None
    view = view_store(cfg, split)
    found = store_attrs(view)
    if holds(found, manifest, complete=True) or (found is not None and _kind(found) == kind and not home.exists()):
        prepare_home(cfg)
        remove_store(home)
        view.rename(home)
        return f"{view} ({COMPLETE if holds(found, manifest, complete=True) else 'as it was'})"
    tree = committed_tree(cfg.out_dir, view.name)
    if tree is not None and holds(_attrs_of(tree.get("zarr.json")), manifest, complete=True):
        prepare_home(cfg)
        remove_store(home)
        try:
            link_tree(tree, home)
        except OSError as e:  # DVC's cache on another file system: no hard link; the store is built instead
            print(f"cache {split}: DVC's cache holds this store, but it cannot be linked into {home} ({e})")
            return None
        return f"DVC's cache ({COMPLETE})"
    return None


def publish(cfg: Any, split: str, store: Path) -> Path:
    """Make ``<out_dir>/<split>.zarr`` a tree of hard links to ``store`` (nothing to do when it is one already).
    What it held before goes when every file of it has another name (the home's, DVC's cache's), or when it is a
    store of ``store``'s kind (with hidden states, or token-only), which ``store`` supersedes as a rebuild would; a
    store of the other kind is moved into its home slot when that is free; anything else is refused, naming it:
    nothing that exists only there is deleted. Returns the view's path."""
    view, files = view_store(cfg, split), tree_files(store)
    if view.is_dir() and _links_of(view, files):
        return view
    if view.exists() or view.is_symlink():
        _clear_view(cfg, split, view, _kind(store_attrs(store)))
    link_tree(files, view)
    return view


def _kind(attrs: dict[str, Any] | None) -> str | None:
    return None if attrs is None else ("online" if token_only(attrs) else "cache")


def _links_of(view: Path, files: dict[str, Path]) -> bool:
    have = tree_files(view)
    return have.keys() == files.keys() and all(os.path.samefile(have[k], files[k]) for k in files)


def _clear_view(cfg: Any, split: str, view: Path, kind: str | None) -> None:
    if view.is_symlink() or view.is_file():
        view.unlink()
        return
    attrs = store_attrs(view)
    if _kind(attrs) == kind or all(f.stat().st_nlink > 1 for f in tree_files(view).values()):
        shutil.rmtree(view)
        return
    slot = home_store(cfg, split, _kind(attrs)) if attrs is not None else None
    if slot is None or slot.exists():
        raise UserError(f"{view}: holds files that exist nowhere else (not links of the stores in {home_dir(cfg)}); "
                        "move it away, then rerun the cache stage")
    view.rename(slot)
    print(f"cache {split}: {view} moved to {slot} (the stores live in {home_dir(cfg)}; {cfg.out_dir} holds links)")


def committed_tree(out_dir: str | Path, name: str) -> dict[str, Path] | None:
    """{path inside ``<out_dir>/<name>``: its object in DVC's cache} for the output's last committed hash (``dvc.lock``
    of the repository holding ``out_dir``), or None: no DVC (not installed, not a repository), no entry,
    or an object missing from the cache. Reads DVC 3's cache layout: ``<cache>/files/md5/ab/cdef...``, a folder's
    ``.dir`` object a JSON list of ``{"md5", "relpath"}``."""
    try:
        from dvc.repo import Repo

        with Repo(str(existing_parent(Path(out_dir).resolve()))) as repo:
            root, objects = Path(repo.root_dir), Path(repo.cache.local.path)
    except Exception:  # noqa: BLE001 (no dvc, no repository, a broken config: nothing to adopt from)
        return None
    want = os.path.relpath(Path(out_dir).resolve(), root)
    dir_hash = _locked_hash(root / "dvc.lock", want)
    obj = (lambda h: objects / h[:2] / h[2:])  # noqa: E731
    try:
        entries = json.loads(obj(dir_hash).read_text()) if dir_hash else []
    except (OSError, ValueError):
        return None
    prefix = f"{name}/"
    files = {e["relpath"][len(prefix):]: obj(e["md5"]) for e in entries if str(e.get("relpath", "")).startswith(prefix)}
    return files if files and all(p.is_file() for p in files.values()) else None


def _locked_hash(lock: Path, out: str) -> str | None:
    """The md5 ``dvc.lock`` records for output ``out`` (a path relative to the repository) of any stage."""
    import yaml

    try:
        stages = (yaml.safe_load(lock.read_text()) or {}).get("stages") or {}
    except (OSError, yaml.YAMLError):
        return None
    for stage in stages.values():
        for entry in stage.get("outs") or []:
            if os.path.normpath(str(entry.get("path", ""))) == os.path.normpath(out):
                return entry.get("md5")
    return None


def dvc_copies(where: Path) -> tuple[int, str]:
    """How many more copies of a store under ``where`` DVC's commit makes on ``where``'s file system (0 or 1), and a
    few words saying why: none without a DVC repository or with ``cache.type`` starting with hardlink (DVC links the
    files into its cache); one when it copies them (another first link type; reflinks are counted as copies, an
    upper bound); none here when DVC's cache is on another file system (it holds its copy there)."""
    try:
        from dvc.repo import Repo

        with Repo(str(existing_parent(where))) as repo:
            cache, types = Path(repo.cache.local.path), list(repo.cache.local.cache_types)
    except Exception:  # noqa: BLE001 (no dvc, no repository: nothing but the store)
        return 0, "no DVC repository: the store alone"
    if existing_parent(cache).stat().st_dev != existing_parent(where).stat().st_dev:
        return 0, f"DVC's cache ({cache}) is on another file system and holds its own copy there"
    if types and types[0] == "hardlink":
        return 0, f"DVC hard-links it into its cache (cache.type: {','.join(types)})"
    return 1, (f"DVC copies it into its cache (cache.type: {','.join(types) or 'reflink,copy'}): twice on this disk; "
               "`dvc config cache.type hardlink,symlink` keeps one copy")
