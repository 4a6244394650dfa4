"""Models named by their Hugging Face id (``org/name``, optionally ``@revision``).

Every peer's quickstart is a hub id (``mlx_lm.server --model mlx-community/...``, vllm-mlx, LM
Studio, llama-server ``-hf``), so ``--model`` takes one too: the repository is downloaded once
with ``huggingface_hub`` (mlx-lm's own dependency) into its usual cache (``HF_HUB_CACHE``,
``HF_HOME``), with its progress bars, the files mlx-lm loads only (mlx-lm's
``DEFAULT_ALLOW_PATTERNS``); later runs find it there, offline too (``HF_HUB_OFFLINE=1``).
The model is then loaded like a directory, and served under the id as given.

A path that exists is always a path: ``./org/name`` or an existing ``org/name`` folder is
never looked up on the hub.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import ModelImportError, ModelNotFoundError, UnsupportedModelError

logger = logging.getLogger(__name__)

# The hub's rules for a repository's owner and name: letters, digits, '-', '_', '.'; no '--'
# or '..', not starting or ending with '-' or '.'. A revision: a branch, tag or commit.
_NAME = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?"
_HUB_ID = re.compile(rf"(?P<repo>{_NAME}/{_NAME})(?:@(?P<revision>[A-Za-z0-9._/-]{{1,255}}))?")

LOCAL_HINT = "or pass a local model directory with --model DIR"


@dataclass(frozen=True, slots=True)
class HubId:
    repo: str
    revision: str | None = None

    def __str__(self) -> str:
        return self.repo if self.revision is None else f"{self.repo}@{self.revision}"


def parse_hub_id(spec: str) -> HubId | None:
    """``spec`` as a hub id, if it is one and no such path exists here."""
    match = _HUB_ID.fullmatch(spec)
    if match is None or "--" in spec or ".." in spec or Path(spec).expanduser().exists():
        return None
    return HubId(match["repo"], match["revision"])


def pull_hub_model(hub_id: HubId, *, force: bool = False) -> Path:
    """The local folder of ``hub_id``'s snapshot, downloaded first if it is not cached
    (``force``: downloaded again).

    Raises ModelNotFoundError for an id the hub does not have (or hides: private, gated) or
    that is not cached while the hub cannot be reached, and ModelImportError for any other
    failure of the download; each names the id and says how to use a local folder instead.
    """
    from huggingface_hub import snapshot_download  # here: parsing an id imports no MLX
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )
    from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

    logger.info("fetching %s from the Hugging Face hub (or its local cache)", hub_id)
    try:
        path = snapshot_download(
            hub_id.repo,
            revision=hub_id.revision,
            allow_patterns=DEFAULT_ALLOW_PATTERNS,
            force_download=force,
        )
    except RevisionNotFoundError as exc:
        raise ModelNotFoundError(
            f"model not found: {hub_id} (the hub has no revision {hub_id.revision!r}); {LOCAL_HINT}"
        ) from exc
    except (RepositoryNotFoundError, GatedRepoError) as exc:
        raise ModelNotFoundError(
            f"model not found: {hub_id} is not a Hugging Face repository this machine can "
            f"read (unknown, private or gated: set HF_TOKEN for those); {LOCAL_HINT}"
        ) from exc
    except LocalEntryNotFoundError as exc:
        raise ModelNotFoundError(
            f"model not found: {hub_id} is not in the local Hugging Face cache and the hub "
            f"cannot be reached (offline, or HF_HUB_OFFLINE set); download it where the hub "
            f"can be reached (mlx-trio pull {hub_id}), {LOCAL_HINT}"
        ) from exc
    except (HfHubHTTPError, OSError, ValueError) as exc:
        raise ModelImportError(
            f"could not download {hub_id} from the Hugging Face hub: {type(exc).__name__}: "
            f"{exc}; {LOCAL_HINT}"
        ) from exc
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise UnsupportedModelError(
            f"{hub_id} has no config.json: not a model mlx-lm loads; {LOCAL_HINT}"
        )
    return folder
