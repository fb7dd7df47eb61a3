"""Cost curves (measure, cache, choose) and the pipeline's runner choice (torch, int8, auto)."""

import json
import re
import time

import pytest
import torch

from helpers import BigramRunner, VocabTokenizer, default_pieces, perturbed_copy, single_thread
from verispec.algorithms.control import CostModel
from verispec.algorithms.sampling import SamplingParams
from verispec.engine import SpeculativeConfig
from verispec.engine.loader import SpeculativePipeline
from verispec.errors import InvalidParameterError
from verispec.models.cache_files import read_checked
from verispec.models.loading import LoadedModel
from verispec.runners.choice import Host, ModelFile, ModelFiles, choose_runner, time_candidates
from verispec.runners.costs import CostCache, CostCurve, fastest_runner, measure_cost_curve, seed_cost_model
from verispec.runners.cpu.int8 import Int8Runner
from verispec.runners.select import RunnerOptions
from verispec.runners.torch_runner import TransformersRunner


def curve(name, ms):
    return CostCurve(name, "m", dict(zip((1, 2, 4, 8, 16), ms)))


@pytest.fixture
def exact_int8_cpu(monkeypatch):
    """These tests are about auto's caching, not the host: make int8 a candidate as on a CPU whose
    int8 kernel is exact (AVX-512 VNNI); on an AVX2-only host auto leaves int8 out (said once)."""
    import verispec.runners.choice as choice

    monkeypatch.setattr(choice, "int8_warning", lambda *, auto: None)


def test_measure_cost_curve_times_each_k_and_leaves_the_cache_empty():
    runner = BigramRunner(torch.zeros(50, 50), max_context_length=128)
    measured = measure_cost_curve(runner, runner_name="bigram", model="x", repeats=5, warmup=1)
    assert sorted(measured.ms) == [1, 2, 4, 8, 16] and all(len(v) == 5 for v in measured.samples.values())
    assert runner.num_cached_tokens == 0
    assert runner.num_forwards == 1 + 5 * 6  # the context, then (1 warmup + 5) forwards per k
    with pytest.raises(ValueError):
        measure_cost_curve(BigramRunner(torch.zeros(50, 50), max_context_length=70), runner_name="b", model="x")


def test_cost_cache_round_trip_and_bad_file(tmp_path):
    cache = CostCache(tmp_path, machine="m1")
    assert cache.get("model", "int8") is None
    cache.put("model", curve("int8", [36, 39, 45, 56, 81]))
    again = CostCache(tmp_path, machine="m1").get("model", "int8")
    assert again.ms == {1: 36, 2: 39, 4: 45, 8: 56, 16: 81} and again.ratio(8) == pytest.approx(56 / 36)
    assert CostCache(tmp_path, machine="other").get("model", "int8") is None  # per machine
    cache.path.write_text("{not json")
    assert cache.get("model", "int8") is None  # unreadable: measured again


@pytest.mark.parametrize(
    "targets, drafts, expected",
    [
        # plain decoding: the cheapest single-token forward wins
        ({"flat": curve("flat", [36, 39, 45, 56, 81]), "steep": curve("steep", [34, 59, 93, 221, 250])}, None, "steep"),
        # speculation with a cheap drafter: the flat verify curve wins
        (
            {"flat": curve("flat", [36, 39, 45, 56, 81]), "steep": curve("steep", [34, 59, 93, 221, 250])},
            {"flat": curve("flat", [1, 1, 1, 1, 1]), "steep": curve("steep", [1, 1, 1, 1, 1])},
            "flat",
        ),
    ],
)
def test_fastest_runner(targets, drafts, expected):
    assert fastest_runner(targets, drafts) == expected


def test_seed_cost_model_gives_the_controller_verify_costs():
    model = CostModel()
    seed_cost_model(model, curve("int8", [36, 39, 45, 56, 81]))
    assert model.verify_s == {0: pytest.approx(0.036)}  # the level: one plain pass
    assert model.verify_points()[7] == pytest.approx(0.056)  # the shape times that level


