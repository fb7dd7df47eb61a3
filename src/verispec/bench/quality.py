"""Quality of the quantized runners against the float32 model, teacher-forced on its own output.

Owns one measurement: the float32 transformers model (the GGUF de-quantized) decodes each prompt
greedily; then every runner scores that same prompt + continuation in one forward pass, and at
each continuation position its next-token distribution is compared with float32's: top-1
agreement (its argmax is the token float32 chose) and KL(float32 || runner) in nats. Knows
nothing about speculation; the runners' exactness under speculation is measured elsewhere.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from verispec.runners import Runner


@dataclass
class QualityResult:
    """Sums over every scored position; ``positions`` counts them."""

    runner: str
    positions: int = 0
    top1_agreements: int = 0
    kl_sum: float = 0.0

    def to_dict(self) -> dict:
        return {
            "runner": self.runner,
            "positions": self.positions,
            "top1_agreement": self.top1_agreements / self.positions if self.positions else None,
            "mean_kl_nats": self.kl_sum / self.positions if self.positions else None,
        }


def compare_logits(reference: Tensor, logits: Tensor, result: QualityResult) -> None:
    """Add ``[positions, vocab]`` rows of ``logits`` scored against ``reference`` (float32 model).

    Top-1 agreement: ``argmax logits == argmax reference``. KL(reference || logits) =
    sum_v p_ref(v) (log p_ref(v) - log p(v)), in float64; -inf logits (a reduced head) give inf.
    """
    width = min(reference.shape[-1], logits.shape[-1])
    ref = torch.log_softmax(reference[:, :width].double(), dim=-1)
    got = torch.log_softmax(logits[:, :width].double(), dim=-1)
    result.positions += reference.shape[0]
    result.top1_agreements += int((ref.argmax(-1) == got.argmax(-1)).sum())
    result.kl_sum += float((ref.exp() * (ref - got)).sum())


@torch.inference_mode()
def reference_continuations(
    model, prompts: Sequence[Sequence[int]], max_tokens: int, eos_token_ids: Sequence[int], batch_size: int = 16
) -> list[tuple[list[int], Tensor]]:
    """Greedy continuations of the float32 model and its logits at each generated position.

    Prompts run in left-padded batches (transformers ``generate``); each continuation is cut after
    its first EOS. Returns ``(token ids, logits [len, vocab] float32)`` per prompt.
    """
    pad = int(eos_token_ids[0]) if eos_token_ids else 0
    found = []
    for start in range(0, len(prompts), batch_size):
        batch = [list(p) for p in prompts[start : start + batch_size]]
        width = max(len(p) for p in batch)
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        out = model.generate(
            input_ids=input_ids,
            attention_mask=mask,
            max_new_tokens=max_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=pad,
        )
        logits = torch.stack(out.logits, dim=1).float()  # [batch, steps, vocab]
        for row in range(len(batch)):
            tokens = out.sequences[row, width:].tolist()
            length = next((i + 1 for i, t in enumerate(tokens) if t in eos_token_ids), len(tokens))
            found.append((tokens[:length], logits[row, :length].clone()))
    return found


@torch.inference_mode()
def teacher_forced(runner: Runner, prompt: Sequence[int], continuation: Sequence[int]) -> Tensor:
    """``[len(continuation), vocab]``: the runner's logits for each continuation token, given the
    prompt and the continuation before it (one forward pass)."""
    runner.truncate(0)
    tokens = list(prompt) + list(continuation[:-1])
    logits = runner.forward(tokens, num_logits=len(continuation))
    runner.truncate(0)
    return logits


def measure_quality(
    model,
    runners: dict[str, Runner],
    prompts: Sequence[Sequence[int]],
    max_tokens: int,
    eos_token_ids: Sequence[int],
    log: Callable[[str], None] = print,
) -> dict:
    """Top-1 agreement and mean KL of each runner against ``model`` (float32), as a JSON-ready dict."""
    start = time.perf_counter()
    references = reference_continuations(model, prompts, max_tokens, eos_token_ids)
    log(f"[quality] float32 continuations of {len(prompts)} prompts in {time.perf_counter() - start:.0f} s")
    results = {name: QualityResult(name) for name in runners}
    for prompt, (continuation, reference) in zip(prompts, references):
        if not continuation:
            continue
        for name, runner in runners.items():
            if len(prompt) + len(continuation) > runner.max_context_length:
                continue
            compare_logits(reference, teacher_forced(runner, prompt, continuation), results[name])
    report = {name: result.to_dict() for name, result in results.items()}
    for name, row in report.items():
        log(
            f"[quality] {name}: top-1 agreement {row['top1_agreement']:.4f}, mean KL {row['mean_kl_nats']:.5f} nats "
            f"over {row['positions']} positions"
        )
    return report
