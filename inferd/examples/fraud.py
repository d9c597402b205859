"""The `fraud` example: a gradient-boosted classifier of generated card transactions
(FRAUD_FEATURES), converted with skl2onnx: features FP32 [8] -> label INT64 [1], probabilities
FP32 [2] (labels.txt: legit, fraud)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from inferd.examples.common import SEED, write_config, write_labels

FRAUD_LABELS = ("legit", "fraud")
FRAUD_FEATURES = (
    ("amount_usd", "transaction amount in US dollars"),
    ("hour", "local hour of day, 0-23"),
    ("merchant_category", "0 grocery, 1 fuel, 2 restaurant, 3 online retail, 4 electronics, "
     "5 travel, 6 jewelry, 7 gaming, 8 pharmacy, 9 other"),
    ("distance_km", "distance from the card holder's home, km"),
    ("txn_last_24h", "transactions on the card in the previous 24 hours"),
    ("amount_vs_avg", "amount / the card's 30-day average amount"),
    ("online", "1 card-not-present (online), 0 in person"),
    ("foreign", "1 merchant in another country than the card's, else 0"),
)  # fmt: skip


def fraud_dataset(n: int, seed: int = SEED) -> tuple[np.ndarray, np.ndarray]:
    """Generated card transactions: x [n, 8] float32 (FRAUD_FEATURES order), y [n] (1 fraud).

    Fraud is likelier for large amounts relative to the card's average, night hours, far from
    home, bursts of transactions, online and foreign merchants, and the electronics, jewelry
    and gaming categories; about 4% of rows are fraud."""
    rng = np.random.default_rng(seed)
    amount = rng.lognormal(3.7, 1.0, n)
    hour = rng.integers(0, 24, n)
    category = rng.integers(0, 10, n)
    distance = rng.exponential(15.0, n)
    velocity = rng.poisson(2.0, n)
    ratio = amount / rng.lognormal(3.7, 0.5, n)
    online = rng.random(n) < 0.35
    foreign = rng.random(n) < 0.08
    risk = (
        0.9 * np.log1p(ratio)
        + 0.9 * ((hour < 6) | (hour >= 23))
        + 0.6 * np.log1p(distance / 50.0)
        + 0.35 * velocity
        + 0.7 * online
        + 1.2 * foreign
        + 0.8 * np.isin(category, (4, 6, 7))
    )
    p = 1.0 / (1.0 + np.exp(-(risk - 4.6) * 3.5))
    y = (rng.random(n) < p).astype(np.int64)
    columns = (amount, hour, category, distance, velocity, ratio, online, foreign)
    return np.stack(columns, axis=1).astype(np.float32), y


def build_fraud(model_dir: Path) -> None:
    from sklearn.ensemble import GradientBoostingClassifier

    version = model_dir / "1"
    version.mkdir(parents=True)
    x, y = fraud_dataset(10_000)
    model = GradientBoostingClassifier(n_estimators=60, max_depth=3, random_state=SEED).fit(x, y)
    _save_sklearn_onnx(model, len(FRAUD_FEATURES), version / "model.onnx")
    write_labels(version / "labels.txt", FRAUD_LABELS)
    features_doc = "\n".join(
        f"  {i}: {name}: {doc}" for i, (name, doc) in enumerate(FRAUD_FEATURES)
    )
    config = {
        "backend": "onnxruntime",
        "default_model_filename": "model.onnx",
        "max_batch_size": 64,
        "input": [{"name": "features", "data_type": "TYPE_FP32", "dims": [len(FRAUD_FEATURES)]}],
        "output": [
            {"name": "label", "data_type": "TYPE_INT64", "dims": [1]},
            {
                "name": "probabilities",
                "data_type": "TYPE_FP32",
                "dims": [len(FRAUD_LABELS)],
                "label_filename": "labels.txt",
            },
        ],
        "dynamic_batching": {"max_queue_delay_ms": 2, "preferred_batch_sizes": [16, 32]},
        "parameters": {"intra_op_threads": 1},
    }
    write_config(
        model_dir,
        config,
        "Card-transaction fraud: scikit-learn GradientBoostingClassifier via skl2onnx,\n"
        "trained on generated data. features FP32 [8], in this order:\n"
        f"{features_doc}\n"
        "label INT64 [1]: 0 legit, 1 fraud; probabilities FP32 [2]: legit, fraud.",
    )


def _save_sklearn_onnx(model: Any, n_features: int, path: Path) -> None:
    import onnx
    from onnx import TensorProto, helper
    from skl2onnx import convert_sklearn
    from skl2onnx.common.data_types import FloatTensorType

    proto = convert_sklearn(
        model,
        initial_types=[("features", FloatTensorType([None, n_features]))],
        options={id(model): {"zipmap": False}},  # probabilities as a tensor, not a map list
    )
    # skl2onnx's label is [N]; Triton-style configs give every output a dim after the batch
    # dim, so reshape it to [N, 1].
    graph = proto.graph
    for node in graph.node:
        node.output[:] = ["label_flat" if o == "label" else o for o in node.output]
    axes = helper.make_tensor("label_axes", TensorProto.INT64, [1], [1])
    graph.initializer.append(axes)
    graph.node.append(helper.make_node("Unsqueeze", ["label_flat", "label_axes"], ["label"]))
    for out in graph.output:
        if out.name == "label":
            out.CopyFrom(helper.make_tensor_value_info("label", TensorProto.INT64, ["N", 1]))
    onnx.checker.check_model(proto)
    onnx.save_model(proto, str(path))
