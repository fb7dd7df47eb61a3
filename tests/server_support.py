"""A tiny, fully local model pair for the server tests, and a real uvicorn server on loopback.

The tokenizer is a byte-level BPE built by hand so that some Chinese characters and an emoji are
split across tokens (their UTF-8 bytes land in different tokens) and one is a single token.
The models are tiny Qwen2s made to behave like bigram models: embeddings are scaled one-hot
vectors, so the last token dominates the logits, and ``lm_head`` encodes a table in which each
token of ``CYCLE_TEXT`` is followed by the next one. Greedy decoding therefore walks
``CYCLE_TEXT`` (multi-byte characters included); sampling at temperature 0.8 strays often
enough that different seeds give different texts. The draft has a few successors changed, so
speculation accepts some tokens and rejects others.
"""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import openai
import pytest
import torch
import uvicorn
from prometheus_client.parser import text_string_to_metric_families
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from verispec.engine import SpeculativeConfig
from verispec.engine.loader import SpeculativePipeline
from verispec.models.loading import LoadedModel
from verispec.server import create_app

# the test servers' default speculation: the draft model at the constant schedule's k = 5 (the
# default cost schedule's draft lengths depend on each engine's measured times, so two engines'
# drafts would differ; their tokens never do)
FIXED_DRAFT = SpeculativeConfig(method="draft", schedule="constant")

CYCLE_TEXT = "Hello 你好🙂世界é!"
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CONTEXT_LENGTH = 256
# Byte pairs merged into one token (hex): the lead of 你, the tail of 好, both halves of 🙂,
# all of 世; 界 and é stay one byte per token.
MERGES_HEX = [
    ("e4", "bd"),
    ("a5", "bd"),
    ("f0", "9f"),
    ("99", "82"),
    ("e4", "b8"),
    ("e4b8", "96"),
    ("48", "65"),
    ("6c", "6c"),
]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (what ByteLevel BPE uses)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars = printable[:]
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE: 256 byte tokens, the merges above, then the ChatML special tokens."""
    table = _bytes_to_unicode()

    def piece(hex_bytes: str) -> str:
        return "".join(table[b] for b in bytes.fromhex(hex_bytes))

    vocab = {table[b]: b for b in range(256)}
    merges = []
    for left, right in MERGES_HEX:
        merges.append((piece(left), piece(right)))
        vocab.setdefault(piece(left + right), len(vocab))
    core = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core)
    tokenizer.add_special_tokens({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"})
    tokenizer.add_special_tokens({"additional_special_tokens": SPECIAL_TOKENS})
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def successor_table(tokenizer, *, num_changed: int = 0) -> dict[int, int]:
    """next token of each token on the greedy path; ``num_changed`` successors are altered."""
    cycle = tokenizer.encode(CYCLE_TEXT, add_special_tokens=False)
    assert len(set(cycle)) == len(cycle), "the cycle must not repeat a token"
    table = {token: cycle[0] for token in range(len(tokenizer))}
    for i, token in enumerate(cycle):
        table[token] = cycle[(i + 1) % len(cycle)]
    table[tokenizer.convert_tokens_to_ids(".")] = tokenizer.eos_token_id  # "." ends the text
    for token in cycle[1 : 1 + 2 * num_changed : 2]:
        table[token] = cycle[0]
    return table


def bigram_qwen2(tokenizer, successors: dict[int, int], seed: int, margin: float = 6.0) -> Qwen2ForCausalLM:
    """A tiny Qwen2 whose greedy next token is ``successors[last token]`` (random noise elsewhere)."""
    torch.manual_seed(seed)
    vocab = len(tokenizer)
    hidden = (vocab + 7) // 8 * 8
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=CONTEXT_LENGTH,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.eos_token_id,
    )
    model = Qwen2ForCausalLM(config)
    scores = torch.randn(vocab, vocab)  # scores[a, b]: logit of b after a
    for a, b in successors.items():
        scores[a, b] += margin
    with torch.no_grad():
        model.model.embed_tokens.weight.zero_()
        model.model.embed_tokens.weight[:, :vocab] = 10.0 * torch.eye(vocab)  # dominates the layers
        model.lm_head.weight.zero_()
        # the final RMSNorm turns 10 * e_a into about sqrt(hidden) * e_a
        model.lm_head.weight[:, :vocab] = scores.T / hidden**0.5
    return model.eval()


def tiny_pipeline(drafters=None) -> SpeculativePipeline:
    """Target + partially agreeing draft sharing one tokenizer, wrapped as a pipeline
    (``drafters``: its :class:`DrafterOptions`)."""
    tokenizer = build_tokenizer()
    target = bigram_qwen2(tokenizer, successor_table(tokenizer), seed=0)
    draft = bigram_qwen2(tokenizer, successor_table(tokenizer, num_changed=2), seed=1)
    return SpeculativePipeline(
        _loaded("tiny-target", target, tokenizer), _loaded("tiny-draft", draft, tokenizer), drafters
    )


def _loaded(name: str, model, tokenizer) -> LoadedModel:
    return LoadedModel(
        name=name,
        model=model,
        tokenizer=tokenizer,
        path=None,
        load_time_s=0.0,
        param_bytes=sum(p.numel() * p.element_size() for p in model.parameters()),
        eos_token_ids=(tokenizer.eos_token_id,),
        context_length=CONTEXT_LENGTH,
        vocab_size=len(tokenizer),
    )


class LiveServer:
    """uvicorn serving ``app`` on a free 127.0.0.1 port in a background thread."""

    def __init__(self, app) -> None:
        self.app = app
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()


def wait_ready(url: str, timeout_s: float = 60.0) -> None:
    """Poll ``/health`` until it answers 200 (models warmed up)."""
    deadline = time.monotonic() + timeout_s
    while httpx.get(f"{url}/health").status_code != 200:
        if time.monotonic() > deadline:
            raise RuntimeError("the test server never became ready")
        time.sleep(0.02)


def metric_value(url: str, name: str, **labels: str) -> float:
    """One sample of ``GET /metrics`` (0.0 when absent)."""
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics").text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


class GatedEngine:
    """Wraps an engine so a test controls its pace: each pass waits for one ``permits`` release.

    ``fail`` makes the next pass raise (a server fault); ``entered``, ``num_chunks``, ``closed``
    and ``calls`` (``"generate"``: warm-up or audit, ``"stream"``: a request starting; in call
    order) let the test see what the worker did; ``closed``: a request left the engine (finished
    or dropped). ``generate`` waits for ``warmup_gate`` only.
    """

    def __init__(self, engine) -> None:
        self.inner = engine
        self.target = engine.target
        self.proposers = engine.proposers
        self.permits = threading.Semaphore(0)
        self.entered = threading.Event()
        self.closed = threading.Event()
        self.num_chunks = 0
        self.fail = False
        self.calls: list[str] = []
        self.warmup_gate = threading.Event()
        self.warmup_gate.set()

    def __getattr__(self, name):  # slot, supports_batching, new_slot, last_pass_*: the engine's
        return getattr(self.inner, name)

    def generate(self, *args, **kwargs):
        assert self.warmup_gate.wait(timeout=30), "the test never opened the warm-up gate"
        self.calls.append("generate")
        return self.inner.generate(*args, **kwargs)

    def start(self, *args, **kwargs):
        self.entered.set()
        self.calls.append("stream")
        return self.inner.start(*args, **kwargs)

    def step(self, states):
        if self.fail:
            self.fail = False
            self.closed.set()
            raise RuntimeError("injected fault")
        assert self.permits.acquire(timeout=30), "the test never released a permit"
        chunks = self.inner.step(states)
        self.num_chunks += sum(chunk is not None for chunk in chunks)
        return chunks

    def reset(self) -> None:
        self.entered.clear()
        self.closed.clear()
        self.num_chunks = 0


MAX_TOKENS_CAP = 64
MAX_BODY_BYTES = 64 * 1024


@pytest.fixture(scope="session")
def served():
    """The shared server over the tiny pair: cap 64 tokens, 16 queued requests, 64 KiB bodies,
    draft lengths fixed (:data:`FIXED_DRAFT`) so its usage figures equal the reference engine's."""
    app = create_app(
        tiny_pipeline(),
        max_tokens_cap=MAX_TOKENS_CAP,
        max_queue=16,
        max_body_bytes=MAX_BODY_BYTES,
        default_spec=FIXED_DRAFT,
    )
    with LiveServer(app) as server:
        wait_ready(server.url)
        yield server


