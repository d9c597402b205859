"""Batch assembly (inferd.batching.assembler): plain numpy, no model, no threads."""

from __future__ import annotations

import numpy as np
import pytest

from inferd.batching.assembler import (
    NUM_TOKENS,
    BackendError,
    OutputSelector,
    Placement,
    Tensors,
    assemble,
    backend_error,
    check_rows,
    num_tokens,
    place,
    request_rows,
    split_private,
    split_rows,
    stack,
    step_error,
)
from inferd.errors import InvalidRequestError, ModelNotReadyError
from inferd.tensors import RequestedOutput


def test_stack_concatenates_equal_shapes_without_padding() -> None:
    batch, pad = stack([np.ones((2, 3), np.float32), np.zeros((1, 3), np.float32)])
    assert batch.shape == (3, 3) and pad == 0
    np.testing.assert_array_equal(batch[:2], 1.0)


def test_stack_pads_with_zeros_to_the_longest() -> None:
    a = np.array([[1, 2, 3]], np.int64)
    b = np.array([[4], [5]], np.int64)
    batch, pad = stack([a, b])
    np.testing.assert_array_equal(batch, [[1, 2, 3], [4, 0, 0], [5, 0, 0]])
    assert batch.dtype == np.int64 and pad == 4


def test_stack_pads_bytes_with_empty_strings() -> None:
    a = np.array([[b"x", b"y"]], dtype=object)
    b = np.array([[b"z"]], dtype=object)
    batch, pad = stack([a, b])
    assert batch.tolist() == [[b"x", b"y"], [b"z", b""]] and pad == 1


def test_stack_refuses_different_ranks() -> None:
    with pytest.raises(InvalidRequestError, match="different ranks"):
        stack([np.zeros((1, 2)), np.zeros((1, 2, 1))])


def test_assemble_reports_the_padding_ratio_of_variable_tensors_only() -> None:
    a: Tensors = {"ids": np.ones((1, 4), np.int64), "x": np.ones((1, 2), np.float32)}
    b: Tensors = {"ids": np.ones((1, 2), np.int64), "x": np.ones((1, 2), np.float32)}
    batch, ratio = assemble([a, b], variable={"ids"})
    assert batch["ids"].shape == (2, 4) and batch["x"].shape == (2, 2)
    assert ratio == pytest.approx(2 / 8)  # "x" is fixed-length: not in the ratio


def test_assemble_of_one_request_is_its_tensors() -> None:
    a = {"ids": np.ones((2, 3), np.int64)}
    batch, ratio = assemble([a], variable={"ids"})
    assert batch["ids"] is a["ids"] and ratio == 0.0


def test_assemble_counts_an_unlisted_tensor_that_needed_padding() -> None:
    batch, ratio = assemble([{"t": np.ones((1, 3))}, {"t": np.ones((1, 1))}], variable=())
    assert batch["t"].shape == (2, 3) and ratio == pytest.approx(2 / 6)


def test_split_rows_gives_each_request_its_rows() -> None:
    outputs = {"y": np.arange(5), "z": np.arange(10).reshape(5, 2)}
    parts = split_rows(outputs, [2, 3], batched=True)
    assert [p["y"].tolist() for p in parts] == [[0, 1], [2, 3, 4]]
    assert parts[1]["z"].shape == (3, 2)


def test_split_rows_refuses_an_output_without_the_batch_rows() -> None:
    with pytest.raises(BackendError, match="for a batch of 3 rows"):
        split_rows({"y": np.arange(2)}, [1, 2], batched=True)
    with pytest.raises(BackendError, match="shape \\[\\]"):
        split_rows({"y": np.array(1.0, np.float32)}, [1], batched=True)


def test_split_rows_of_an_unbatched_model_is_the_whole_output() -> None:
    outputs = {"y": np.arange(7)}
    (part,) = split_rows(outputs, [1], batched=False)
    assert part["y"].tolist() == list(range(7))


def test_request_rows_slices_the_padded_batch() -> None:
    inputs = {"mask": np.arange(12).reshape(4, 3)}
    rows = request_rows(inputs, offset=1, rows=2, batched=True)
    assert rows["mask"].tolist() == [[3, 4, 5], [6, 7, 8]]
    assert request_rows(inputs, 1, 2, batched=False)["mask"].shape == (4, 3)