def auto_choice(build, cache, device="cpu"):
    """What ``--runner auto`` picks for a model "tiny" without a file: chosen, then timed."""
    files, host = ModelFiles(ModelFile("tiny")), Host(device, cache)
    return time_candidates(choose_runner("auto", files, host), files, host, lambda kind, role: build(kind))


def test_auto_measures_once_then_uses_the_cache(tmp_path, target_model, exact_int8_cpu):
    built = []

    def build(kind):
        built.append(kind)
        return Int8Runner.from_module(target_model, max_context_length=128)

    cache = CostCache(tmp_path, machine="m")
    files = ModelFiles(ModelFile("tiny"))
    untimed = choose_runner("auto", files, Host("cpu", cache))
    assert (untimed.kind, untimed.untimed) == ("auto", ("int8",))  # no curve cached yet: timed once loaded
    assert auto_choice(build, cache).kind == "int8"  # no GGUF: int8 only
    cached = choose_runner("auto", files, Host("cpu", cache))
    assert (cached.kind, cached.facts) == ("int8", {"int8_kernel": cached.facts["int8_kernel"]})  # from the cache
    assert "cached cost curves" in cached.reasons[-1]
    assert built == ["int8"]
    assert auto_choice(build, cache, device="cuda:0").kind == "torch"


def loaded(name, model):
    tokenizer = VocabTokenizer(default_pieces(model.config.vocab_size))
    return LoadedModel(name, model, tokenizer, None, 0.0, 0, (0,), 256, model.config.vocab_size)


def test_pipeline_with_int8_runner_is_exact(target_model, tmp_path, monkeypatch):
    monkeypatch.setenv("VERISPEC_HOME", str(tmp_path))
    draft = loaded("draft", perturbed_copy(target_model, noise=0.1, seed=5))
    pipe = SpeculativePipeline(
        loaded("target", target_model), draft, runners=RunnerOptions(kind="int8", draft_vocab_size=60)
    )
    assert pipe.runner_kind == "int8" and isinstance(pipe.engine.target, Int8Runner)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    plain = pipe.engine.generate([5, 17, 33, 5, 17], params, SpeculativeConfig(method="none")).token_ids
    for method in ("draft", "ngram", "auto"):
        out = pipe.engine.generate(
            [5, 17, 33, 5, 17], params, SpeculativeConfig(method=method, num_speculative_tokens=4)
        )
        assert out.token_ids == plain, method


def test_pipeline_auto_resolves_and_caches(target_model, tmp_path, monkeypatch, exact_int8_cpu):
    monkeypatch.setenv("VERISPEC_HOME", str(tmp_path))
    pipe = SpeculativePipeline(loaded("target", target_model), None, runners=RunnerOptions(kind="auto"))
    assert pipe.runner_kind == "int8"  # CPU, no GGUF file: int8 is the only fast candidate
    assert list((tmp_path / "costs").glob("*.json"))
    assert "target" in json.loads(read_checked(next((tmp_path / "costs").glob("*.json")), CostCache.KIND))


@pytest.mark.parametrize(
    "options, error",
    [
        (
            RunnerOptions(kind="torch", draft_vocab_size=10),
            "needs --runner gguf or int8",
        ),  # FR-Spec head: batch-invariant runners only
        (RunnerOptions(kind="llamacpp"), "needs a .gguf model"),  # a torch checkpoint, no GGUF file
    ],
)
def test_pipeline_refuses_runner_that_cannot_run(target_model, options, error):
    with pytest.raises(InvalidParameterError, match=error):
        SpeculativePipeline(loaded("target", target_model), loaded("draft", target_model), runners=options)


def test_unknown_runner_is_refused():
    with pytest.raises(InvalidParameterError, match="unknown runner"):
        RunnerOptions(kind="onnx")


def test_default_runner_is_unchanged(target_model):
    pipe = SpeculativePipeline(loaded("target", target_model))
    assert pipe.runner_kind == "torch" and isinstance(pipe.engine.target, TransformersRunner)


class SlowRunner(BigramRunner):
    """Every forward sleeps: a kernel path far slower than the quick measurement's budget."""

    def forward(self, token_ids, num_logits=None):
        time.sleep(0.3)
        return super().forward(token_ids, num_logits)


