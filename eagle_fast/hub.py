"""Models and datasets by Hugging Face Hub id: `--model ORG/NAME [--revision R]` and `--data ORG/NAME
[--data-split S --data-config C --data-revision R]`, each resolved once to a local snapshot.

`resolve_model` returns a `ModelRef`: the local directory every reader uses (the engine, the
head loader, the tokenizer all read that one snapshot) and, for a Hub id, the id, the revision
asked for and the commit it resolved to (the manifest records them). Resolution goes through
huggingface_hub with the user's own settings (its cache, HF_HOME, HF_TOKEN, HF_HUB_OFFLINE,
HF_ENDPOINT). Only what the command needs is fetched: the config and tokenizer files
(`weights=False`: `extract --dry-run`, `vocab`, `inspect`), plus the safetensors for a command
that runs the model. A checkpoint with no safetensors is refused (its .bin weights are never
fetched). A local directory is used as it is. A dataset id resolves to the snapshot's files of
one split (`resolve_data`: the Hub's parquet layouts, or a split's jsonl), which `sources` reads;
the manifest records the id, commit, split and config.
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
    path = _snapshot(model, "model", revision, META_PATTERNS + (WEIGHT_PATTERNS if weights else []), where,
                     "a local checkpoint directory")
    root = path
    if weights and not any(root.glob("*.safetensors")):
        raise UserError(f"{where} has no *.safetensors weights (its .bin weights are not fetched)",
                        "use a checkpoint converted to safetensors (save_pretrained(safe_serialization=True))")
    return ModelRef(str(root), model, revision, root.name)


def _snapshot(repo_id: str, repo_type: str, revision: str | None, patterns: list[str], where: str,
              local: str) -> Path:
    """The local snapshot of a Hub repo (`where`: the flags as the user gave them, for messages;
    `local`: what to pass instead), every huggingface_hub failure as a UserError with its fix."""
    try:
        return Path(snapshot_download(repo_id, repo_type=repo_type, revision=revision, allow_patterns=patterns))
    except GatedRepoError:
        raise UserError(f"{where}: the {repo_type} is gated and this machine has no access token for it",
                        "accept its terms on the Hub, then set HF_TOKEN (or run `huggingface-cli login`)") from None
    except RevisionNotFoundError:
        raise UserError(f"{where}: the Hub has no such revision of it", "pass a branch, tag or commit it has") from None
    except RepositoryNotFoundError:
        raise UserError(f"{where}: no such {repo_type} on the Hub (or it is private)",
                        "check the id; for a private repository set HF_TOKEN") from None
    except LocalEntryNotFoundError:
        download = "huggingface-cli download" + (" --repo-type dataset" if repo_type == "dataset" else "")
        raise UserError(f"{where}: not in the Hugging Face cache, and the Hub cannot be reached (offline: "
                        "HF_HUB_OFFLINE)", f"download it where there is network (`{download} {repo_id}`) into "
                        f"this HF_HOME, or pass {local}") from None
    except (HfHubHTTPError, OSError) as exc:
        raise UserError(f"{where}: the Hub could not be read ({type(exc).__name__}: {exc})",
                        f"check the network and HF_ENDPOINT, or pass {local}") from None


@dataclass(frozen=True)
class DataRef:
    path: str                    # what `sources.open_source` reads: a file, a directory or a glob
    hub_id: str | None = None
    revision: str | None = None
    commit: str | None = None
    split: str | None = None
    config: str | None = None

    def describe(self) -> dict | None:
        if self.hub_id is None:
            return None
        return {"id": self.hub_id, "revision": self.revision, "commit": self.commit, "split": self.split,
                "config": self.config}


DATA_SUFFIXES = (".parquet", ".arrow", ".jsonl", ".json")


def is_hub_id(data: str) -> bool:
    """Whether `--data` names a Hub dataset (ORG/NAME that is no path and no glob)."""
    return not (Path(data).expanduser().exists() or any(c in data for c in "*?[")) and bool(REPO_ID_RE.fullmatch(data))


def resolve_data(data: str, split: str = "train", config: str | None = None, revision: str | None = None) -> DataRef:
    """`--data` as given when it is a path (or a glob); a Hub dataset id (ORG/NAME) resolved to
    its snapshot's files of `split` (and `config`): `data/train-*.parquet`, `CONFIG/train-*.parquet`,
    `CONFIG/train/*.parquet` or `train.jsonl`, as the Hub lays them out."""
    if not is_hub_id(data):
        if (revision, config) != (None, None):
            raise UserError(f"--data-revision / --data-config apply to a Hub dataset id; {data} is not one",
                            "drop them, or pass the dataset's Hub id (ORG/NAME)")
        return DataRef(data)
    where = f"--data {data}" + (f" --data-revision {revision}" if revision else "")
    root = _snapshot(data, "dataset", revision, [f"*{s}" for s in DATA_SUFFIXES], where, "a local file")
    files = sorted(f for f in root.rglob("*") if f.is_file() and f.suffix in DATA_SUFFIXES)
    if config is not None:
        files = [f for f in files if config in f.relative_to(root).parts[:-1]]
    else:  # the default config: the Hub keeps its files at the top or under data/
        default = [f for f in files if len(f.relative_to(root).parts) == 1 or f.relative_to(root).parts[0] == "data"]
        files = default or files
    mine = [f for f in files if f.stem == split or f.stem.startswith(f"{split}-") or f.parent.name == split]
    kinds = {f.suffix for f in mine}
    if not mine or len(kinds) > 1 or (len(mine) > 1 and kinds & {".jsonl", ".json"}):
        seen = ", ".join(str(f.relative_to(root)) for f in files[:8]) or "none"
        raise UserError(f"{where}: no one set of files for split {split!r}"
                        + (f" of config {config!r}" if config else "") + f" (its files: {seen})",
                        "pick the split and config with --data-split / --data-config, or pass the files")
    ref = DataRef(str(mine[0]), data, revision, root.name, split, config)
    if len(mine) > 1:  # the split's shards, all in one directory under one naming
        parents = {f.parent for f in mine}
        if len(parents) != 1:
            raise UserError(f"{where}: split {split!r} is spread over {len(parents)} directories",
                            "pick one with --data-config, or pass the files")
        pattern = f"{split}-*" if all(f.stem.startswith(f"{split}-") for f in mine) else "*"
        ref = DataRef(str(mine[0].parent / f"{pattern}{mine[0].suffix}"), data, revision, root.name, split, config)
    return ref