def test_split_private_and_num_tokens() -> None:
    public, private = split_private({"ids": np.zeros(2), NUM_TOKENS: np.array([3, 4])})
    assert list(public) == ["ids"] and list(private) == [NUM_TOKENS]
    assert num_tokens(private) == 7 and num_tokens({}) is None
    public, private = split_private({"ids": np.zeros(2)})
    assert list(public) == ["ids"] and private == {}


def test_check_rows_names_the_input_a_step_broke() -> None:
    check_rows({"x": np.zeros((2, 3))}, rows=2)
    with pytest.raises(BackendError, match="input 'x' of shape \\[3\\] from a request of 2"):
        check_rows({"x": np.zeros(3)}, rows=2)


def test_place_buckets_lengths_by_the_next_power_of_two() -> None:
    variable = {"ids": (1,)}
    assert place({"ids": np.zeros((1, 5))}, variable, keyed_by_names=False) == Placement(8, 5, None)
    assert place({"ids": np.zeros((1, 8))}, variable, keyed_by_names=False).key == 8
    assert place({"ids": np.zeros((1, 1))}, variable, keyed_by_names=False).key == 1
    assert place({"x": np.zeros((1, 3))}, variable, keyed_by_names=False) == Placement(0, 0, None)


def test_place_groups_by_input_names_when_inputs_are_optional() -> None:
    placed = place({"a": np.zeros((1, 3)), "b": np.zeros(1)}, {"a": (1,)}, keyed_by_names=True)
    assert placed.group == frozenset({"a", "b"})
    assert placed.key == (4, frozenset({"a", "b"})) and placed.length == 3


def selector(**overrides: object) -> OutputSelector:
    settings: dict[str, object] = {
        "config_outputs": ("probs",),
        "output_types": {"probs": "FP32"},
        "known": frozenset({"probs"}),
        "labels": {"probs": ["cat", "dog"]},
        "batched": True,
    }
    settings.update(overrides)
    return OutputSelector(**settings)  # type: ignore[arg-type]


def test_select_defaults_to_the_config_outputs_and_casts_to_their_type() -> None:
    tensors = {"probs": np.array([[0.25, 0.75]], np.float64), "extra": np.zeros(1)}
    (out,) = selector().select(None, tensors)
    assert out.name == "probs" and out.datatype == "FP32" and out.data.dtype == np.float32


def test_select_without_config_outputs_returns_every_public_tensor() -> None:
    tensors: Tensors = {
        "a": np.zeros(1, np.int32),
        NUM_TOKENS: np.zeros(1),
        "b": np.zeros(1, np.int8),
    }
    outs = selector(config_outputs=(), output_types={}, known=None).select(None, tensors)
    assert [(o.name, o.datatype) for o in outs] == [("a", "INT32"), ("b", "INT8")]


def test_select_classifies_with_labels_when_asked() -> None:
    tensors = {"probs": np.array([[0.25, 0.75]], np.float32)}
    (out,) = selector().select([RequestedOutput("probs", classification=1)], tensors)
    assert out.datatype == "BYTES" and out.data.tolist() == [[b"0.750000:1:dog"]]


def test_select_never_casts_bytes() -> None:
    tensors = {"probs": np.array([b"x"], dtype=object)}
    (out,) = selector().select(None, tensors)
    assert out.datatype == "BYTES"


def test_a_missing_output_is_the_model_fault_when_known_else_the_request() -> None:
    with pytest.raises(BackendError, match="produced no output 'probs'"):
        selector().select(None, {})
    with pytest.raises(InvalidRequestError, match="unknown output 'nope'"):
        selector().select([RequestedOutput("nope")], {})


def test_backend_and_step_errors_keep_400s_and_wrap_the_rest() -> None:
    bad = InvalidRequestError("bad", param="x")
    assert backend_error(bad) is bad and step_error("preprocess", bad) is bad
    wrapped = backend_error(ValueError("boom"))
    assert isinstance(wrapped, BackendError) and isinstance(wrapped.__cause__, ValueError)
    assert "ValueError: boom" in str(wrapped)
    other = backend_error(ModelNotReadyError("gone"))
    assert isinstance(other, BackendError) and str(other) == "gone"
    stepped = step_error("postprocess", KeyError("k"))
    assert isinstance(stepped, BackendError) and str(stepped).startswith("postprocess failed")