def test_quick_cost_curve_stops_early_on_a_slow_path_and_runs_in_full_on_a_fast_one(monkeypatch):
    from verispec.runners import costs

    slow = SlowRunner(torch.zeros(50, 50), max_context_length=64)
    measured = measure_cost_curve(
        slow, runner_name="slow", model="x", context_tokens=16, repeats=3, warmup=1, budget_s=0.5
    )
    assert sorted(measured.ms) == [1, 2]  # a 0.3 s pass: no warm-up, one round, stopped once two k values are timed
    assert slow.num_forwards == 1 + 1 + 2  # the context, the first pass that found it slow, k = 1 and 2
    monkeypatch.setattr(
        costs, "SLOW_PASS_S", 60.0
    )  # no pass of a table lookup counts as slow, however busy the machine
    fast = BigramRunner(torch.zeros(50, 50), max_context_length=64)
    measured = measure_cost_curve(
        fast, runner_name="fast", model="x", context_tokens=16, repeats=3, warmup=1, budget_s=60.0
    )
    assert sorted(measured.ms) == [1, 2, 4, 8, 16] and all(len(v) == 3 for v in measured.samples.values())
    assert fast.num_forwards == 1 + 1 + 4 * 5  # within the budget: the warm-up round and every repeat


def test_machine_key_follows_the_cpu_features(monkeypatch):
    from verispec.runners import costs

    monkeypatch.setattr(costs, "cpu_description", lambda: "AMD EPYC 7B13|fma avx2")
    avx2_only = costs.machine_key()
    monkeypatch.setattr(costs, "cpu_description", lambda: "AMD EPYC 7B13|fma avx2 avx512f avx512_vnni")
    assert costs.machine_key() != avx2_only  # same model name, other features: its own cost file
    monkeypatch.undo()
    assert "|" in costs.cpu_description() and costs.cpu_description().split("|")[0]  # this host: a name, then its flags


def test_slow_steps_are_announced_and_fast_ones_are_silent(capsys):
    from verispec.progress import announce_slow

    with announce_slow("timing the gguf runner on m", "the controller starts from it", after_s=0.0) as announced:
        assert announced.wait(10)  # still running after after_s: the first line is out
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "verispec: timing the gguf runner on m (the controller starts from it) ..."
    assert re.fullmatch(r"verispec: timing the gguf runner on m: done in \d+\.\d s", lines[1])
    with pytest.raises(RuntimeError), announce_slow("loading x", "why", after_s=0.0) as announced:
        announced.wait(10)
        raise RuntimeError("failed")
    assert re.search(
        r"verispec: loading x: stopped after \d+\.\d s", capsys.readouterr().err
    )  # never "done" when it failed
    with announce_slow("loading y", "why", after_s=60.0) as announced:
        pass
    assert not announced.is_set() and capsys.readouterr().err == ""  # a fast step says nothing


def test_auto_leaves_out_int8_where_its_fast_kernel_is_not_exact(target_model, tmp_path, monkeypatch, capsys):
    from verispec.runners import notices
    from verispec.runners.choice import kernel_facts
    from verispec.runners.cpu import int8_ops
    from verispec.runners.notices import runner_label

    def build(kind):
        raise AssertionError(f"auto measured {kind}")

    cache = CostCache(tmp_path, machine="m")
    monkeypatch.setattr(notices, "_SAID", set())
    here = choose_runner("auto", ModelFiles(ModelFile("tiny")), Host("cpu", cache))
    assert here.candidates == (("int8",) if int8_ops.default_kernel() == "onednn" else ())  # this CPU
    monkeypatch.setattr(notices, "_SAID", set())
    monkeypatch.setattr(int8_ops, "default_kernel", lambda: "int_mm")  # an AVX2-only CPU: torch._int_mm
    capsys.readouterr()
    choice = auto_choice(build, cache)
    assert (choice.kind, choice.candidates) == ("torch", ())
    choice.say()
    choice.say()
    err = capsys.readouterr().err
    assert err.count("leaves out the int8 runner") == 1 and "AVX-512 VNNI" in err  # said once, plainly
    assert (
        runner_label("int8", kernel_facts("int8"))
        == "int8 runner, torch._int_mm int8 kernel (slow here: no AVX-512 VNNI)"
    )
    monkeypatch.setenv("VERISPEC_HOME", str(tmp_path))
    pipe = SpeculativePipeline(loaded("target", target_model), None, runners=RunnerOptions(kind="int8"))
    assert pipe.runner_kind == "int8"  # asked for by name: it runs, and says why it is slow
    assert "--runner gguf is the fast exact runner" in capsys.readouterr().err


