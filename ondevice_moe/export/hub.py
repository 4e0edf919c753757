"""Push an export folder to the Hugging Face Hub (``create_repo`` + ``upload_folder``)."""

from __future__ import annotations

from pathlib import Path

from ondevice_moe.errors import UserError
from ondevice_moe.export.toolkit_format import WRITTEN_LIST


def check_online(repo_id: str) -> None:
    """Fail at once, before any work, when the Hub cannot be reached by configuration (offline mode)."""
    import huggingface_hub

    if huggingface_hub.is_offline_mode():
        raise UserError("cannot push to the Hugging Face Hub: offline mode is on (HF_HUB_OFFLINE=1)",
                        f"export without --push-to-hub, then push the folder from a machine with the network, "
                        f"e.g. `hf upload {repo_id} DIR`")


def push_to_hub(folder: Path, repo_id: str, private: bool) -> str:
    """Upload ``folder`` to the model repository ``repo_id`` (created if missing); returns its URL.

    Offline (``HF_HUB_OFFLINE=1``) this fails at once, before any request (:func:`check_online`).
    """
    import huggingface_hub
    from huggingface_hub.errors import HFValidationError

    check_online(repo_id)
    later = f"the export in {folder} is complete: push it later with `hf upload {repo_id} {folder}`"
    try:
        url = huggingface_hub.create_repo(repo_id, private=private, exist_ok=True)
        huggingface_hub.upload_folder(repo_id=repo_id, folder_path=str(folder), ignore_patterns=[WRITTEN_LIST],
                                      commit_message="Upload an ondevice-moe export")
    except HFValidationError as error:
        raise UserError(f"'{repo_id}' is not a Hub repository name ({error})", "use ORG/NAME") from None
    except OSError as error:  # HfHubHTTPError and connection errors
        raise UserError(f"pushing to {repo_id} failed: {str(error).splitlines()[0]}",
                        f"log in with `hf auth login` (a token that can write to {repo_id.split('/')[0]}); "
                        + later) from None
    return str(url)
