"""Tiny random-init models and brute-force references shared by the tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 61


def gpt2(tied: bool = True, **kw):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2, **kw)
    return GPT2LMHeadModel(cfg).float()


def llama(tied: bool = False, **kw):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=tied, **kw)
    return LlamaForCausalLM(cfg).float()


def bert_classifier(num_labels: int = 3):
    from transformers import BertConfig, BertForSequenceClassification

    cfg = BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=64, hidden_dropout_prob=0.0,
                     attention_probs_dropout_prob=0.0, num_labels=num_labels, pad_token_id=0)
    return BertForSequenceClassification(cfg).float()


class MLP(nn.Module):
    def __init__(self, d_in: int = 7, hidden: int = 12, classes: int = 4):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(d_in, hidden), nn.LayerNorm(hidden), nn.Tanh(),
                                 nn.Linear(hidden, hidden), nn.RMSNorm(hidden), nn.ReLU(), nn.Linear(hidden, classes))

    def forward(self, x):
        return self.net(x)


class ConvNet(nn.Module):
    def __init__(self, classes: int = 3):
        super().__init__()
        self.conv1 = nn.Conv2d(2, 4, 3, padding=1)
        self.conv2 = nn.Conv2d(4, 5, 3, stride=2, padding=1, padding_mode="reflect")
        self.conv3 = nn.Conv1d(5, 3, 2, padding="same", dilation=2)
        self.head = nn.Linear(3 * 16, classes)

    def forward(self, x):
        h = torch.relu(self.conv1(x))
        h = torch.relu(self.conv2(h))  # [B, 5, 4, 4]
        h = self.conv3(h.flatten(2))  # [B, 3, 16]
        return self.head(h.flatten(1))


def lm_example_loss(logits: torch.Tensor, labels: torch.Tensor, mean: bool = False) -> torch.Tensor:
    """Per-row causal LM loss (sum over target tokens, or their mean): ``[B]``."""
    shift_logits = logits[:, :-1].float()
    shift_labels = labels[:, 1:]
    tok = F.cross_entropy(shift_logits.transpose(1, 2), shift_labels, ignore_index=-100, reduction="none")
    total = tok.sum(1)
    if mean:
        total = total / (shift_labels != -100).sum(1).clamp(min=1)
    return total


def trainable(model: nn.Module) -> dict[str, nn.Parameter]:
    return {n: p for n, p in model.named_parameters() if p.requires_grad}


def reference_grads(model: nn.Module, examples: list, loss_fn) -> dict[str, torch.Tensor]:
    """Brute force: one backward pass per example; ``{name: [E, *shape]}``."""
    params = trainable(model)
    out = {n: [] for n in params}
    for example in examples:
        model.zero_grad(set_to_none=True)
        loss_fn(model, example).backward()
        for n, p in params.items():
            out[n].append(p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
    model.zero_grad(set_to_none=True)
    return {n: torch.stack(v) for n, v in out.items()}


def assert_grads_close(got: dict, ref: dict, rtol: float = 1e-4, atol: float = 1e-6, names=None) -> None:
    names = names if names is not None else ref.keys()
    missing = [n for n in names if n not in got]
    assert not missing, f"not captured: {missing}"
    for n in names:
        g, r = got[n].float(), ref[n].float()
        assert g.shape == r.shape, f"{n}: shape {tuple(g.shape)} != {tuple(r.shape)}"
        scale = r.abs().max().clamp(min=1e-12)
        err = (g - r).abs().max()
        assert err <= atol + rtol * scale, f"{n}: max abs err {err:.3e} (ref max {scale:.3e})"
