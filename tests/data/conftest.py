"""Fixtures of the data-layer tests: a local BPE tokenizer with chat templates (no downloads), a tiny GPT-2
over its vocabulary, and small prompt/completion and conversation datasets."""

from __future__ import annotations

import pytest
import torch

SPECIALS = ["<pad>", "<eos>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]

_TURNS = ("{% for m in messages %}{{ '<|' + m['role'] + '|>' }}"
          "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|end|>{% endgeneration %}"
          "{% else %}{{ m['content'] }}<|end|>{% endif %}{% endfor %}"
          "{% if add_generation_prompt %}<|assistant|>{% endif %}")
TEMPLATES = {
    "generation": _TURNS,  # {% generation %} markers around the assistant's text and end-of-turn token
    "plain": _TURNS.replace("{% generation %}", "").replace("{% endgeneration %}", ""),  # no markers: render-and-diff
    # a default system prompt is inserted when the conversation has none
    "system": ("{% if messages[0]['role'] != 'system' %}<|system|>You are a helpful bot.<|end|>{% endif %}"
               + _TURNS.replace("{% generation %}", "").replace("{% endgeneration %}", "")),
}

CORPUS = ["what is the capital of france", "the capital of france is paris", "hello there how are you",
          "i am fine thanks and you", "count to three one two three", "name a colour a deep blue",
          "you are a helpful bot", "where is the sea at home by the sea", "why is the sky blue because it rains"]

PAIRS = [("what is the capital of france?", " paris"), ("hello there, how are you?", " i am fine thanks"),
         ("count to three:", " one two three"), ("name a colour:", " a deep blue"),
         ("where is the sea?", " by the sea"), ("why is the sky blue?", " because it rains and rains")]

CONVERSATIONS = [
    [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": "i am fine thanks"}],
    [{"role": "system", "content": "you are a helpful bot"}, {"role": "user", "content": "count to three"},
     {"role": "assistant", "content": "one two three"}, {"role": "user", "content": "why is the sky blue"},
     {"role": "assistant", "content": "because it rains"}],
    [{"role": "user", "content": "name a colour"}, {"role": "assistant", "content": "a deep blue"},
     {"role": "user", "content": "where is the sea"}, {"role": "assistant", "content": "at home by the sea"}],
]


def make_tokenizer(template: str | None = "generation"):
    """A byte-level BPE over :data:`CORPUS` with role tokens as special tokens, and a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer)
    out = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                  additional_special_tokens=SPECIALS[2:])
    out.chat_template = TEMPLATES[template] if template else None
    return out


@pytest.fixture(scope="session")
def tokenizer():
    return make_tokenizer("generation")


def gpt2(vocab: int, seed: int = 0):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=vocab, n_positions=96, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=1, eos_token_id=1)
    return GPT2LMHeadModel(config).float().eval()


@pytest.fixture(scope="session")
def model(tokenizer):
    return gpt2(len(tokenizer))


def pair_records(with_ids: bool = True) -> list[dict]:
    return [({"id": f"p{i}"} if with_ids else {}) | {"prompt": p, "completion": c} for i, (p, c) in enumerate(PAIRS)]


def conversation_records() -> list[dict]:
    return [{"id": f"c{i}", "messages": m} for i, m in enumerate(CONVERSATIONS)]


def sft_store(tmp_path, records: list[dict], tok, **schedule):
    """The store a ``GradtraceCallback`` with content-hash ids (``ids=None``) writes during a TRL ``SFTTrainer`` run
    on ``records`` (completion-only loss, batches of 3; ``schedule``: ``num_train_epochs=`` or ``max_steps=``)."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from gradtrace.integrations.hf import GradtraceCallback

    callback = GradtraceCallback(tmp_path / "store", ids=None)
    args = SFTConfig(str(tmp_path / "out"), per_device_train_batch_size=3, learning_rate=1e-3, report_to=[],
                     use_cpu=True, bf16=False, save_strategy="no", logging_strategy="no", disable_tqdm=True,
                     completion_only_loss=True, seed=0, gradient_checkpointing=False, **schedule)
    SFTTrainer(model=gpt2(len(tok)), args=args, train_dataset=Dataset.from_list(records), processing_class=tok,
               callbacks=[callback]).train()
    return callback.result()
