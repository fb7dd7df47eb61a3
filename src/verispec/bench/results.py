"""The benchmark's results.json document: its schema (versioned), its round trip, and the
environment facts written beside the results.

The README's "Benchmark results" section documents the schema; bump :data:`SCHEMA_VERSION` on any
incompatible change. The renderings (report.md, rich tables) are :mod:`verispec.bench.report`'s.
Knows nothing about running.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from verispec.bench.figures import SummaryRow, summarize
from verispec.bench.records import ParticipantInfo, RunRecord
from verispec.errors import VerispecError
from verispec.metrics import OUTPUT_BUCKET_TOKENS

SCHEMA = "verispec.bench"


SCHEMA_VERSION = 1


class ResultsFormatError(VerispecError):
    """A results.json file is not a verispec benchmark document of a supported version."""


@dataclass
class BenchResults:
    """Everything one benchmark run produced; ``to_dict`` is the results.json document."""

    config: dict
    environment: dict
    models: list[dict]
    memory: dict
    runners: list[ParticipantInfo]
    records: list[RunRecord]
    summary: list[SummaryRow]
    exactness: dict
    audit: dict
    plots: list[str] = field(default_factory=list)
    created_at: str = ""
    curves: dict = field(default_factory=dict)  # {runner kind: {"target": {k: ms}, "draft": {1: ms}}} (--curves)
    prefill: dict = field(default_factory=dict)  # {runner: {length: {"seconds", "tokens_per_s"}}} (--prefill-tokens)
    quality: dict = field(
        default_factory=dict
    )  # {runner: {"positions", "top1_agreement", "mean_kl_nats"}} (--quality-prompts)

    def to_dict(self) -> dict:
        return {
            "schema": SCHEMA,
            "schema_version": SCHEMA_VERSION,
            "created_at": self.created_at,
            "output_bucket_tokens": OUTPUT_BUCKET_TOKENS,
            "config": self.config,
            "environment": self.environment,
            "models": self.models,
            "memory": self.memory,
            "runners": [asdict(r) for r in self.runners],
            "records": [r.to_dict() for r in self.records],
            "summary": [r.to_dict() for r in self.summary],
            "exactness": self.exactness,
            "audit": self.audit,
            "plots": self.plots,
            "curves": self.curves,
            "prefill": self.prefill,
            "quality": self.quality,
        }

    @classmethod
    def from_dict(cls, data: dict) -> BenchResults:
        """Raises ResultsFormatError on another schema, a newer version or a missing key."""
        if data.get("schema") != SCHEMA:
            raise ResultsFormatError(f"not a verispec benchmark document (schema {data.get('schema')!r})")
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            raise ResultsFormatError(
                f"results schema version {version!r} is not supported (this verispec reads {SCHEMA_VERSION})"
            )
        try:
            return cls(
                config=data["config"],
                environment=data["environment"],
                models=data["models"],
                memory=data["memory"],
                runners=[ParticipantInfo(**r) for r in data["runners"]],
                records=[RunRecord.from_dict(r) for r in data["records"]],
                summary=[SummaryRow(**({"speedup_vs_llama_cpp": None} | r)) for r in data["summary"]],
                exactness=data["exactness"],
                audit=data["audit"],
                plots=data.get("plots", []),
                created_at=data.get("created_at", ""),
                curves=data.get("curves", {}),
                prefill=data.get("prefill", {}),
                quality=data.get("quality", {}),
            )
        except (KeyError, TypeError) as exc:
            raise ResultsFormatError(f"malformed results document: {exc}") from None


def build_results(
    config: dict,
    models: list[dict],
    memory: dict,
    runners: list[ParticipantInfo],
    records: list[RunRecord],
    audit: dict,
) -> BenchResults:
    """Summarise ``records`` and bundle them with the run's facts (environment read here)."""
    return BenchResults(
        config=config,
        environment=environment(config.get("threads")),
        models=models,
        memory=memory,
        runners=runners,
        records=records,
        summary=summarize(records),
        exactness=exactness(
            records,
            greedy=config.get("temperature", 0.0) == 0.0,
            coupled=config.get("sampling", "coupled") == "coupled",
        ),
        audit=audit,
        created_at=_dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
    )


def exactness(records: Sequence[RunRecord], greedy: bool, coupled: bool = False) -> dict:
    """``{"greedy", "compared", "all_equal", "mismatches": [{runner, prompt_id, category}]}``:
    ``compared`` is True for greedy runs and for sampling by coupling (a seed fixes the text under
    every method, so each method's tokens must equal plain decoding's with the same seed);
    ``all_equal`` is None for modified rejection sampling (nothing to compare token by token)."""
    compared = greedy or coupled
    if not compared:
        return {"greedy": False, "compared": False, "all_equal": None, "mismatches": []}
    mismatches = [
        {"runner": r.runner, "prompt_id": r.prompt_id, "category": r.category}
        for r in records
        if r.matches_plain is False
    ]
    return {"greedy": greedy, "compared": True, "all_equal": not mismatches, "mismatches": mismatches}


def environment(threads: int | None) -> dict:
    """Versions and machine facts that decide whether two results files are comparable."""
    import torch
    import transformers

    from verispec import __version__

    try:
        import llama_cpp

        llama = getattr(llama_cpp, "__version__", "installed")
    except ImportError:
        llama = "not installed"
    return {
        "verispec": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "llama_cpp_python": llama,
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "threads": threads or torch.get_num_threads(),
    }


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``'s first ``model name``, else
    :func:`platform.processor`); ``""`` when neither says."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as info:
            for line in info:
                if line.startswith("model name") and ":" in line:
                    return " ".join(line.split(":", 1)[1].split())
    except OSError:
        pass
    return platform.processor()


def write_results(results: BenchResults, path: Path) -> None:
    path.write_text(json.dumps(results.to_dict(), indent=1, ensure_ascii=False) + "\n", encoding="utf-8")


def read_results(path: Path) -> BenchResults:
    """Raises ResultsFormatError (not JSON, other schema or version) or OSError."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except json.JSONDecodeError as exc:
        raise ResultsFormatError(f"{path} is not JSON ({exc.msg})") from None
    return BenchResults.from_dict(data)
