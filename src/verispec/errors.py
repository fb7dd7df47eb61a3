"""Exception types raised for user mistakes and bad inputs.

Every error a user can cause derives from :class:`VerispecError`; the CLI and server turn these
into a clear message (no traceback). Anything else escaping is a bug in verispec.
"""


class VerispecError(Exception):
    """Base class of every error caused by user input, configuration or data."""


class ModelNotFoundError(VerispecError):
    """A model reference names no built-in model, local file/directory, or reachable hub id."""


class ModelIntegrityError(VerispecError):
    """A weight file is corrupt, truncated or tampered with (sha256 or header mismatch)."""


class ModelFetchError(VerispecError):
    """Fetching a built-in model from the package registry failed."""


class IncompatibleDraftError(VerispecError):
    """The draft model cannot propose tokens for the target (tokenizer or EOS mismatch)."""


class InvalidParameterError(VerispecError, ValueError):
    """A generation or speculation parameter is outside its valid range."""


class ContextLengthError(VerispecError, ValueError):
    """The prompt (plus requested tokens) does not fit the model's context window."""


class CacheFileError(VerispecError):
    """A cache file verispec wrote failed its check: truncated, corrupt, or of another format.

    Readers of caches that can be rebuilt report it once and rebuild; the message says what was
    wrong (``verispec.models.cache_files``)."""


def one_line(exc: BaseException) -> str:
    """``exc`` as ``Type: first line`` (at most 160 characters) for a user-facing error; torch.load's
    paragraphs advising to re-run it with ``weights_only=False`` (unsafe for an unknown file) left out."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    if not first or first.startswith("Weights only load failed"):
        return f"{type(exc).__name__}: not a torch checkpoint of plain tensors"
    return f"{type(exc).__name__}: {first[:160]}"
