"""Sample identity (user ids, id lists, content hashes) and packed rows split into documents."""

import pytest
import torch

import gradtrace
from gradtrace.options import CaptureOptions, Loss
from tests import tiny
from tests.capture.test_exact import _lm_batch, _lm_single_loss


def _packed(doc_lengths_per_row):
    docs, rows, pos, labels, doc_ids = [], [], [], [], []
    for lengths in doc_lengths_per_row:
        row_docs = [torch.randint(1, tiny.VOCAB, (n,)) for n in lengths]
        docs += row_docs
        rows.append(torch.cat(row_docs))
        pos.append(torch.cat([torch.arange(n) for n in lengths]))
        lab = torch.cat(row_docs).clone()
        starts = torch.tensor([0, *torch.tensor(lengths).cumsum(0)[:-1].tolist()])
        lab[starts] = -100  # a document's first token is not predicted from the previous document
        labels.append(lab)
        doc_ids.append(torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]))
    return docs, torch.stack(rows), torch.stack(pos), torch.stack(labels), torch.stack(doc_ids)


@pytest.mark.parametrize("mode", ["position_ids", "doc_ids"])
def test_packed_rows_give_one_gradient_per_document(mode):
    model = tiny.llama()
    docs, ids, pos, labels, doc_ids = _packed([[4, 6, 3], [7, 6]])
    ref = tiny.reference_grads(model, docs, _lm_single_loss)
    with gradtrace.capture(model, loss=Loss(reduction="sum"),
                           options=CaptureOptions(packing=mode == "position_ids", verify=True)) as cap:
        if mode == "doc_ids":
            cap.annotate(doc_ids=doc_ids)
        out = model(input_ids=ids, position_ids=pos, use_cache=False)
        tiny.lm_example_loss(out.logits, labels).sum().backward()
    batch = cap.batches[0]
    assert len(batch) == 5
    tiny.assert_grads_close(batch.per_example_grads(), ref)
    # the id of a packed document is the content hash of that document alone
    with gradtrace.capture(model, loss=Loss(reduction="sum")) as solo:
        out = model(input_ids=docs[0][None])
        tiny.lm_example_loss(out.logits, docs[0][None]).sum().backward()
    assert solo.batches[0].ids[0] == batch.ids[0]


def test_packed_token_mean_example_mean():
    model = tiny.llama()
    docs, ids, pos, labels, _ = _packed([[5, 4, 6]])
    ref = tiny.reference_grads(model, docs, lambda m, row: tiny.lm_example_loss(
        m(input_ids=row[None]).logits, row[None], mean=True).sum())
    with gradtrace.capture(model, loss=Loss(reduction="token_mean", example_loss="mean")) as cap:
        model(input_ids=ids, position_ids=pos, labels=labels, use_cache=False).loss.backward()
    batch = cap.batches[0]
    assert torch.equal(batch.num_targets, torch.tensor([4.0, 3.0, 5.0]))
    tiny.assert_grads_close(batch.per_example_grads(), ref)


def test_user_ids_annotate_and_list():
    model = tiny.gpt2()
    _, ids, mask, labels, pos = _lm_batch([3, 5])
    with gradtrace.capture(model, ids=["a", "b", "c", "d"]) as cap:
        for _ in range(2):
            model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    assert [b.ids for b in cap.batches] == [["a", "b"], ["c", "d"]]
    with gradtrace.capture(model) as cap:
        cap.annotate(ids=[10, 11])
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    assert cap.batches[0].ids == ["10", "11"]


def test_id_list_mismatch_is_reported():
    model = tiny.gpt2()
    _, ids, mask, labels, _ = _lm_batch([3, 5])
    with pytest.raises(ValueError, match="ran out"), gradtrace.capture(model, ids=["only-one"]):
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    with pytest.warns(UserWarning, match="were not used"), gradtrace.capture(model, ids=["a", "b", "c"]):
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    with gradtrace.capture(model) as cap, pytest.raises(ValueError, match="3 ids were given for a batch of 2"):
        cap.annotate(ids=[1, 2, 3])
        model(input_ids=ids, attention_mask=mask, labels=labels)


def test_content_hash_ids_keep_duplicates_distinct():
    model = tiny.gpt2()
    row = torch.randint(1, tiny.VOCAB, (6,))
    other = torch.randint(1, tiny.VOCAB, (6,))
    ids = torch.stack([row, other, row])
    with gradtrace.capture(model) as cap:
        model(input_ids=ids, labels=ids).loss.backward()
        model(input_ids=ids[:1], labels=ids[:1]).loss.backward()
    first, second = cap.batches[0].ids, cap.batches[1].ids
    assert first[0] != first[2] and first[2] == f"{first[0]}#1"
    assert len(set(first)) == 3
    assert second[0] == f"{first[0]}#2"
    cap.reset_ids()
