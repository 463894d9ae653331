"""The regression Trainer of transformers' own Trainer tests (``tests/trainer/trainer_test_utils.py``),
rebuilt here: a two-parameter model ``y = a * x + b`` as a ``PreTrainedModel`` or a bare
``nn.Module``, its data set, and a Trainer builder that adds ``FlashCheckpointCallback`` when
asked, so every scenario runs once stock and once with the callback."""

import dataclasses
import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import safetensors.torch  # noqa: E402
import torch  # noqa: E402
from torch import nn  # noqa: E402
from transformers import PreTrainedConfig, PreTrainedModel, Trainer, TrainingArguments  # noqa: E402

from flashckpt.hf import FlashCheckpointCallback  # noqa: E402


class RegressionDataset:
    def __init__(self, a=2, b=3, length=64, seed=42):
        rng = np.random.RandomState(seed)
        self.x = rng.normal(size=(length,)).astype(np.float32)
        self.y = (a * self.x + b + rng.normal(scale=0.1, size=(length,))).astype(np.float32)

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return {"input_x": self.x[i], "labels": self.y[i]}


class RegressionModelConfig(PreTrainedConfig):
    def __init__(self, a=0, b=0, **kwargs):
        super().__init__(**kwargs)
        self.a = a
        self.b = b
        self.hidden_size = 1


class RegressionPreTrainedModel(PreTrainedModel):
    config_class = RegressionModelConfig
    base_model_prefix = "regression"

    def __init__(self, config):
        super().__init__(config)
        self.a = nn.Parameter(torch.as_tensor(config.a).float())
        self.b = nn.Parameter(torch.as_tensor(config.b).float())
        self.post_init()

    def forward(self, input_x, labels=None, **kwargs):
        y = input_x * self.a + self.b
        if labels is None:
            return (y,)
        return (nn.functional.mse_loss(y, labels), y)


class RegressionModel(nn.Module):
    """Not a PreTrainedModel: the Trainer saves its bare state dict."""

    def __init__(self, a=0, b=0):
        super().__init__()
        self.a = nn.Parameter(torch.tensor(a).float())
        self.b = nn.Parameter(torch.tensor(b).float())
        self.config = None

    def forward(self, input_x, labels=None, **kwargs):
        y = input_x * self.a + self.b
        if labels is None:
            return (y,)
        return (nn.functional.mse_loss(y, labels), y)


class AlmostAccuracy:
    def __init__(self, thresh=0.25):
        self.thresh = thresh

    def __call__(self, eval_pred):
        predictions, labels = eval_pred
        return {"accuracy": (np.abs(predictions - labels) <= self.thresh).astype(np.float32).mean().item()}


def regression_trainer(output_dir, *, flash: bool, a=0, b=0, train_len=64, eval_len=64, pretrained=True,
                       compute_metrics=None, callbacks=(), **kwargs) -> Trainer:
    """transformers' ``get_regression_trainer``, with ``FlashCheckpointCallback()`` when ``flash``."""
    model = RegressionPreTrainedModel(RegressionModelConfig(a=a, b=b)) if pretrained else RegressionModel(a, b)
    options = dict(report_to=[], use_cpu=True, disable_tqdm=True)
    options.update(kwargs)
    args = TrainingArguments(output_dir, **options)
    cbs = list(callbacks) + ([FlashCheckpointCallback()] if flash else [])
    trainer = Trainer(model, args, train_dataset=RegressionDataset(length=train_len),
                      eval_dataset=RegressionDataset(length=eval_len), compute_metrics=compute_metrics,
                      callbacks=cbs)
    trainer.model_accepts_loss_kwargs = False  # as upstream: the model's loss takes no num_items_in_batch
    return trainer


def state_of(trainer) -> dict:
    """The trainer state as upstream's ``check_trainer_state_are_the_same`` compares it."""
    state = dataclasses.asdict(trainer.state)
    if state["best_model_checkpoint"]:  # a path inside each run's own output_dir
        state["best_model_checkpoint"] = os.path.basename(state["best_model_checkpoint"])
    logs = state.pop("log_history")
    timings = ("_runtime", "_samples_per_second", "_steps_per_second")  # wall-clock figures differ by run
    state["log_history"] = [{k: v for k, v in log.items() if not k.endswith(timings) and k != "train_loss"
                             and v == v} for log in logs]
    return state


def listing(output_dir) -> list[str]:
    return sorted(os.listdir(output_dir))


def to_sharded(folder) -> None:
    """upstream's ``convert_to_sharded_checkpoint``: one safetensors shard per tensor, plus the index."""
    weights = os.path.join(folder, "model.safetensors")
    state = safetensors.torch.load_file(weights)
    os.remove(weights)
    keys = list(state)
    files = [f"model-{i + 1:05d}-of-{len(keys):05d}.safetensors" for i in range(len(keys))]
    with open(os.path.join(folder, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
        f.write(json.dumps({"metadata": {}, "weight_map": dict(zip(keys, files))}, indent=2, sort_keys=True) + "\n")
    for key, name in zip(keys, files):
        safetensors.torch.save_file({key: state[key]}, os.path.join(folder, name))
