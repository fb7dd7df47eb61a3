"""What a runner declares (verispec.runners.Runner): the capabilities the training and the heads
use, each with its default, and the one table of architectures the runners and heads read."""

import pytest
import torch

from helpers import BigramRunner, tiny_qwen2
from verispec.errors import InvalidParameterError
from verispec.models.architectures import ARCHITECTURES, EAGLE_MODEL_TYPES, GGUF_ARCHITECTURES, INT8_MODEL_TYPES
from verispec.runners.cpu.gguf_arch import SUPPORTED_ARCHITECTURES
from verispec.runners.cpu.int8 import Int8Runner
from verispec.runners.eagle.shape import SUPPORTED_MODEL_TYPES as HEAD_MODEL_TYPES
from verispec.runners.torch_runner import TransformersRunner
from verispec.training.teacher import runner_teacher


def test_the_base_runner_declares_no_final_hidden_states_no_model_no_weights():
    runner = BigramRunner(torch.zeros(8, 8))  # a runner implementing only the required methods
    assert (runner.supports_final_hidden, runner.model, runner.weights, runner.last_final_hidden) == (
        False,
        None,
        None,
        None,
    )
    with pytest.raises(InvalidParameterError, match="cannot hand out its final hidden states"):
        runner.capture_final_hidden(True)


def test_each_runner_declares_what_it_holds():
    model = tiny_qwen2(0)
    int8 = Int8Runner.from_module(model, max_context_length=64)
    torch_runner = TransformersRunner(model, max_context_length=64)
    assert int8.supports_final_hidden and int8.weights is not None and int8.model is None
    assert int8.weights.nbytes() > 0
    assert not torch_runner.supports_final_hidden and torch_runner.weights is None and torch_runner.model is model


def test_training_on_a_runner_without_final_hidden_states_is_refused_before_any_pass():
    runner = TransformersRunner(tiny_qwen2(0), max_context_length=64)
    with pytest.raises(InvalidParameterError, match="cannot hand out its final hidden states"):
        runner_teacher(runner, [1, 2, 3], (1,))
    assert runner.num_cached_tokens == 0


def test_one_table_of_architectures():
    assert GGUF_ARCHITECTURES == SUPPORTED_ARCHITECTURES == ("llama", "qwen2", "qwen3", "gemma3", "phi3")
    assert INT8_MODEL_TYPES == ("llama", "qwen2")  # the int8 runner converts these transformers models
    assert EAGLE_MODEL_TYPES == HEAD_MODEL_TYPES == ("llama", "qwen2", "qwen3", "mistral")
    assert ARCHITECTURES["gemma3"].activation == "gelu_tanh" and ARCHITECTURES["llama"].permuted_qk