def test_cost_curves_are_cached_per_kernel_path(tmp_path, target_model, monkeypatch, exact_int8_cpu):
    from verispec.runners.choice import cached_curve
    from verispec.runners.cpu import int8_ops

    monkeypatch.setenv("VERISPEC_HOME", str(tmp_path))
    SpeculativePipeline(loaded("target", target_model), None, runners=RunnerOptions(kind="auto"))
    (path,) = (tmp_path / "costs").glob("*.json")
    assert list(json.loads(read_checked(path, CostCache.KIND))["target"]) == [f"int8:{int8_ops.default_kernel()}"]
    assert cached_curve("target", None, "int8") is not None
    other = "int_mm" if int8_ops.default_kernel() == "onednn" else "onednn"
    monkeypatch.setattr(int8_ops, "default_kernel", lambda: other)
    assert cached_curve("target", None, "int8") is None  # another kernel path: measured anew


def test_cached_auto_choice_without_candidates_is_the_torch_runner(monkeypatch, tmp_path):
    """An AVX2-only CPU (int8 left out) and a model no other runner loads: no candidate, so the
    torch runner, decided without timing; it used to raise 'no runner to choose from' (bench --runner auto)."""
    import verispec.runners.choice as choice

    monkeypatch.setattr(choice, "int8_warning", lambda *, auto: "int8 is slow here")
    files = ModelFiles(ModelFile("m"), ModelFile("d"))
    chosen = choose_runner("auto", files, Host("cpu", CostCache(tmp_path)))
    assert (chosen.kind, chosen.untimed, chosen.notices) == ("torch", (), (("int8-auto", "int8 is slow here"),))


@pytest.mark.parametrize(
    "draft_types, arch, said",
    [
        ({"attn_q": "F16"}, "qwen2", "its blk.0.attn_q.weight is F16, a block type the gguf kernels do not multiply"),
        ({}, "gemma2", "the gguf and int8 runners support llama, qwen2, qwen3, gemma3, phi3 models, not 'gemma2'"),
    ],
)
def test_auto_says_why_the_gguf_runner_cannot_run_a_gguf_file(tmp_path, draft_types, arch, said):
    """A draft the gguf runner refuses moves the whole pair to another runner (minutes of loading
    a float model, or int8's timing): said on stderr, where it used to be silent."""
    from gguf import GGMLQuantizationType as T

    from gguf_models import MIXED, write_gguf_model

    target = write_gguf_model(tmp_path / "target.gguf")
    types = dict(MIXED, **{role: T[name] for role, name in draft_types.items()})
    draft = write_gguf_model(tmp_path / "draft.gguf", types, arch=arch)
    files = ModelFiles(ModelFile("target.gguf", target), ModelFile("draft.gguf", draft))
    chosen = choose_runner("auto", files, Host("cpu", CostCache(tmp_path / "costs")))
    assert chosen.kind != "gguf"
    texts = [text for key, text in chosen.notices if key.startswith("gguf-cannot-run")]
    assert len(texts) == 1 and texts[0].startswith("the gguf runner cannot run draft.gguf (") and said in texts[0]
    assert texts[0].endswith("--runner auto runs the pair on another runner")
    alone = choose_runner("auto", ModelFiles(ModelFile("target.gguf", target)), Host("cpu", CostCache(tmp_path)))
    assert alone.kind == "gguf" and not [key for key, _ in alone.notices if key.startswith("gguf-cannot-run")]
