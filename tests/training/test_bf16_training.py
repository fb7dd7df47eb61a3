"""Training a head in bf16 (training/step.py, training/precision.py) on the tiny Qwen2 target:
the masters and checkpoints stay fp32, the bf16 loss is the fp32 loss within bf16's rounding, a
bf16 run learns, a run resumes across precisions, and the format is chosen from the CPU flags
(mocked) with a clear refusal of bf16 where the CPU has no native bf16."""

import pytest
import torch

from helpers import VOCAB, greedy_continuations, single_thread, tiny_qwen2
from verispec.errors import InvalidParameterError
from verispec.runners.cpu.reduced_vocab import token_counts
from verispec.runners.eagle.head import EagleHead, choose_draft_vocabulary
from verispec.training import precision
from verispec.training.loop import TrainOptions, batches, pack, teacher, train_head, windows_of
from verispec.training.step import TrainStep, compute_copy, distillation_loss, make_optimizer, target_draft_head

EOS = 95


@pytest.fixture(scope="module")
def target():
    return tiny_qwen2(0)


@pytest.fixture(scope="module")
def sequences(target):
    return greedy_continuations(target, seed=1)


@pytest.fixture(scope="module")
def draft_ids(sequences):
    return choose_draft_vocabulary(token_counts(sequences, VOCAB), 64, eos_token_ids=[EOS])


@pytest.fixture(scope="module")
def batch(target, sequences, draft_ids):
    """One packed batch of 8 sequences (27 anchors each), 3 unrolled steps."""
    layers = EagleHead.from_target(target, draft_token_ids=draft_ids).shape.feature_layers
    teachers = [teacher(target, s, layers) for s in sequences[:8]]
    return pack(teachers, batches(windows_of(teachers, range(8), 512), 512)[0], 3)


def head_and_target_head(target, draft_ids, seed=3):
    head = EagleHead.from_target(target, draft_token_ids=draft_ids, seed=seed)
    return head, target_draft_head(target, head.d2t)


def test_the_bf16_loss_is_the_f32_loss_within_rounding(target, draft_ids, batch):
    head, target_head = head_and_target_head(target, draft_ids)
    with torch.no_grad():
        f32, agree32 = distillation_loss(head, batch, target_head, 0.8)
        bf16_head = compute_copy(head, torch.bfloat16)
        bf16_target_head = tuple(None if t is None else t.bfloat16() for t in target_head)
        bf16, agree16 = distillation_loss(bf16_head, batch, bf16_target_head, 0.8)
    assert bf16.dtype == torch.float32 and bf16_head.fc.weight.dtype == torch.bfloat16
    assert bf16_head.inv_freq.dtype == torch.float32  # rotary angles of positions stay fp32
    assert bf16_head.embed_tokens is head.embed_tokens  # the target's embedding borrowed, not copied
    print(f"loss f32 {float(f32):.5f} bf16 {float(bf16):.5f}")
    assert abs(float(bf16) - float(f32)) < 0.01 * float(f32)  # bf16 has 8 bits of mantissa: ~0.4 % a product
    agreement = [float((a == b).float().mean()) for a, b in zip(agree32, agree16)]
    assert min(agreement) > 0.9  # the same argmax on nearly every row


def test_a_bf16_step_keeps_fp32_masters_and_learns_a_fixed_batch(target, draft_ids, batch):
    head, target_head = head_and_target_head(target, draft_ids)
    options = TrainOptions(lr=3e-3, precision="bf16")
    step = TrainStep(head, make_optimizer(head, options), target_head, options)
    losses = [float(step(batch)[0]) for _ in range(12)]
    print("bf16 losses on one batch:", [round(x, 3) for x in losses])
    assert losses[-1] < 0.7 * losses[0]  # the masters moved, and the bf16 copy with them
    assert all(p.dtype == torch.float32 for p in head.parameters())
    assert all(g.dtype == torch.float32 for p in head.parameters() if (g := p.grad) is not None)
    moments = [s["exp_avg"] for s in step.optimizer.state.values()]
    assert moments and all(m.dtype == torch.float32 for m in moments)
    for master, copy in zip(step.masters, step.copies):  # the copy is the masters rounded, after the step
        assert torch.equal(copy, master.detach().bfloat16())


