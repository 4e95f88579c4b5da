"""The Hugging Face hub around a training run: whether the hub is reachable, and the hub token and push settings
prepared so nothing written holds the token and an unreachable hub does not stop training."""

from __future__ import annotations

import logging
import os
import socket
from urllib.parse import urlparse

from huggingface_hub import constants

log = logging.getLogger("sftrecipes")


def hub_reachable(timeout: float = 3.0) -> bool:
    """The hub's endpoint accepts a connection (False when HF_HUB_OFFLINE is set)."""
    if constants.HF_HUB_OFFLINE:
        return False
    host = urlparse(constants.ENDPOINT).hostname or "huggingface.co"
    try:
        socket.create_connection((host, 443), timeout=timeout).close()
        return True
    except OSError:
        return False


def prepare_hub(args) -> str | None:
    """Keep the hub token out of everything written (training_args.bin pickles the arguments) by moving it to the
    environment huggingface_hub reads, and turn pushing off for a run that cannot reach the hub (transformers would
    fail at start). Returns the command that pushes the result later, when pushing was turned off."""
    if args.hub_token:
        os.environ["HF_TOKEN"] = args.hub_token
        args.hub_token = None
    if not args.push_to_hub or hub_reachable():
        return None
    args.push_to_hub = False
    repo = args.hub_model_id or os.path.basename(os.path.normpath(args.output_dir))
    later = f"hf upload {repo} {args.output_dir}" + (" --private" if args.hub_private_repo else "")
    log.warning("push_to_hub: the hub is unreachable; training continues and saves locally; push later with: %s", later)
    return later
