"""Targets by hub id: a Hugging Face repository's files in the hub cache, and its errors as one line each.

Everything goes through ``huggingface_hub``: its cache (``HF_HOME`` / ``HF_HUB_CACHE``), its offline switch
(``HF_HUB_OFFLINE``), its token (``hf auth login`` / ``HF_TOKEN``) are the library's own, never re-read here. The
weights stay in the cache's snapshot folder of their commit (``<cache>/models--org--name/snapshots/<sha>/``, files
that link to ``blobs/``); the target stage copies only the small files into ``data/target``
(:data:`SMALL_FILES`).

- ``download_snapshot(model, revision, trust_remote_code) -> (snapshot dir, commit sha)``: the target stage's
  download (the small files first, then the weights files that ``model.safetensors.index.json`` names, or
  ``model.safetensors``), resolving ``revision`` to a commit.
- ``locate_snapshot(model, commit, files, trust_remote_code, where) -> snapshot dir``: a recorded commit's
  snapshot holding ``files``, read from the cache, downloaded where some are missing and the hub may be reached.
- ``hub_errors(...)``: the library's exceptions (repository / revision not found, gated, offline and not
  cached, no network) as :class:`~dspark_core.errors.UserError` naming the id and what to do.
"""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path
from typing import Callable, Iterator, Sequence

from dspark_core.errors import UserError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# what the pipeline reads of a repository besides its weights (top-level files; absent ones are skipped)
SMALL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model",
               "added_tokens.json", "chat_template.jinja", "chat_template.json", INDEX_FILE)
REMOTE_CODE_PATTERNS = ("*.py",)  # a repository's own code: fetched only with target.trust_remote_code
_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")
_COMMIT = re.compile(r"[0-9a-f]{40}")


def check_repo_id(model: str) -> None:
    """``model`` must look like a hub id ``org/name``; a ValueError naming ``target.model`` otherwise."""
    if not _REPO_ID.fullmatch(model) or ".." in model or "--" in model or len(model) > 96:
        raise UserError(f"model must be a hub id org/name (e.g. Qwen/Qwen3-8B); got {model!r} (a local "
                        f"directory: target.source hf_dir with target.path)")


def is_commit(revision: str) -> bool:
    return bool(_COMMIT.fullmatch(revision))


def _patterns(files: Sequence[str], trust_remote_code: bool) -> list[str]:
    return [*files, *(REMOTE_CODE_PATTERNS if trust_remote_code else ())]


def _cache_dir() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def _offline() -> bool:
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)


def _first_line(err: BaseException, limit: int = 200) -> str:
    text = str(err).strip().splitlines()
    return (text[0] if text else type(err).__name__)[:limit]


def _not_cached(model: str, revision: str, where: str, repo_type: str = "model") -> UserError:
    kind = "" if repo_type == "model" else f"--repo-type {repo_type} "
    get = f"`hf download {kind}{model} --revision {revision}`"
    if _offline():
        return UserError(f"{where}: {model} (revision {revision}) is not in the hub cache {_cache_dir()} and "
                         f"HF_HUB_OFFLINE=1 forbids downloading it; download it first ({get}) or unset "
                         "HF_HUB_OFFLINE")
    return UserError(f"{where}: cannot reach the hub to download {model} (revision {revision}) and it is not in the "
                     f"hub cache {_cache_dir()}; check the network (or HF_ENDPOINT), or run {get} where the hub "
                     "can be reached and copy the cache (HF_HOME) here")


