"""Runner over llama.cpp (``llama-cpp-python``'s low-level API): GGUF weights by mmap, its KV cache.

Owns one llama.cpp model + context for one sequence (id 0). A verify pass is one
``llama_decode`` batch with logits requested for each position the engine asks for; rollback is
``llama_memory_seq_rm`` of the positions past the kept length. Needs the optional
extra ``verispec[llamacpp]``. Knows nothing about drafting or sampling.

llama.cpp's quantized kernels take a different path for one token than for several, so its
verify rows can differ from its one-token rows in the last bits: greedy speculation over this
runner is exact only up to such near-ties (the int8 runner is the bit-exact one).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from verispec.errors import InvalidParameterError, ModelIntegrityError
from verispec.runners import Runner, check_new_tokens

INSTALL_HINT = "the llama.cpp runner needs its extra: pip install 'verispec[llamacpp]' (compiles llama.cpp, ~5 minutes)"
DEFAULT_MAX_CONTEXT = 4096
DEFAULT_BATCH = 512


def import_llama_cpp():
    """The ``llama_cpp`` module; raises InvalidParameterError with the install command if missing."""
    try:
        import llama_cpp
    except ImportError as exc:
        raise InvalidParameterError(f"{INSTALL_HINT} ({exc})") from None
    return llama_cpp


def llama_cpp_available() -> bool:
    try:
        import_llama_cpp()
    except InvalidParameterError:
        return False
    return True


_QUIET_LOG = None  # keeps the ctypes callback alive for the process lifetime


def _silence(lib) -> None:
    global _QUIET_LOG
    if _QUIET_LOG is None:
        _QUIET_LOG = lib.llama_log_callback(lambda level, text, user_data: None)
        lib.llama_log_set(_QUIET_LOG, ctypes.c_void_p())
        lib.llama_backend_init()


def default_num_threads() -> int:
    """Threads llama.cpp uses: the CPUs this process may run on."""
    return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1))


class LlamaCppRunner(Runner):
    """:class:`verispec.runners.Runner` over a GGUF file run by llama.cpp.

    Args:
        model_path: a ``.gguf`` file.
        max_context_length: KV capacity in tokens; default min(training context, 4096).
        num_threads: CPU threads; default all this process may use.
        batch_size: most tokens per ``llama_decode`` call (longer inputs are split).
    Raises:
        InvalidParameterError: llama-cpp-python is not installed.
        ModelIntegrityError: llama.cpp cannot load the file.
    """

    def __init__(
        self,
        model_path: str | Path,
        *,
        max_context_length: int | None = None,
        num_threads: int | None = None,
        batch_size: int = DEFAULT_BATCH,
    ) -> None:
        lib = self._lib = import_llama_cpp()
        _silence(lib)
        self.model_path = Path(model_path)
        model_params = lib.llama_model_default_params()
        model_params.use_mmap = True
        self._model = lib.llama_model_load_from_file(str(self.model_path).encode(), model_params)
        if not self._model:
            raise ModelIntegrityError(f"llama.cpp could not load {self.model_path}")
        self._ctx = None
        self._batch = None
        vocab = lib.llama_model_get_vocab(self._model)
        self.vocab_size = int(lib.llama_vocab_n_tokens(vocab))
        trained = int(lib.llama_model_n_ctx_train(self._model))
        self.max_context_length = int(max_context_length or min(trained, DEFAULT_MAX_CONTEXT))
        self.num_threads = int(num_threads or default_num_threads())
        self.batch_size = min(batch_size, self.max_context_length)
        params = lib.llama_context_default_params()
        params.n_ctx = self.max_context_length
        params.n_batch = params.n_ubatch = self.batch_size
        params.n_seq_max = 1
        params.n_threads = params.n_threads_batch = self.num_threads
        self._ctx = lib.llama_init_from_model(self._model, params)
        if not self._ctx:
            self.close()
            raise ModelIntegrityError(f"llama.cpp could not create a context for {self.model_path}")
        self._memory = lib.llama_get_memory(self._ctx)
        self._batch = lib.llama_batch_init(self.batch_size, 0, 1)
        self._num_cached = 0

    @property
    def num_cached_tokens(self) -> int:
        return self._num_cached

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes one position takes in llama.cpp's K and V caches: layers x 2 x kv_heads x head_dim
        x 2 (its default float16 cache), from the GGUF header; allocated at ``max_context_length``."""
        from verispec.models.gguf_file import read_gguf_header

        header = read_gguf_header(self.model_path)
        heads = int(header.arch_value("attention.head_count"))
        kv_heads = int(header.arch_value("attention.head_count_kv", heads))
        head_dim = int(header.arch_value("attention.key_length", int(header.arch_value("embedding_length")) // heads))
        return int(header.arch_value("block_count")) * 2 * kv_heads * head_dim * 2

    def forward(self, token_ids: Sequence[int], num_logits: int | None = None) -> Tensor:
        num_new = len(token_ids)
        check_new_tokens(self._num_cached, num_new, self.max_context_length)
        first_output = num_new - (num_logits or num_new)
        rows = []
        for chunk_start in range(0, num_new, self.batch_size):
            chunk = token_ids[chunk_start : chunk_start + self.batch_size]
            num_outputs = self._fill_batch(chunk, chunk_start, first_output)
            status = self._lib.llama_decode(self._ctx, self._batch)
            if status != 0:
                self.truncate(self._num_cached)  # drop whatever part of the batch got in
                raise RuntimeError(f"llama_decode failed with status {status}")
            self._num_cached += len(chunk)
            if num_outputs:
                logits = self._lib.llama_get_logits(self._ctx)
                flat = np.ctypeslib.as_array(logits, shape=(num_outputs * self.vocab_size,))
                rows.append(torch.from_numpy(flat.copy()).view(num_outputs, self.vocab_size))
        return torch.cat(rows) if len(rows) > 1 else rows[0]

    def _fill_batch(self, chunk: Sequence[int], chunk_start: int, first_output: int) -> int:
        """Write ``chunk`` into the llama batch at its positions; returns how many rows want logits."""
        batch = self._batch
        num_outputs = 0
        for i, token_id in enumerate(chunk):
            batch.token[i] = int(token_id)
            batch.pos[i] = self._num_cached + i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = 0
            wants = chunk_start + i >= first_output
            batch.logits[i] = 1 if wants else 0
            num_outputs += wants
        batch.n_tokens = len(chunk)
        return num_outputs

    def truncate(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= self._num_cached:
            raise ValueError(f"cannot truncate a cache of {self._num_cached} tokens to {num_tokens}")
        if not self._lib.llama_memory_seq_rm(self._memory, 0, num_tokens, -1):
            raise RuntimeError(f"llama.cpp could not remove positions {num_tokens}.. from its cache")
        self._num_cached = num_tokens

    def close(self) -> None:
        """Free the llama.cpp batch, context and model (also done when garbage-collected)."""
        lib = getattr(self, "_lib", None)
        if lib is None:
            return
        if self._batch is not None:
            lib.llama_batch_free(self._batch)
            self._batch = None
        if self._ctx:
            lib.llama_free(self._ctx)
            self._ctx = None
        if self._model:
            lib.llama_model_free(self._model)
            self._model = None

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # pragma: no cover - interpreter shutdown
            self.close()
