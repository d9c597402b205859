"""Request validation against a model config: inputs, outputs, priority, queue timeout."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from inferd.backends.base import TensorSpec
from inferd.batching.rules import QueueLimits, batch_policy, queue_rules, variable_dims
from inferd.batching.validate import (
    InputValidator,
    QueueRules,
    check_requested_outputs,
    input_specs,
)
from inferd.errors import InvalidRequestError
from inferd.model_config import ModelRepoConfig
from inferd.tensors import RequestedOutput


def _config(**fields: Any) -> ModelRepoConfig:
    data: dict[str, Any] = {
        "backend": "python",
        "max_batch_size": 4,
        "input": [
            {"name": "x", "data_type": "TYPE_FP32", "dims": [3]},
            {"name": "ids", "data_type": "TYPE_INT64", "dims": [-1]},
            {"name": "text", "data_type": "TYPE_STRING", "dims": [1], "optional": True},
        ],
    }
    data.update(fields)
    return ModelRepoConfig.model_validate(data)


def _ok_inputs(rows: int = 2) -> dict[str, np.ndarray]:
    return {
        "x": np.zeros((rows, 3), np.float32),
        "ids": np.zeros((rows, 7), np.int64),
    }


def test_valid_request_returns_its_rows() -> None:
    validate = InputValidator(_config(), ())
    assert validate(_ok_inputs(3)) == 3
    text = np.array([[b"a"], [b"b"], [b"c"]], dtype=object)
    assert validate({**_ok_inputs(3), "text": text}) == 3


@pytest.mark.parametrize(
    ("inputs", "needle"),
    [
        ({"x": np.zeros((2, 3), np.float32)}, "'ids' is missing"),
        ({**_ok_inputs(), "y": np.zeros((2, 1), np.float32)}, "unknown input 'y'"),
        ({**_ok_inputs(), "x": np.zeros((2, 3), np.float64)}, "datatype FP64"),
        ({**_ok_inputs(), "x": np.zeros((2, 4), np.float32)}, "expects [-1, 3]"),
        ({**_ok_inputs(), "x": np.zeros((3,), np.float32)}, "rank 1"),
        ({**_ok_inputs(), "ids": np.zeros((3, 7), np.int64)}, "batch size 3"),
        ({"x": np.zeros((5, 3), np.float32), "ids": np.zeros((5, 2), np.int64)}, "1 to 4 rows"),
        ({"x": np.zeros((0, 3), np.float32), "ids": np.zeros((0, 2), np.int64)}, "batch size 0"),
        ({}, "no inputs"),
    ],
)
def test_invalid_inputs_name_the_problem(inputs: dict[str, np.ndarray], needle: str) -> None:
    with pytest.raises(InvalidRequestError) as info:
        InputValidator(_config(), ())(inputs)
    assert needle in str(info.value)


def test_no_batch_dim_model_takes_the_dims_as_they_are() -> None:
    validate = InputValidator(_config(max_batch_size=0), ())
    assert validate({"x": np.zeros((3,), np.float32), "ids": np.zeros((9,), np.int64)}) == 1
    with pytest.raises(InvalidRequestError, match="rank 2"):
        validate(_ok_inputs(1))


def test_inputs_come_from_the_backend_when_the_config_lists_none() -> None:
    config = ModelRepoConfig.model_validate({"backend": "onnxruntime", "max_batch_size": 8})
    declared = [TensorSpec("features", "FP32", (-1, 30))]
    assert input_specs(config, declared)[0].dims == (30,)
    validate = InputValidator(config, declared)
    assert validate({"features": np.zeros((5, 30), np.float32)}) == 5
    with pytest.raises(InvalidRequestError, match="expects \\[-1, 30\\]"):
        validate({"features": np.zeros((5, 31), np.float32)})
    # Nothing declared anywhere: only the batch bound is checked (the backend checks the rest).
    free = InputValidator(config, ())
    assert free({"anything": np.zeros((2, 9), np.float32)}) == 2
    with pytest.raises(InvalidRequestError, match="1 to 8 rows"):
        free({"anything": np.zeros((9, 1), np.float32)})


def test_requested_outputs() -> None:
    known = frozenset({"probs", "label"})
    check_requested_outputs(None, known)
    check_requested_outputs([RequestedOutput("probs", classification=3)], known)
    check_requested_outputs([RequestedOutput("whatever")], None)  # unknown until it runs
    with pytest.raises(InvalidRequestError, match="unknown output 'nope'"):
        check_requested_outputs([RequestedOutput("nope")], known)
    with pytest.raises(InvalidRequestError, match="classification"):
        check_requested_outputs([RequestedOutput("probs", classification=-1)], known)


def test_priority_levels() -> None:
    rules = QueueRules(priority_levels=3, default_priority=2)
    assert rules.priority(0) == 2
    assert [rules.priority(p) for p in (1, 2, 3)] == [1, 2, 3]
    for bad in (4, -1):
        with pytest.raises(InvalidRequestError, match="priority"):
            rules.priority(bad)
    # No levels configured: one level, the request's priority is ignored (as Triton does).
    assert QueueRules().priority(7) == QueueRules().priority(0)


def test_timeout_override_only_shortens() -> None:
    rules = QueueRules(default_timeout_s=2.0)
    assert rules.timeout_s(0) == 2.0
    assert rules.timeout_s(500_000) == 0.5
    assert rules.timeout_s(5_000_000) == 2.0
    assert QueueRules().timeout_s(0) is None
    assert QueueRules().timeout_s(3_000_000) == 3.0
    assert QueueRules(default_timeout_s=2.0, allow_timeout_override=False).timeout_s(1000) == 2.0
    with pytest.raises(InvalidRequestError):
        rules.timeout_s(-1)


def test_rules_and_policy_from_config() -> None:
    limits = QueueLimits(max_queue_size=99, default_timeout_s=7.0)
    plain = _config()
    assert batch_policy(plain, limits).dynamic is False
    assert batch_policy(plain, limits).max_queue_size == 99
    assert queue_rules(plain, limits).default_timeout_s == 7.0
    tuned = _config(
        dynamic_batching={
            "max_queue_delay_microseconds": 500,
            "preferred_batch_size": [4, 2, 3],
            "priority_levels": 2,
            "default_priority_level": 2,
            "default_queue_policy": {"max_queue_size": 5, "default_timeout_ms": 250},
        }
    )
    policy = batch_policy(tuned, limits)
    assert (policy.dynamic, policy.max_delay_s, policy.preferred_batch_sizes) == (
        True,
        0.0005,
        (2, 3, 4),
    )
    assert policy.max_queue_size == 5
    rules = queue_rules(tuned, limits)
    assert (rules.priority_levels, rules.default_priority, rules.default_timeout_s) == (2, 2, 0.25)
    # No batch dim: never batched, whatever the dynamic_batching section says.
    assert batch_policy(_config(max_batch_size=0, dynamic_batching={}), limits).dynamic is False


def test_variable_dims_from_config_and_backend() -> None:
    declared = [TensorSpec("ids", "INT64", (-1, -1)), TensorSpec("x", "FP32", (-1, 3))]
    assert variable_dims(_config(), declared, has_preprocess=False) == {"ids": (1,)}
    # With preprocess, the config's inputs are the client's: only the backend's count.
    only_backend = variable_dims(
        _config(), [TensorSpec("m", "INT64", (-1, 4, -1))], has_preprocess=True
    )
    assert only_backend == {"m": (2,)}
    assert variable_dims(_config(max_batch_size=0), declared, has_preprocess=False) == {}
