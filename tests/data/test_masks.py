"""Loss masks that match training: completion-only, assistant-only (with and without ``{% generation %}``
markers, with a system prompt), EOS on completions, left truncation of the prompt -- against masks computed by
hand and against the labels TRL's ``SFTTrainer`` builds for the same examples."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

import gradtrace.data as gd
from gradtrace.options.data import ReadOptions
from tests.data.conftest import CONVERSATIONS, PAIRS, conversation_records, make_tokenizer, pair_records


def _encode(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def _hand_conversation(tok, messages, system: str | None = None) -> tuple[list[int], list[bool]]:
    """The template's rendering built token by token: ``<|role|> content <|end|>``; the assistant's content and
    its ``<|end|>`` are in the loss."""
    special = {name: tok.convert_tokens_to_ids(name) for name in ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>")}
    if system is not None:
        messages = [{"role": "system", "content": system}, *messages]
    ids: list[int] = []
    mask: list[bool] = []
    for m in messages:
        content = [*_encode(tok, m["content"]), special["<|end|>"]]
        ids += [special[f"<|{m['role']}|>"], *content]
        mask += [False] + [m["role"] == "assistant"] * len(content)
    return ids, mask


@pytest.mark.parametrize("template", ["generation", "plain", "system"])
def test_assistant_mask_equals_hand_computed(template):
    tok = make_tokenizer(template)
    data = gd.load(conversation_records(), tok)
    assert data.summary.format == "messages" and data.summary.loss_on == "assistant"
    for i, messages in enumerate(CONVERSATIONS):
        has_system = messages[0]["role"] == "system"
        want_ids, want_mask = _hand_conversation(
            tok, messages, "You are a helpful bot." if template == "system" and not has_system else None)
        ids, mask = data.example(i)
        assert ids.tolist() == want_ids
        assert mask.tolist() == want_mask
    # --loss-on all: every token
    everything = gd.load(conversation_records(), tok, read_options=ReadOptions(loss_on="all"))
    assert all(everything.example(i)[1].all() for i in range(len(CONVERSATIONS)))


def test_prompt_completion_mask_and_eos(tokenizer):
    data = gd.load(pair_records(), tokenizer)
    assert data.summary.format == "prompt-completion" and data.summary.loss_on == "completion"
    for i, (prompt, completion) in enumerate(PAIRS):
        prompt_ids = _encode(tokenizer, prompt)
        full = [*_encode(tokenizer, prompt + completion), tokenizer.eos_token_id]  # EOS appended to the completion
        ids, mask = data.example(i)
        assert ids.tolist() == full
        assert full[:len(prompt_ids)] == prompt_ids  # these prompts end on a token boundary
        assert mask.tolist() == [False] * len(prompt_ids) + [True] * (len(full) - len(prompt_ids))
    batch = next(iter(data))
    labels, input_ids = batch["labels"], batch["input_ids"]
    assert ((labels == -100) | (labels == input_ids)).all()
    assert (labels[batch["attention_mask"] == 0] == -100).all()
    # a completion that already ends with EOS gets no second one
    again = gd.load([{"prompt": "hi", "completion": " paris<eos>"}], tokenizer)
    assert again.example(0)[0].tolist()[-2:] != [tokenizer.eos_token_id] * 2
    everything = gd.load(pair_records(), tokenizer, read_options=ReadOptions(loss_on="all"))
    assert everything.example(0)[1].all() and "labels" not in next(iter(everything))


def _trl_labels(tok, records, assistant_only: bool, tmp_path) -> list[tuple[list[int], list[int]]]:
    """``(input_ids, labels)`` of each record as TRL's ``SFTTrainer`` prepares them (its own code, no model)."""
    pytest.importorskip("trl")
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    args = SFTConfig(str(tmp_path / "trl"), max_length=None, assistant_only_loss=assistant_only, report_to=[],
                     use_cpu=True, bf16=False, dataset_num_proc=None)
    trainer = SimpleNamespace(_tokenizer=tok, chat_template=None, completion_only_loss=True)
    prepared = SFTTrainer._prepare_dataset(trainer, Dataset.from_list(records), tok, args, False, None, "train")
    return [(row["input_ids"], row["labels"]) for row in prepared]


