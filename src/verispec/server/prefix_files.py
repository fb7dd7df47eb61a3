"""The server's prefix cache at start and at shutdown: ``--prefix-cache-file`` read and written,
``--warm-prompt`` files prefilled. The cache itself is :mod:`verispec.engine.prefix_cache`'s and
the file format :mod:`verispec.engine.prefix_file`'s; knows nothing about HTTP."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from verispec.algorithms.sampling import SamplingParams
from verispec.engine import SpeculativeConfig
from verispec.engine.prefix_file import load_prefix_cache, save_prefix_cache
from verispec.errors import InvalidParameterError
from verispec.models.gguf_tokenizer import chat_token_ids

log = logging.getLogger("verispec.server")


def check_writable(path: str, what: str) -> None:
    """Raises InvalidParameterError unless ``path`` can be written at shutdown (not a
    directory, its directory exists and is writable)."""
    directory = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path) or not os.path.isdir(directory) or not os.access(directory, os.W_OK):
        raise InvalidParameterError(f"the {what} {path} cannot be written: give a file in a writable directory")


class PrefixCacheFiles:
    """What a server does with its pipeline's prefix cache outside requests.

    Args:
        pipeline: the loaded pipeline (its ``prefix_cache`` None: nothing to do).
        file: ``--prefix-cache-file`` or None; warm_prompts: ``--warm-prompt`` files.
    Raises:
        InvalidParameterError: a file that cannot be written at shutdown, or a warm prompt that is
            not a file (before the server starts).
    """

    def __init__(self, pipeline, file: str | None, warm_prompts: tuple[str, ...]) -> None:
        self.pipeline = pipeline
        self.file = file if pipeline.prefix_cache is not None else None
        self.warm_prompts = warm_prompts if pipeline.prefix_cache is not None else ()
        if self.file is not None:
            check_writable(self.file, "prefix cache file")
        for path in warm_prompts:
            if not os.path.isfile(path):
                raise InvalidParameterError(f"--warm-prompt {path}: no such file (a text file: a system prompt)")

    def start(self) -> None:
        """Say what the cache holds and costs; read the file (a damaged one, or one written for
        other weights or kernels, is said once and not used); prefill the warm prompts, each as a
        chat's system message where the model has a chat template (else as raw text)."""
        pipe = self.pipeline
        log.info("%s", pipe.prefix_cache_summary())
        if self.file is not None:
            blocks = load_prefix_cache(pipe.prefix_cache, self.file, pipe.prefix_cache_identity())
            log.info("prefix cache: %d blocks from %s", blocks, self.file)
        for path in self.warm_prompts:
            text = Path(path).read_text(encoding="utf-8")
            if getattr(pipe.tokenizer, "chat_template", None):
                ids = chat_token_ids(pipe.tokenizer, [{"role": "system", "content": text}])
            else:
                ids = pipe.encode(text)
            pipe.engine.generate(ids, SamplingParams(max_tokens=1), SpeculativeConfig(method="none"), learn=False)
            log.info("prefix cache: warmed with %s (%d tokens)", path, len(ids))

    def stop(self) -> None:
        """Write the cache to the file (after the last request); a failure is logged, not raised."""
        if self.file is None:
            return
        try:
            blocks = save_prefix_cache(self.pipeline.prefix_cache, self.file, self.pipeline.prefix_cache_identity())
            log.info("prefix cache: %d blocks saved to %s", blocks, self.file)
        except OSError as exc:
            log.error("prefix cache: could not write %s (%s)", self.file, exc.strerror or exc)
