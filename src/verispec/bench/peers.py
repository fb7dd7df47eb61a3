"""Peer runners timed beside verispec: transformers ``generate`` and llama-cpp-python.

Each peer decodes one prompt of token ids and returns a :class:`GenerationOutput` whose metrics
come from the same :class:`verispec.metrics.RequestMetrics` definitions as verispec's own
(timestamps taken here: request start, first token, end). transformers peers reuse the
pipeline's loaded models; llama.cpp loads the target's GGUF file itself. Knows nothing about
verispec's decoding loop.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

from verispec.algorithms.sampling import SamplingParams
from verispec.engine import GenerationOutput
from verispec.metrics import RequestMetrics, RequestTimes, SpecDecodeStats

TRANSFORMERS_METHODS = ("plain", "assisted", "prompt-lookup")
ASSISTED_DEFAULTS = {
    "num_assistant_tokens": 20,
    "num_assistant_tokens_schedule": "constant",
    "assistant_confidence_threshold": 0.4,
}
PEER_FAMILIES = ("transformers", "llama.cpp")


class _FirstTokenClock:
    """transformers streamer that notes when the first new token arrives (the prompt comes first)."""

    def __init__(self) -> None:
        self.num_puts = 0
        self.first_token: float | None = None

    def put(self, value) -> None:
        self.num_puts += 1
        if self.num_puts == 2 and self.first_token is None:
            self.first_token = time.perf_counter()

    def end(self) -> None:
        pass


@contextmanager
def counted_forwards(model: torch.nn.Module) -> Iterator[dict]:
    """Counts forward calls of ``model`` and their seconds while the block runs."""
    tally = {"calls": 0, "seconds": 0.0, "_start": 0.0}

    def before(module, args, kwargs):
        tally["_start"] = time.perf_counter()

    def after(module, args, kwargs, output):
        tally["calls"] += 1
        tally["seconds"] += time.perf_counter() - tally["_start"]

    handles = [
        model.register_forward_pre_hook(before, with_kwargs=True),
        model.register_forward_hook(after, with_kwargs=True),
    ]
    try:
        yield tally
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def _quiet() -> Iterator[None]:
    """transformers' log level at error while a peer runs (its assisted path warns about its
    own internal calls), restored afterwards."""
    from transformers.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(level)


def finish_at_eos(token_ids: Sequence[int], eos_token_ids: Sequence[int], max_tokens: int) -> tuple[list[int], str]:
    """Output tokens up to (not including) the first EOS, and the finish reason (verispec's rule)."""
    out: list[int] = []
    for token in token_ids:
        if token in eos_token_ids:
            return out, "stop"
        out.append(int(token))
        if len(out) >= max_tokens:
            return out, "length"
    return out, "length"


def _output(token_ids, reason, tokenizer, times: RequestTimes, prompt_tokens: int) -> GenerationOutput:
    metrics = RequestMetrics.from_times(times, prompt_tokens, len(token_ids), SpecDecodeStats())
    return GenerationOutput(token_ids, tokenizer.decode(token_ids, skip_special_tokens=True), reason, metrics)


class TransformersPeer:
    """``model.generate``: ``plain``, ``assisted`` (``assistant_model=draft``) or
    ``prompt-lookup`` (``prompt_lookup_num_tokens=k``, ``max_matching_ngram_size=2``).

    Every logits processor is set explicitly (no repetition penalty, top-k 0, top-p 1) so the
    target's own generation config cannot change the decoding rule. Assisted generation takes
    its draft length from the *draft's* generation config (transformers' design); it is used
    as it is (by default up to 20 tokens, cut when the draft's confidence falls below 0.4)
    rather than mutated, and ``settings`` records the values in force.
    """

    family = "transformers"

    def __init__(
        self,
        method: str,
        model,
        tokenizer,
        eos_token_ids: Sequence[int],
        draft_model=None,
        num_speculative_tokens: int = 5,
    ) -> None:
        if method not in TRANSFORMERS_METHODS:
            raise ValueError(f"unknown transformers peer {method!r}")
        self.method, self.name = method, f"transformers:{method}"
        self.model, self.tokenizer, self.draft_model = model, tokenizer, draft_model
        self.eos_token_ids = tuple(eos_token_ids)
        self.settings: dict = {}
        if method == "assisted":  # transformers reads these from the draft's own generation config
            own = draft_model.generation_config
            self.settings = {
                k: getattr(own, k, None) if getattr(own, k, None) is not None else v
                for k, v in ASSISTED_DEFAULTS.items()
            }
        elif method == "prompt-lookup":
            self.settings = {"prompt_lookup_num_tokens": num_speculative_tokens, "max_matching_ngram_size": 2}

    def generate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> GenerationOutput:
        from transformers import GenerationConfig

        config = GenerationConfig(
            max_new_tokens=params.max_tokens,
            do_sample=not params.is_greedy,
            temperature=params.temperature if not params.is_greedy else None,
            top_k=params.top_k if not params.is_greedy else None,
            top_p=params.top_p if not params.is_greedy else None,
            repetition_penalty=params.repetition_penalty,
            eos_token_id=list(self.eos_token_ids),
            pad_token_id=self.eos_token_ids[0],
            **(self.settings if self.method == "prompt-lookup" else {}),
        )
        kwargs = {"assistant_model": self.draft_model} if self.method == "assisted" else {}
        input_ids = torch.tensor([list(prompt_token_ids)], dtype=torch.long)
        clock = _FirstTokenClock()
        times = RequestTimes(start=time.perf_counter())
        with torch.random.fork_rng(), _quiet(), counted_forwards(self.model) as target, self._draft_tally() as draft:
            if params.seed is not None:
                torch.manual_seed(params.seed)
            sequences = self.model.generate(
                input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config, streamer=clock, **kwargs
            )
        times.end = time.perf_counter()
        times.first_token = clock.first_token or times.end
        times.target_s, times.num_target_forwards, times.draft_s = target["seconds"], target["calls"], draft["seconds"]
        token_ids, reason = finish_at_eos(
            sequences[0, input_ids.shape[1] :].tolist(), self.eos_token_ids, params.max_tokens
        )
        return _output(token_ids, reason, self.tokenizer, times, len(prompt_token_ids))

    def _draft_tally(self):
        if self.method == "assisted" and self.draft_model is not None:
            return counted_forwards(self.draft_model)
        return counted_forwards(torch.nn.Module())


class LlamaCppPeer:
    """llama-cpp-python plain decoding of the target's GGUF file (same threads, EOS stop).

    Raises ImportError when llama-cpp-python is not installed.
    """

    family = "llama.cpp"
    method = "plain"
    name = "llama.cpp:plain"
    reuse_prompt = False  # True: keep the previous prompt's KV cache (llama-cpp-python's own prefix reuse)

    def __init__(
        self, gguf_path: str, tokenizer, eos_token_ids: Sequence[int], threads: int, context_length: int = 4096
    ) -> None:
        import llama_cpp

        start = time.perf_counter()
        self.llm = llama_cpp.Llama(
            model_path=str(gguf_path), n_ctx=context_length, n_threads=threads, n_threads_batch=threads, verbose=False
        )
        self.load_time_s = time.perf_counter() - start
        self.tokenizer, self.eos_token_ids = tokenizer, tuple(eos_token_ids)
        self.settings = {
            "n_threads": threads,
            "n_ctx": context_length,
            "version": getattr(llama_cpp, "__version__", None),
        }

    def generate(self, prompt_token_ids: Sequence[int], params: SamplingParams) -> GenerationOutput:
        sampling = (
            dict(temp=0.0, top_k=1, top_p=1.0)
            if params.is_greedy
            else dict(temp=params.temperature, top_k=params.top_k, top_p=params.top_p)
        )
        if params.seed is not None:
            self.llm.set_seed(params.seed)
        times = RequestTimes(start=time.perf_counter())
        token_ids: list[int] = []
        reason = "length"
        if not self.reuse_prompt:  # else generate(reset=True) keeps the longest common prefix of the last prompt
            self.llm.reset()
        for token in self.llm.generate(
            list(prompt_token_ids), min_p=0.0, repeat_penalty=params.repetition_penalty, reset=True, **sampling
        ):
            if times.first_token is None:
                times.first_token = time.perf_counter()
            if token in self.eos_token_ids:
                reason = "stop"
                break
            token_ids.append(int(token))
            if len(token_ids) >= params.max_tokens:
                break
        times.end = time.perf_counter()
        return _output(token_ids, reason, self.tokenizer, times, len(prompt_token_ids))
