"""HuggingFace hub names (``model.from_hf``, ``tokenizer.path``): a local directory, or a cached snapshot with one
bounded request to the hub; errors name the key and the ways on."""

from __future__ import annotations

import functools
import logging
import re
from pathlib import Path

from jaxtune.config.base import ConfigError

log = logging.getLogger(__name__)

HUB_TIMEOUT = 5.0  # seconds the hub gets to answer its one request before a name is looked up in the local cache only
_HUB_NAME = re.compile(r"[\w.-]+(/[\w.-]+)?")


class HubError(ConfigError):
    """A hub name that cannot be had here; ``reason`` says why in a few words, the message also what to do."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


def local_or_hub(name: str, key: str, files: list[str]) -> Path:
    """The directory ``name`` (the value of config ``key``) stands for: a local path as is (existing or not), or for a
    hub name (``org/model``) its snapshot in the HuggingFace cache, with the files matching ``files`` downloaded once.

    The hub is asked once, with a `HUB_TIMEOUT` (huggingface_hub's own calls wait without limit, and transformers'
    retry with backoff); when it cannot be reached, or ``HF_HUB_OFFLINE`` is set, the cached snapshot is used, and
    without one the error names ``key`` and the two ways on: a local directory, or ``HF_HUB_OFFLINE`` with a filled
    cache."""
    path = Path(name).expanduser()
    if path.exists() or name.startswith((".", "/", "~")) or not _HUB_NAME.fullmatch(name):
        return path  # the caller says what it lacks
    try:
        from huggingface_hub import constants, errors, snapshot_download
    except ImportError:
        raise ConfigError(f"{key}={name}: not a local directory; downloading it from the HuggingFace hub needs "
                          "huggingface_hub: pip install 'jaxtune[hf]'") from None
    offline = constants.HF_HUB_OFFLINE
    unreachable = "HF_HUB_OFFLINE is set" if offline else _unreachable(name, key)
    try:
        found = Path(snapshot_download(name, allow_patterns=files, local_files_only=bool(unreachable)))
    except errors.LocalEntryNotFoundError as e:
        if not unreachable:  # the hub answered the first request, then stopped
            unreachable = f"the HuggingFace hub download stopped ({_one_line(e)})"
        partly = isinstance(e, errors.IncompleteSnapshotError)
        fill = f"`hf download {name}` where there is network"
        raise HubError(f"{key}={name}: not a local directory, {'and only partly in' if partly else 'nor in'} the "
                       f"HuggingFace cache ({constants.HF_HUB_CACHE}), and {unreachable}; pass a local directory "
                       f"({key}=DIR: a save_pretrained or `hf download {name} --local-dir DIR` copy) or "
                       + (f"fill the cache ({fill})" if offline else f"set HF_HUB_OFFLINE=1 with {name} in the cache "
                          f"({fill})"),
                       f"{unreachable}, and {name} is {'only partly' if partly else 'not'} in the HuggingFace cache"
                       ) from None
    except Exception as e:  # noqa: BLE001 (gated, missing, a failed download: reported with the hub's own words)
        reason = _one_line(e)
        raise HubError(f"{key}={name}: not a local directory, and the HuggingFace hub download failed: {reason}",
                       reason) from None
    if unreachable and not offline:
        _note_cached(name, unreachable, str(found))
    return found


def hub_unreachable(name: str, key: str, repo_type: str | None = None) -> str:
    """Why the HuggingFace hub cannot give ``name`` (a model, or with ``repo_type="dataset"`` a dataset) here: ''
    when it answers, a reason when it cannot be reached or ``HF_HUB_OFFLINE`` is set; a refusal of ``name`` is a
    `HubError` naming ``key``. One bounded request (`HUB_TIMEOUT`), once per name and process."""
    from huggingface_hub import constants

    return "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else _unreachable(name, key, repo_type)


@functools.cache
def _unreachable(name: str, key: str, repo_type: str | None = None) -> str:
    """Why the hub cannot be reached ('' when it answers), found with one request; a refusal of ``name`` (missing,
    gated, private) is a `HubError`. Asked once per name and process."""
    from huggingface_hub import HfApi, constants, errors

    try:
        HfApi().repo_info(name, repo_type=repo_type, timeout=HUB_TIMEOUT)
    except errors.HfHubHTTPError as e:
        reason = _one_line(e)
        raise HubError(f"{key}={name}: not a local directory, and the HuggingFace hub refuses it: {reason}",
                       reason) from None
    except Exception as e:  # noqa: BLE001 (no connection, DNS, a timeout, a proxy: whatever stops the request)
        return f"the HuggingFace hub at {constants.ENDPOINT} cannot be reached ({_one_line(e)})"
    return ""


@functools.cache
def _note_cached(name: str, unreachable: str, where: str) -> None:
    log.warning("%s; using the cached copy of %s (%s)", unreachable, name, where)


def _one_line(e: Exception) -> str:
    return f"{type(e).__name__}: {' '.join(str(e).split())}"
