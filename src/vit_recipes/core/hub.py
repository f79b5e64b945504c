"""Hugging Face Hub helpers: push pre-flight, one-line Hub errors, and redacting tokens from what we write."""

import contextlib
import os
import re

import huggingface_hub
import huggingface_hub.constants  # a submodule the package does not load lazily
from huggingface_hub import errors as hf_errors

from .errors import RecipeError, first_line

OFFLINE_HINT = (
    "to work offline pass local paths (--model_name_or_path ./checkpoint --dataset_name ./images) with "
    "HF_HUB_OFFLINE=1, or try `make demo`, which needs no network"
)
# Local folders this repo's own commands build (a fresh clone has none of them yet).
LOCAL_BUILDERS = {"data/digits": "python tools/demo_data.py data/digits"}
_TOKEN_PATTERN = re.compile(r"hf_[A-Za-z0-9]{20,}")
_NETWORK_WORDS = ("offline", "couldn't connect", "could not connect", "name resolution", "connection", "timed out")


def written_as_path(name: str) -> bool:
    """A name meant as a local path (./x, /x, ~/x, a/b/c), never a Hub id (`owner/name`)."""
    return name.startswith((".", "/", "~")) or name.count("/") > 1


def check_local_path(name: str | None, what: str) -> None:
    """A name written as a local path that does not exist: one line saying so, where the Hub client would answer
    "Repo id must be in the form 'repo_name' or 'namespace/repo_name'"."""
    if name and written_as_path(name) and not os.path.exists(os.path.expanduser(name)):
        raise RecipeError(f"{what} path not found: {name}")


def offline_env() -> bool:
    # huggingface_hub reads HF_HUB_OFFLINE once at import: also look at the environment now (as launch.is_true).
    names = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    env = any(os.environ.get(n, "").strip().lower() in ("1", "true", "yes", "on") for n in names)
    return env or bool(getattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False))


def _current_token() -> str | None:
    with contextlib.suppress(Exception):  # e.g. a failed OIDC exchange: "no token", the caller says what to do
        return huggingface_hub.get_token()
    return None


def check_push_ready(training_args) -> None:
    """Fail before any data loads if --push_to_hub could only fail after training."""
    if not getattr(training_args, "push_to_hub", False):
        return
    if offline_env():
        raise RecipeError(
            "--push_to_hub cannot work with HF_HUB_OFFLINE=1: unset HF_HUB_OFFLINE or drop --push_to_hub "
            "(nothing was trained)"
        )
    if not (getattr(training_args, "hub_token", None) or _current_token()):
        raise RecipeError(
            "--push_to_hub needs a Hugging Face token: run `hf auth login` or set HF_TOKEN (nothing was trained)"
        )


def is_network_error(err: BaseException) -> bool:
    """No answer from the Hub: offline errors, or a transport HTTPError that is no HfHubHTTPError (no status)."""
    types = [hf_errors.OfflineModeIsEnabled, hf_errors.LocalEntryNotFoundError, ConnectionError, TimeoutError]
    with contextlib.suppress(ImportError):  # datasets and older paths still talk through requests
        import requests

        types += [requests.exceptions.ConnectionError, requests.exceptions.Timeout]
    transport = getattr(hf_errors, "HTTPError", None)
    no_answer = bool(transport) and isinstance(err, transport) and not isinstance(err, hf_errors.HfHubHTTPError)
    return isinstance(err, tuple(types)) or no_answer


def reachable_or_cached(name: str, cache_dir: str | None, revision: str | None, what: str, missing=None) -> None:
    """A Hub model id neither cached nor reachable: one line now (one API call, not a download's ~25 s of retries)."""
    if offline_env() or written_as_path(name) or os.path.exists(os.path.expanduser(name)):
        return
    if isinstance(huggingface_hub.try_to_load_from_cache(name, "config.json", cache_dir, revision), str):
        return
    try:
        huggingface_hub.HfApi().model_info(name, revision=revision, timeout=10)
    except Exception as err:
        if any(is_network_error(e) for e in (err, err.__cause__, err.__context__) if e is not None):
            raise RecipeError(hub_error_message(err, what, missing=missing)) from None
        # anything else (not found, gated): the download that follows says it


def hub_error_message(err: Exception, what: str, local_path: str | None = None, missing: str | None = None) -> str:
    """One line for a failed Hub call; `local_path`: the run's files; `missing`: a local folder name not found here."""
    chain = [err]  # and what it wraps: transformers re-raises Hub errors as OSError `from` the original
    while (inner := chain[-1].__cause__ or chain[-1].__context__) is not None and all(inner is not e for e in chain):
        chain.append(inner)
    offline = offline_env() or any(
        is_network_error(e) or any(word in str(e).lower() for word in _NETWORK_WORDS) for e in chain
    )
    cause = f"{type(err).__name__}: {first_line(err, 200)}"
    files = f"the run's files are in {local_path}; " if local_path else ""
    if offline and missing:
        builder = LOCAL_BUILDERS.get(missing.rstrip("/"))
        fix = f"build it with `{builder}`" if builder else "pass the path of an existing folder"
        message = (
            f"no local folder '{missing}' in {os.getcwd()}, and the Hugging Face Hub could not be reached to "
            f"{what} as a Hub id ({cause}): {fix} or check the network"
        )
    elif offline:
        message = f"could not reach the Hugging Face Hub to {what}: {cause}; {files}{OFFLINE_HINT}"
    else:
        status = next((s for e in chain if (s := getattr(getattr(e, "response", None), "status_code", None))), None)
        if isinstance(err, hf_errors.RepositoryNotFoundError) or status == 404:
            fix = "check the repo id and that your token can see it (`hf auth whoami`)"
        elif isinstance(err, hf_errors.GatedRepoError) or status in (401, 403):
            fix = "check your token's access (`hf auth login`; pushing needs a write token)"
        else:
            fix = "fix the cause above and run again"
        message = f"the Hugging Face Hub call to {what} failed: {cause}; {files}{fix}"
    return redact(" ".join(message.split()))


def redact(text: str) -> str:
    """Replace anything token-shaped, and the token in use, with <redacted>."""
    secrets = {_current_token(), os.environ.get("HF_TOKEN"), os.environ.get("HUGGING_FACE_HUB_TOKEN")}
    for secret in sorted((s for s in secrets if s and len(s) >= 8), key=len, reverse=True):
        text = text.replace(secret, "<redacted>")
    return _TOKEN_PATTERN.sub("<redacted>", text)
