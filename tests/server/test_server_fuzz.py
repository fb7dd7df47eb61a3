"""Property-based fuzzing of the OpenAPI schema with schemathesis: no input may cause a 5xx,
every response must match the schema (status code, content type, body), and schema-invalid
requests must be refused with a 4xx.

Bounded (``MAX_EXAMPLES`` per operation and mode) so it runs in seconds on the tiny pair.
Schema-valid requests may still be refused: the server's token cap, the context window and the
model name are not in the schema, so that one check (positive_data_acceptance) is left out.
Uses schemathesis' hypothesis strategies directly (its lazy pytest loader fails on pytest 9).
"""

from __future__ import annotations

import collections

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import positive_data_acceptance

from server_support import served

MAX_EXAMPLES = 50
OPERATIONS = [
    ("/v1/completions", "POST"),
    ("/v1/chat/completions", "POST"),
    ("/v1/models", "GET"),
    ("/v1/models/{model_id}", "GET"),
    ("/health", "GET"),
    ("/metrics", "GET"),
    ("/tokenize", "POST"),
    ("/detokenize", "POST"),
]


@pytest.fixture(scope="module")
def api_schema(served):
    return schemathesis.openapi.from_url(f"{served.url}/openapi.json")


CASES = [(path, method, GenerationMode.POSITIVE) for path, method in OPERATIONS] + [
    (path, method, GenerationMode.NEGATIVE) for path, method in OPERATIONS if method == "POST"
]


@pytest.mark.parametrize("path, method, mode", CASES)
def test_no_input_causes_a_server_error(api_schema, served, path, method, mode):
    statuses = []

    @given(case=api_schema[path][method].as_strategy(mode), served_model=st.sampled_from([True, False]))
    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        suppress_health_check=list(HealthCheck),
        derandomize=True,
        database=None,
    )
    def check(case, served_model):
        if served_model and isinstance(case.body, dict) and isinstance(case.body.get("model"), str):
            # else nearly every request stops at 404; a model of the wrong type stays as it is, so a
            # schema-invalid request is never repaired into a valid one (seen: an array model plus a
            # null grammar, which the schema allows, answered 200 and was counted as accepted-invalid)
            case.body["model"] = "tiny-target"
        response = case.call(base_url=served.url, timeout=60)
        statuses.append(response.status_code)
        assert response.status_code < 500, response.text
        case.validate_response(response, excluded_checks=[positive_data_acceptance])

    check()
    assert statuses and max(statuses) < 500
    print(f"{method} {path} {mode.value}: statuses {sorted(collections.Counter(statuses).items())}")
