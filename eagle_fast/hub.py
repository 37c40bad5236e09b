"""Models by Hugging Face Hub id: `--model ORG/NAME [--revision R]`, resolved once to a local snapshot.

`resolve_model` returns a `ModelRef`: the local directory every reader uses (the engine, the
head loader, the tokenizer all read that one snapshot) and, for a Hub id, the id, the revision
asked for and the commit it resolved to (the manifest records them). Resolution goes through
huggingface_hub with the user's own settings (its cache, HF_HOME, HF_TOKEN, HF_HUB_OFFLINE,
HF_ENDPOINT). Only what the command needs is fetched: the config and tokenizer files
(`weights=False`: `extract --dry-run`, `vocab`, `inspect`), plus the safetensors for a command
that runs the model. A checkpoint with no safetensors is refused (its .bin weights are never
fetched). A local directory is used as it is.
Limits: a Ray cluster's workers read the snapshot at the driver's path (a shared HF_HOME); on
nodes of their own, `--shard` runs pin the commit with `--revision COMMIT` (the manifest's
model identity hashes refuse a merge of two revisions anyway).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from huggingface_hub import snapshot_download
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from eagle_fast.errors import UserError

REPO_ID_RE = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
META_PATTERNS = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json", "chat_template.jinja", "chat_template.json", "added_tokens.json",
                 "vocab.json", "merges.txt", "tokenizer.model", "*.tiktoken"]
WEIGHT_PATTERNS = ["*.safetensors", "*.safetensors.index.json"]


@dataclass(frozen=True)
class ModelRef:
    path: str                   # the local directory every reader uses
    hub_id: str | None = None   # ORG/NAME when it came from the Hub
    revision: str | None = None  # what was asked for (None: the default branch)
    commit: str | None = None   # what it resolved to

    def describe(self) -> dict | None:
        """What the manifest records (None for a local directory)."""
        if self.hub_id is None:
            return None
        return {"id": self.hub_id, "revision": self.revision, "commit": self.commit}


def resolve_model(model: str, revision: str | None = None, weights: bool = True, flag: str = "--model") -> ModelRef:
    """`model` as a local directory, or a Hub id resolved to a local snapshot (see the module doc)."""
    local = Path(model).expanduser()
    if local.is_dir():
        if revision is not None:
            raise UserError(f"--revision {revision}: {flag} {model} is a local directory, not a Hub id",
                            "drop --revision, or pass the Hub id (ORG/NAME)")
        return ModelRef(str(local))
    if not REPO_ID_RE.fullmatch(model) or model.startswith((".", "/", "~")):
        raise UserError(f"{flag} {model}: model directory not found, and not a Hub id (ORG/NAME)",
                        "pass a local checkpoint directory, or a Hugging Face Hub id such as Qwen/Qwen3-8B")
    where = f"{flag} {model}" + (f" --revision {revision}" if revision else "")
    try:
        path = snapshot_download(model, revision=revision,
                                 allow_patterns=META_PATTERNS + (WEIGHT_PATTERNS if weights else []))
    except GatedRepoError:
        raise UserError(f"{where}: the repository is gated and this machine has no access token for it",
                        "accept its terms on the Hub, then set HF_TOKEN (or run `huggingface-cli login`)") from None
    except RevisionNotFoundError:
        raise UserError(f"{where}: the Hub has no such revision of it", "pass a branch, tag or commit it has") from None
    except RepositoryNotFoundError:
        raise UserError(f"{where}: no such model on the Hub (or it is private)",
                        "check the id; for a private repository set HF_TOKEN") from None
    except LocalEntryNotFoundError:
        raise UserError(f"{where}: not in the Hugging Face cache, and the Hub cannot be reached (offline: "
                        "HF_HUB_OFFLINE)", "download it where there is network (`huggingface-cli download "
                        f"{model}`) into this HF_HOME, or pass a local checkpoint directory") from None
    except (HfHubHTTPError, OSError) as exc:
        raise UserError(f"{where}: the Hub could not be read ({type(exc).__name__}: {exc})",
                        "check the network and HF_ENDPOINT, or pass a local checkpoint directory") from None
    root = Path(path)
    if weights and not any(root.glob("*.safetensors")):
        raise UserError(f"{where} has no *.safetensors weights (its .bin weights are not fetched)",
                        "use a checkpoint converted to safetensors (save_pretrained(safe_serialization=True))")
    return ModelRef(str(root), model, revision, root.name)