def test_a_bf16_run_saves_an_fp32_head(target, sequences, draft_ids, tmp_path):
    head = EagleHead.from_target(target, draft_token_ids=draft_ids, seed=0)
    options = TrainOptions(steps=20, lr=3e-3, batch_positions=128, held_out=0.25, seed=0, precision="bf16")
    report = train_head(head, target, sequences, options)
    print(f"bf16: held-out top-1 {report.held_out_top1_before:.3f} -> {report.held_out_top1:.3f}")
    assert report.held_out_loss < report.held_out_loss_before
    assert report.held_out_top1 > report.held_out_top1_before + 0.1
    head.save(tmp_path / "head.pt")
    stored = torch.load(tmp_path / "head.pt", weights_only=True)["state_dict"]
    assert {v.dtype for k, v in stored.items() if k != "d2t"} == {torch.float32}


@pytest.mark.parametrize("first, then", [("f32", "bf16"), ("bf16", "f32")])
def test_a_run_resumes_in_the_other_precision(target, sequences, draft_ids, first, then):
    """3 steps in one format, 3 more from its optimiser state in the other: the losses follow a
    6-step run in the first format within bf16's rounding (the moments and batch order continue)."""
    kwargs = dict(lr=1e-3, batch_positions=64, held_out=0.25, seed=2)
    whole = EagleHead.from_target(target, draft_token_ids=draft_ids, seed=1)
    whole_losses = train_head(whole, target, sequences[:12], TrainOptions(steps=6, precision=first, **kwargs)).losses
    split = EagleHead.from_target(target, draft_token_ids=draft_ids, seed=1)
    first_options = TrainOptions(steps=3, precision=first, **kwargs)
    optimizer = make_optimizer(split, first_options)
    train_head(split, target, sequences[:12], first_options, optimizer=optimizer)
    then_options = TrainOptions(steps=3, steps_before=3, precision=then, **kwargs)
    resumed = make_optimizer(split, then_options, optimizer.state_dict())
    assert all(int(s["step"]) == 3 for s in resumed.state.values())  # AdamW's step counts carried over
    second = train_head(split, target, sequences[:12], then_options, optimizer=resumed).losses
    assert second == pytest.approx(whole_losses[3:], rel=0.02)
    assert all(p.dtype == torch.float32 for p in split.parameters())


@pytest.mark.parametrize(
    "torch_flags, cpuinfo, requested, expected, says",
    [
        ({"amx_bf16", "avx512_bf16"}, set(), "auto", "bf16", "has AMX-BF16"),  # Intel Xeon 4th gen
        ({"avx512_bf16"}, set(), "auto", "bf16", "has AVX512-BF16"),  # AMD Zen 4
        (set(), {"avx512_bf16"}, "auto", "f32", "no native bf16"),  # torch's check wins over /proc/cpuinfo
        (None, {"avx512f", "avx512_bf16"}, "auto", "bf16", "has AVX512-BF16"),  # torch without checks: cpuinfo
        (None, {"avx512f", "avx512_vnni", "avx2"}, "auto", "f32", "no native bf16"),  # AVX-512, no bf16 (Ice Lake)
        (None, {"avx2", "fma"}, "auto", "f32", "no native bf16"),
        ({"avx512_bf16"}, set(), "f32", "f32", "as asked"),  # f32 asked: f32 anywhere
        ({"amx_bf16"}, set(), "bf16", "bf16", "as asked"),
    ],
)
def test_the_choice_follows_the_cpu_flags(monkeypatch, torch_flags, cpuinfo, requested, expected, says):
    monkeypatch.setattr(precision, "_torch_flags", lambda: torch_flags)
    monkeypatch.setattr(precision, "cpu_flags", lambda: cpuinfo)
    chosen = precision.choose_precision(requested)
    assert chosen.precision == expected and chosen.reason.startswith(expected) and says in chosen.reason


def test_bf16_on_a_cpu_without_it_is_refused_in_one_line(monkeypatch):
    monkeypatch.setattr(precision, "_torch_flags", lambda: {"avx2"})
    with pytest.raises(InvalidParameterError, match=r"needs a CPU with native bf16 .* use --precision f32") as info:
        precision.choose_precision("bf16")
    assert "\n" not in str(info.value)
    with pytest.raises(InvalidParameterError, match="--precision must be one of auto, f32, bf16"):
        precision.choose_precision("fp16")
    assert precision.choose_precision("auto", "cuda:0").precision == "f32"  # auto decides for CPUs only
    assert precision.choose_precision("bf16", "cuda:0").precision == "bf16"


def test_cpu_flags_reads_the_flags_line(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16 amx_tile amx_bf16\n\nprocessor\t: 1\n")
    assert precision.cpu_flags(cpuinfo) == {"fpu", "avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"}
    assert precision.native_bf16(precision.cpu_flags(cpuinfo)) == "AMX-BF16"
    assert precision.cpu_flags(tmp_path / "missing") == set()
