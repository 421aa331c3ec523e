"""How much memory one capture step holds at its peak, estimated from the model's configuration.

A step of :func:`gradtrace.collect` runs the forward pass of a batch of ``B`` examples of ``T`` tokens (``N = B T``),
keeps what autograd saves for the backward pass, computes the per-example loss from the logits, and backpropagates
to the captured layers, which turn their activations and output gradients into one vector per example. Its peak,
beside the weights, is early in the backward pass:

* activations -- what autograd saves: per token and layer about ``10 h + 4.5 i`` values for hidden size ``h`` and
  MLP width ``i`` (``4 h`` when the config names none) -- the inputs of the norms and projections, q/k/v and the
  attention output, the MLP's hidden and activation tensors (autograd's saved tensors of GPT-2 and Llama blocks
  are within 10 % of it) -- plus ``heads T`` attention probabilities per token and layer under eager attention
  (SDPA and flash attention keep none), and ``4 h`` per token outside the blocks. In the model's dtype.
* logits -- ``N V`` float32 values, three times: the logits, their gradient (which overwrites them for float32
  logits) and the head's output gradient as the capture holds it; a 16-bit model's logits add their own copy.
* backward -- the gradients alive while a block's MLP is differentiated: about ``8 i`` values per token.
* rows -- the batch's per-example vectors, ``B x dim`` float32 (each example's whole gradient without a
  projection).

The coefficients of the last three are fitted to measurements, not derived: ``bench/collect_memory.py`` compares
the estimate with the peak resident memory of real steps (GPT-2 shapes, eager and SDPA attention, and a Llama;
float32, CPU: 0.88 to 1.04 times the measured peak), and ``tests/cli/test_cli_polish.py`` checks the command-line
tests' GPT-2 within 25 %. Other architectures, dtypes and devices (a GPU's allocator, fused kernels) are
estimated by the same rule, unmeasured.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["StepMemory", "estimate_step_memory"]

BLOCK_HIDDEN = 10.0
"""Values autograd keeps per token and layer, per hidden unit (norm inputs, q/k/v, attention output, MLP input)."""
BLOCK_INTERMEDIATE = 4.5
"""Values autograd keeps per token and layer, per MLP unit (the MLP's hidden and activation tensors)."""
OUTSIDE_HIDDEN = 4.0
"""Values kept per token outside the blocks, per hidden unit (embeddings, final norm, the head's input)."""
LOGIT_COPIES = 3
"""``N x V`` float32 buffers at the peak: the logits, their gradient, the head's output gradient (fitted)."""
BACKWARD_INTERMEDIATE = 8.0
"""Gradient values alive per token, per MLP unit, while a block is differentiated (fitted)."""


@dataclass(frozen=True)
class StepMemory:
    """The peak memory of one capture step (bytes) beside the weights, at ``batch`` x ``length`` tokens."""

    batch: int
    length: int
    activations: int  # saved for the backward pass, every layer
    logits: int  # the [batch, length, vocab] logits and the gradients of that size
    backward: int  # gradients alive while one block is differentiated
    rows: int  # the batch's per-example vectors (float32)
    weights: int  # the model's parameters (held besides, for the whole run)

    @property
    def total(self) -> int:
        """The step's peak beside the weights."""
        return self.activations + self.logits + self.backward + self.rows


def _config_int(config: Any, *names: str) -> int | None:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def estimate_step_memory(model: Any, batch: int, length: int, dim: int) -> StepMemory | None:
    """The :class:`StepMemory` of capturing ``batch`` examples of ``length`` tokens with ``model`` into vectors of
    ``dim`` values, from its Hugging Face ``config`` (layers, hidden size, MLP width, heads, vocabulary, attention
    implementation) and its parameters' dtype; None for a model without such a config."""
    config = getattr(model, "config", None)
    hidden = _config_int(config, "hidden_size", "n_embd", "d_model")
    layers = _config_int(config, "num_hidden_layers", "n_layer", "num_layers")
    vocab = _config_int(config, "vocab_size")
    if hidden is None or layers is None or vocab is None or batch < 1 or length < 1:
        return None
    intermediate = _config_int(config, "intermediate_size", "n_inner", "ffn_dim") or 4 * hidden
    heads = _config_int(config, "num_attention_heads", "n_head") or 1
    params = list(model.parameters())
    itemsize = params[0].element_size() if params else 4
    tokens = batch * length
    per_token = layers * (BLOCK_HIDDEN * hidden + BLOCK_INTERMEDIATE * intermediate) + OUTSIDE_HIDDEN * hidden
    if getattr(config, "_attn_implementation", None) == "eager":
        per_token += layers * heads * length
    logit_bytes = LOGIT_COPIES * 4 + (itemsize if itemsize < 4 else 0)
    return StepMemory(batch=batch, length=length, activations=int(tokens * per_token * itemsize),
                      logits=tokens * vocab * logit_bytes,
                      backward=int(tokens * BACKWARD_INTERMEDIATE * intermediate * itemsize), rows=batch * dim * 4,
                      weights=sum(p.numel() * p.element_size() for p in params))