@pytest.fixture(scope="session")
def reference() -> SpeculativePipeline:
    """An identical pipeline the tests call directly (the server's own belongs to its worker)."""
    return tiny_pipeline()


@pytest.fixture
def gated():
    """A server whose engine advances one pass per released permit; one request runs, one may wait."""
    pipeline = tiny_pipeline()
    engine = pipeline.engine = GatedEngine(pipeline.engine)
    with LiveServer(create_app(pipeline, max_queue=1, max_tokens_cap=200, max_num_seqs=1)) as server:
        wait_ready(server.url)
        server.engine = engine
        yield server
        engine.permits.release(10_000)  # let anything still running finish


@pytest.fixture
def client(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture
def http(served):
    with httpx.Client(base_url=served.url, timeout=60) as c:
        yield c


def save_checkpoint(directory, model, tokenizer):
    """Save ``model`` + ``tokenizer`` as a transformers checkpoint in ``directory`` (EOS set); returns it."""
    model.config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def save_tiny_pair(root, prompts) -> object:
    """The bigram pair saved as Hugging Face checkpoint folders ``root/target`` and ``root/draft``
    (so the CLI loads it by path) and ``prompts`` (dicts) as ``root/prompts.jsonl``; returns ``root``."""
    tokenizer = build_tokenizer()
    for name, table, seed in (
        ("target", successor_table(tokenizer), 0),
        ("draft", successor_table(tokenizer, num_changed=2), 1),
    ):
        bigram_qwen2(tokenizer, table, seed=seed).save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    (root / "prompts.jsonl").write_text("\n".join(json.dumps(p) for p in prompts) + "\n")
    return root
