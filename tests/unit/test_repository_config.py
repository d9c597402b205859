"""config.yaml parsing: Triton aliases, version policies, and errors that name file and field."""

from __future__ import annotations

from pathlib import Path

import pytest

from inferd.errors import ModelConfigError
from inferd.model_config import ModelRepoConfig, VersionPolicy, load_model_config

FRAUD = """
backend: onnxruntime
max_batch_size: 64
input:
  - {name: features, data_type: TYPE_FP32, dims: [30]}
output:
  - {name: probabilities, data_type: FP32, dims: [2], label_filename: labels.txt}
dynamic_batching:
  max_queue_delay_ms: 2
  preferred_batch_sizes: [16, 32]
"""


def write(tmp_path: Path, text: str, folder: str = "fraud") -> Path:
    model_dir = tmp_path / folder
    model_dir.mkdir()
    (model_dir / "config.yaml").write_text(text)
    return model_dir


def error_of(tmp_path: Path, text: str, folder: str = "fraud") -> str:
    with pytest.raises(ModelConfigError) as info:
        load_model_config(write(tmp_path, text, folder))
    return str(info.value)


def test_valid_file_gets_the_folder_name(tmp_path: Path) -> None:
    config = load_model_config(write(tmp_path, FRAUD))
    assert config.name == "fraud"
    assert config.input[0].data_type == "FP32"
    assert config.input[0].dims == (30,)
    assert config.output[0].label_filename == "labels.txt"
    assert config.dynamic_batching is not None
    assert config.dynamic_batching.preferred_batch_sizes == (16, 32)
    assert config.batch_delay_s == pytest.approx(0.002)


def test_triton_spellings_are_accepted() -> None:
    config = ModelRepoConfig.model_validate(
        {
            "platform": "onnxruntime_onnx",
            "max_batch_size": 8,
            "input": [{"name": "text", "data_type": "TYPE_STRING", "dims": [1]}],
            "dynamic_batching": {
                "max_queue_delay_microseconds": 500,
                "preferred_batch_size": [4],
                "default_queue_policy": {"default_timeout_microseconds": 2000},
            },
            "instance_group": [{"count": 2, "kind": "KIND_CPU"}, {"count": 1}],
            "parameters": {"intra_op_threads": {"string_value": "3"}, "x": {"string_value": "y"}},
        }
    )
    assert config.backend == "onnxruntime"
    assert config.input[0].data_type == "BYTES"
    assert config.dynamic_batching is not None
    assert config.dynamic_batching.max_queue_delay_ms == pytest.approx(0.5)
    assert config.dynamic_batching.default_queue_policy.default_timeout_ms == pytest.approx(2.0)
    assert config.instance_count == 3
    assert config.int_parameter("intra_op_threads") == 3
    assert config.parameters["x"] == "y"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            FRAUD.replace("max_queue_delay_ms: 2", "max_queue_delay_ms: -1"),
            "fraud/config.yaml: dynamic_batching.max_queue_delay_ms: "
            "Input should be greater than or equal to 0",
        ),
        (FRAUD + "dynamic_batchin: {}\n", "fraud/config.yaml: dynamic_batchin: Extra inputs"),
        (FRAUD.replace("TYPE_FP32", "TYPE_FP33"), "input[0].data_type: unknown data type"),
        (FRAUD.replace("dims: [30]", "dims: [0]"), "input[0].dims: dims are positive"),
        (FRAUD.replace("onnxruntime", "tensorrt"), "backend: Input should be 'onnxruntime'"),
        (FRAUD + "version_policy: {latest: {num_version: 2}}\n", "version_policy.latest.num_"),
        (FRAUD + "version_policy: {all: {}, latest: {}}\n", "one of latest/all/specific"),
        (FRAUD + "version_policy: {specific: {versions: []}}\n", "specific.versions"),
        (FRAUD.replace("[16, 32]", "[16, 128]"), "[128] exceed max_batch_size 64"),
        (FRAUD + "parameters: {intra_op_threads: two}\n", "intra_op_threads must be a positive"),
        (FRAUD + "parameters: {inter_op_threads: 0}\n", "inter_op_threads must be a positive"),
        (FRAUD + "name: other\n", "name: 'other' must equal the folder name 'fraud'"),
        ("backend: [onnxruntime\n", "fraud/config.yaml: line 2, column 1: invalid YAML"),
        ("", "fraud/config.yaml: the file is empty"),
        ("- backend\n", "expected a mapping"),
        ("max_batch_size: 1\n", "fraud/config.yaml: backend: Field required"),
    ],
)
def test_errors_name_the_file_and_field(tmp_path: Path, text: str, expected: str) -> None:
    assert expected in error_of(tmp_path, text)


def test_every_problem_is_reported(tmp_path: Path) -> None:
    text = FRAUD.replace("TYPE_FP32", "BAD").replace("max_batch_size: 64", "max_batch_size: -2")
    message = error_of(tmp_path, text)
    assert "input[0].data_type" in message
    assert "max_batch_size" in message


@pytest.mark.parametrize(
    ("policy", "available", "expected"),
    [
        ({}, [1, 3, 2], [3]),
        ({"latest": {"num_versions": 2}}, [1, 3, 2], [2, 3]),
        ({"latest": {"num_versions": 5}}, [2, 1], [1, 2]),
        ({"all": {}}, [3, 1], [1, 3]),
        ({"specific": {"versions": [1, 3, 7]}}, [1, 2, 3], [1, 3]),
        ({}, [], []),
    ],
)
def test_version_policy_selects(
    policy: dict[str, object], available: list[int], expected: list[int]
) -> None:
    assert VersionPolicy.model_validate(policy).select(available) == expected


def test_version_policy_triton_json() -> None:
    assert VersionPolicy().triton_json() == {"latest": {"num_versions": 1}}
    assert VersionPolicy.model_validate({"all": {}}).triton_json() == {"all": {}}
    specific = VersionPolicy.model_validate({"specific": {"versions": [2]}})
    assert specific.triton_json() == {"specific": {"versions": [2]}}
