"""Tiny vocabulary-only GGUF files, one per tokenizer family, written with ``gguf``.

Each holds what a real file of the family holds under ``tokenizer.*`` (model, pre-tokenizer, token
list, types, scores or merges, special ids, BOS flag), with a small vocabulary learned by
``tokenizers`` from :data:`CORPUS` (deterministic), and the ``{arch}.*`` keys llama.cpp reads
before it loads a vocabulary; no tensors. Families:

- ``llama3``: byte-level BPE, pre ``llama-bpe``, no BOS flag (llama.cpp adds BOS for it);
- ``qwen3``: byte-level BPE, pre ``qwen2``, no BOS (Qwen's files say nothing; none is added);
- ``gemma3``: SentencePiece ``llama``, ``add_space_prefix`` false, BOS flag true, ``<start_of_turn>``;
- ``phi3``: SentencePiece ``llama``, space prefix, named "Phi-3", control tokens ``<|endoftext|>``
  (llama.cpp needs it in a Phi-3 vocabulary), ``<|user|>``, ``<|end|>``, ``<|assistant|>``.
"""

from __future__ import annotations

from pathlib import Path

import gguf

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "Hello, world! The world says hello back.",
    "print('hello')  # a comment\nfor i in range(10):\n    print(i)\n",
    "speculative decoding drafts tokens and the target verifies them",
]
NORMAL, CONTROL, USER_DEFINED, BYTE = 1, 3, 4, 6
CHAT_TEMPLATE = "{% for m in messages %}<|user|>\n{{ m['content'] }}<|end|>\n{% endfor %}<|assistant|>\n"


def _trained_bpe(byte_level: bool, vocab_size: int):
    """A BPE learned from CORPUS: byte-level (GPT-2 alphabet) or SentencePiece-style (``▁`` spaces)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    if byte_level:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
        alphabet = []
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=alphabet, show_progress=False)
    tokenizer.train_from_iterator(CORPUS * 4, trainer)
    return tokenizer


def _bpe_vocabulary(specials: list[str]) -> tuple[list[str], list[str], list[int]]:
    """(tokens, merges, types) of a byte-level BPE with ``specials`` appended as control tokens."""
    import json

    model = json.loads(_trained_bpe(True, 400).to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tokens + specials, merges, [NORMAL] * len(tokens) + [CONTROL] * len(specials)


def _spm_vocabulary(specials: list[str]) -> tuple[list[str], list[float], list[int]]:
    """(tokens, scores, types) of a SentencePiece-style BPE: specials first (control), then the 256
    byte tokens, then the learned pieces, best merge first (score = minus the rank)."""
    import json

    model = json.loads(_trained_bpe(False, 300).to_str())["model"]
    pieces = [t for t in sorted(model["vocab"], key=model["vocab"].get)]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    tokens = specials + byte_tokens + pieces
    scores = [0.0] * (len(specials) + 256) + [-float(i) for i in range(len(pieces))]
    types = [CONTROL] * len(specials) + [BYTE] * 256 + [NORMAL] * len(pieces)
    return tokens, scores, types


def write_tokenizer_gguf(path: Path, family: str) -> Path:
    """Write the vocabulary-only GGUF of ``family`` (see the module docstring) to ``path``."""
    arch = {"llama3": "llama", "qwen3": "qwen3", "gemma3": "gemma3", "phi3": "phi3"}[family]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name({"phi3": "Phi-3 tiny"}.get(family, f"tiny {family}"))
    for add, value in [
        (writer.add_context_length, 512),
        (writer.add_embedding_length, 64),
        (writer.add_block_count, 1),
        (writer.add_feed_forward_length, 128),
        (writer.add_head_count, 4),
        (writer.add_head_count_kv, 4),
        (writer.add_layer_norm_rms_eps, 1e-6),
    ]:
        add(value)
    if family in ("llama3", "qwen3"):
        specials = (
            ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]
            if family == "llama3"
            else ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        )
        tokens, merges, types = _bpe_vocabulary(specials)
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("llama-bpe" if family == "llama3" else "qwen2")
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges(merges)
        first = len(tokens) - 3
        if family == "llama3":
            writer.add_bos_token_id(first)
            writer.add_eos_token_id(first + 1)
        else:
            writer.add_bos_token_id(first)
            writer.add_eos_token_id(first + 2)
            writer.add_pad_token_id(first)
    else:
        specials = (
            ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
            if family == "gemma3"
            else ["<unk>", "<s>", "</s>", "<|endoftext|>", "<|user|>", "<|end|>", "<|assistant|>"]
        )
        tokens, scores, types = _spm_vocabulary(specials)
        writer.add_tokenizer_model("llama")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_scores(scores)
        writer.add_token_types(types)
        ids = {token: i for i, token in enumerate(tokens)}
        if family == "gemma3":
            writer.add_bos_token_id(ids["<bos>"])
            writer.add_eos_token_id(ids["<eos>"])
            writer.add_unk_token_id(ids["<unk>"])
            writer.add_pad_token_id(ids["<pad>"])
            writer.add_add_space_prefix(False)
        else:
            writer.add_bos_token_id(ids["<s>"])
            writer.add_eos_token_id(ids["</s>"])
            writer.add_unk_token_id(ids["<unk>"])
            writer.add_chat_template(CHAT_TEMPLATE)
        writer.add_add_bos_token(True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