@contextlib.contextmanager
def hub_errors(model: str, revision: str, where: str = "target.model", repo_type: str = "model") -> Iterator[None]:
    """The hub's exceptions raised inside the block as one-line UserErrors naming ``model`` (``where`` starts
    the message: the param in the target stage, the target dir in later stages, a data source's name;
    ``repo_type``: ``model`` or ``dataset``)."""
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        OfflineModeIsEnabled, RepositoryNotFoundError, RevisionNotFoundError)

    try:
        yield
    except GatedRepoError:
        page = f"https://huggingface.co/{'datasets/' if repo_type == 'dataset' else ''}{model}"
        raise UserError(f"{where}: {model} is gated: accept its conditions on {page} with your account, then log in "
                        "here (`hf auth login`, or set HF_TOKEN)") from None
    except RepositoryNotFoundError:
        raise UserError(f"{where}: repository {model!r} not found on the hub (check the id; a private repository "
                        "needs `hf auth login` or HF_TOKEN)") from None
    except RevisionNotFoundError:
        field = "target.revision" if repo_type == "model" else "the revision after @"
        raise UserError(f"{where}: revision {revision!r} not found in {model} ({field}: a branch, tag or commit sha "
                        "of the repository)") from None
    except (LocalEntryNotFoundError, OfflineModeIsEnabled):
        raise _not_cached(model, revision, where, repo_type) from None
    except HfHubHTTPError as e:
        raise UserError(f"{where}: the hub refused {model} (revision {revision}): {_first_line(e)}") from None
    except (ConnectionError, TimeoutError) as e:
        kind = "" if repo_type == "model" else f"--repo-type {repo_type} "
        raise UserError(f"{where}: cannot reach the hub for {model} ({_first_line(e)}); check the network, or "
                        f"download it where the hub can be reached (`hf download {kind}{model} --revision "
                        f"{revision}`)") from None
    except Exception as e:  # the HTTP client's own connection errors (not OSError subclasses)
        if type(e).__module__.split(".")[0].startswith("httpx"):
            raise UserError(f"{where}: cannot reach the hub for {model} ({type(e).__name__}: {_first_line(e)}); "
                            "check the network (or HF_ENDPOINT)") from None
        raise


def weight_names(snapshot: Path, where: str) -> list[str]:
    """The safetensors files of a snapshot: those ``model.safetensors.index.json`` maps tensors to, else
    ``model.safetensors`` (a repository's other ``*.safetensors``, e.g. a consolidated copy, are not read)."""
    index = snapshot / INDEX_FILE
    if not index.is_file():
        return [SINGLE_FILE]
    try:
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise UserError(f"{where}: {INDEX_FILE} has no readable weight_map ({_first_line(e)})") from None
    if not names or any(not isinstance(n, str) or n.startswith("/") or ".." in Path(n).parts for n in names):
        raise UserError(f"{where}: {INDEX_FILE} maps tensors to no file or to a file outside the repository")
    return names


def download_snapshot(model: str, revision: str, trust_remote_code: bool = False,
                      check: Callable[[Path], object] | None = None) -> tuple[Path, str]:
    """``(snapshot dir, commit sha)`` of ``model`` at ``revision`` with :data:`SMALL_FILES` and its weights files in
    the hub cache (downloaded where missing, unless ``HF_HUB_OFFLINE``). ``check(snapshot dir)`` runs once the small
    files are there and before any weights file is fetched (a repository it refuses costs no weights download)."""
    from huggingface_hub import snapshot_download

    with hub_errors(model, revision):
        snap = Path(snapshot_download(model, revision=revision, allow_patterns=_patterns(SMALL_FILES,
                                                                                         trust_remote_code)))
    commit = snap.name  # <cache>/models--org--name/snapshots/<commit>
    if check is not None:
        check(snap)
    names = weight_names(snap, f"target.model: {model} (commit {commit})")
    with hub_errors(model, revision):
        if any(not (snap / n).is_file() for n in names):
            snap = Path(snapshot_download(model, revision=commit, allow_patterns=names))
    missing = [n for n in names if not (snap / n).is_file()]
    if missing:
        if names == [SINGLE_FILE]:
            raise UserError(f"target.model: {model} (commit {commit}) has no {SINGLE_FILE} nor {INDEX_FILE} "
                            "(dspark reads safetensors weights)")
        raise _not_cached(model, commit, "target.model")
    return snap, commit


def locate_snapshot(model: str, commit: str, files: Sequence[str], trust_remote_code: bool = False,
                    where: str = "data/target") -> Path:
    """The snapshot dir of ``model`` at ``commit`` holding ``files`` (and :data:`SMALL_FILES` that exist there): read
    from the hub cache when every file is there, else downloaded (the network allowed), e.g. on another machine after
    ``dvc pull data/target``."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    patterns = _patterns([*SMALL_FILES, *files], trust_remote_code)
    with hub_errors(model, commit, where):
        try:
            snap = Path(snapshot_download(model, revision=commit, allow_patterns=patterns, local_files_only=True))
            complete = all((snap / n).is_file() for n in files)
        except LocalEntryNotFoundError:
            complete = False
        if not complete:
            snap = Path(snapshot_download(model, revision=commit, allow_patterns=patterns))
    if any(not (snap / n).is_file() for n in files):
        raise _not_cached(model, commit, where)
    return snap
