"""What every example model builder shares: the seed, config.yaml and label-file writers,
and the quiet wrapper around the ONNX exporters."""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from inferd.model_config import ModelRepoConfig

SEED = 0


def write_config(model_dir: Path, config: dict[str, Any], header: str) -> None:
    """config.yaml with a comment header, checked against the schema before it is written."""
    ModelRepoConfig.model_validate(config)
    body = yaml.safe_dump(config, sort_keys=False, allow_unicode=True, default_flow_style=None)
    comments = "".join(f"# {line}\n".replace("# \n", "#\n") for line in header.splitlines())
    (model_dir / "config.yaml").write_text(comments + body, encoding="utf-8")


def write_labels(path: Path, labels: tuple[str, ...]) -> None:
    path.write_text("".join(f"{label}\n" for label in labels), encoding="utf-8")


def name_dims(proto: Any, names: dict[int, str]) -> None:
    # The exporter names symbolic dims s0, s1...; readable names show in metadata tools.
    for value in [*proto.graph.input, *proto.graph.output]:
        for i, dim in enumerate(value.type.tensor_type.shape.dim):
            if dim.dim_param and i in names:
                dim.dim_param = names[i]


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    # The exporter prints progress lines and warns about optional torchvision ops.
    exporter_log = logging.getLogger("torch.onnx")
    level = exporter_log.level
    exporter_log.setLevel(logging.ERROR)
    try:
        with (
            warnings.catch_warnings(),
            contextlib.redirect_stdout(io.StringIO()),
            contextlib.redirect_stderr(io.StringIO()),
        ):
            warnings.simplefilter("ignore")
            yield
    finally:
        exporter_log.setLevel(level)