def _our_labels(data) -> list[tuple[list[int], list[int]]]:
    out = []
    for i in range(data.num_examples):
        ids, mask = data.example(i)
        out.append((ids.tolist(), np.where(mask, ids, -100).tolist()))
    return out


@pytest.mark.parametrize("kind", ["prompt-completion", "conversational-prompt-completion", "messages"])
def test_labels_equal_trl(kind, tokenizer, tmp_path):
    if kind == "prompt-completion":
        records = [{"prompt": p, "completion": c} for p, c in PAIRS]
    elif kind == "messages":
        records = [{"messages": m} for m in CONVERSATIONS]
    else:  # prompt: the conversation up to its last assistant turn; completion: that turn
        records = [{"prompt": m[:-1], "completion": m[-1:]} for m in CONVERSATIONS]
    ours = _our_labels(gd.load(records, tokenizer))
    theirs = _trl_labels(tokenizer, records, assistant_only=kind == "messages", tmp_path=tmp_path)
    assert ours == theirs


def test_truncation_cuts_the_prompt_from_the_left(tokenizer):
    records = pair_records()
    full = gd.load(records, tokenizer)
    ids0, mask0 = full.example(0)
    prompt_len = int(np.argmax(mask0))
    completion_len = len(ids0) - prompt_len
    limit = completion_len + 2
    cut = gd.load(records[:1], tokenizer, read_options=ReadOptions(max_length=limit))
    ids, mask = cut.example(0)
    assert ids.tolist() == ids0[-limit:].tolist() and mask.tolist() == mask0[-limit:].tolist()
    assert cut.summary.prompt_truncated == 1 and "1 truncated (prompt cut from the left)" in cut.summary.line()
    # one token of context is kept before the completion: its first token stays a target
    tight = gd.load(records[:1], tokenizer, read_options=ReadOptions(max_length=completion_len + 1))
    ids, mask = tight.example(0)
    assert not mask[0] and mask[1:].all() and len(ids) == completion_len + 1


def test_completion_longer_than_max_length_is_reported(tokenizer):
    records = pair_records()
    lengths = [int((~gd.load([r], tokenizer).example(0)[1]).sum()) for r in records]
    completion = [len(gd.load([r], tokenizer).example(0)[0]) - n for r, n in zip(records, lengths)]
    limit = sorted(completion)[2]  # examples whose completion (+1 token of context) exceeds this are too long
    too_long = [r["id"] for r, c in zip(records, completion) if c + 1 > limit]
    with pytest.raises(gd.DataError) as err:
        gd.load(records, tokenizer, read_options=ReadOptions(max_length=limit))
    message = str(err.value)
    assert f"{len(too_long) - 1} more example" in message and "too long" in message and "--truncate" in message
    assert all(repr(i) in message or i in message for i in too_long)
    cut = gd.load(records, tokenizer, read_options=ReadOptions(max_length=limit, truncate=True))
    assert cut.num_examples == len(records) and cut.summary.cut == len(too_long)
    assert int(cut.lengths.max()) <= limit
    assert f"{len(too_long)} cut to --max-length" in cut.summary.line()


def test_summary_counts(tokenizer):
    data = gd.load(pair_records(), tokenizer)
    targets = sum(int(data.example(i)[1][1:].sum()) for i in range(data.num_examples))
    total = int(data.lengths.sum())
    s = data.summary
    assert (s.examples, s.loss_tokens, s.total_tokens, s.prompt_truncated) == (len(PAIRS), targets, total, 0)
    assert s.line().startswith(f"in-memory list: {len(PAIRS)} examples, prompt-completion, loss on completion: "
                               f"{targets} of {total} tokens")
