"""A tiny deterministic GPT-2 Trainer set-up shared by the Hugging Face tests (no downloads)."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import glob  # noqa: E402

import torch  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402


class TokenData(torch.utils.data.Dataset):
    """Fixed random token sequences: sample i is the same in every process and run."""

    def __init__(self, n: int = 64, length: int = 16, vocab: int = 96) -> None:
        self.n, self.length, self.vocab = n, length, vocab

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        ids = torch.randint(0, self.vocab, (self.length,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def tiny_model(seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=2,
                        bos_token_id=0, eos_token_id=0, resid_pdrop=0.1, embd_pdrop=0.1, attn_pdrop=0.1)
    return GPT2LMHeadModel(config)


def tiny_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                        bos_token_id=0, eos_token_id=0, pad_token_id=0))


class BatchNormModel(torch.nn.Module):
    """Token ids to a class of the first token, through a BatchNorm: a Trainer model (no
    ``PreTrainedModel``) whose forward moves buffers (the running statistics)."""

    def __init__(self, vocab: int = 96, width: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(vocab, width)
        self.norm = torch.nn.BatchNorm1d(width)
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> dict:
        logits = self.head(self.norm(self.embed(input_ids).mean(1)))
        return {"loss": torch.nn.functional.cross_entropy(logits, labels[:, 0]), "logits": logits}


def make_trainer(output_dir: str, callbacks=(), *, model=None, **overrides) -> Trainer:
    options = dict(max_steps=7, save_steps=3, logging_steps=2, per_device_train_batch_size=4, learning_rate=1e-3,
                   report_to=[], seed=1, use_cpu=True, disable_tqdm=True, save_total_limit=None)
    options.update(overrides)
    if options.pop("llama", False):
        model = tiny_llama()
    args = TrainingArguments(output_dir, **options)
    return Trainer(model=model if model is not None else tiny_model(), args=args, train_dataset=TokenData(),
                   eval_dataset=TokenData(16), callbacks=list(callbacks))


def shm_left(output_dir: str) -> list[str]:
    """Shared-memory objects the callback's engine for ``output_dir`` left on this node."""
    from flashckpt._names import default_job_id, job_prefix

    prefix = job_prefix(default_job_id(os.path.join(str(output_dir), ".flashckpt")))
    return [p for p in glob.glob(prefix + ".*") if not p.endswith((".sock", ".saver.lock"))]
