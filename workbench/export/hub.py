"""Upload an export to the Hugging Face Hub (`export.push_to_hub=org/name`).

    python -m workbench export.push_to_hub=me/smollm2-arith      # token from $HF_TOKEN

huggingface_hub's own API does the work (create_repo, upload_folder); the endpoint is
$HF_ENDPOINT when set (a mirror, or a local stand-in in tests). The token is read from the
environment at upload time and passed to the client only: it is never written to the run
directory, the config or the model card.
"""

from __future__ import annotations

import os
from pathlib import Path

from workbench.core.errors import UserError


def token() -> str:
    value = os.environ.get("HF_TOKEN") or os.environ.get("HUGGING_FACE_HUB_TOKEN")
    if not value:
        raise UserError("export.push_to_hub needs a token in $HF_TOKEN (write access to the repo)")
    return value


def push(folder: Path, repo_id: str, extra: list[Path] = (), private: bool = True) -> dict:
    """Create `repo_id` if needed and upload `folder` (plus `extra` files under their names)."""
    from huggingface_hub import HfApi

    if "/" not in repo_id:
        raise UserError(f"export.push_to_hub={repo_id!r} must be org/name")
    api = HfApi(endpoint=os.environ.get("HF_ENDPOINT") or None, token=token())
    url = api.create_repo(repo_id, private=private, exist_ok=True)
    commit = api.upload_folder(folder_path=str(folder), repo_id=repo_id,
                               commit_message="Upload model exported by workbench")
    for path in extra:
        api.upload_file(path_or_fileobj=str(path), path_in_repo=f"gguf/{Path(path).name}", repo_id=repo_id)
    return {"repo": repo_id, "url": str(url), "commit": getattr(commit, "oid", None)}
