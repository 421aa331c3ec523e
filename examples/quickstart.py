"""Quick start of the Python API on the model `make demo` leaves in gradtrace-demo/.

    make demo && .venv/bin/python examples/quickstart.py
"""

import json

from transformers import AutoModelForCausalLM, AutoTokenizer

import gradtrace
from gradtrace.options import CaptureOptions, StoreOptions

model = AutoModelForCausalLM.from_pretrained("gradtrace-demo/model")
tokenizer = AutoTokenizer.from_pretrained("gradtrace-demo/model")
with open("gradtrace-demo/train.jsonl") as f:
    docs = [json.loads(line) for line in f]


def batches(rows, size=16):
    for i in range(0, len(rows), size):
        chunk = rows[i:i + size]
        enc = tokenizer([r["text"] for r in chunk], padding=True, truncation=True, max_length=96,
                        return_tensors="pt")
        yield {"id": [r["id"] for r in chunk], **enc}


logra = gradtrace.LoGra(rank=64)  # project at capture time: 42k numbers per example here
train = gradtrace.collect(model, batches(docs), store="runs/api-train", options=CaptureOptions(projection=logra),
                          store_options=StoreOptions(overwrite=True))
print(train)

question = [{"id": "q-gulls", "text": "What did Orsolya Vantrell count at the lighthouse?"}]
queries = gradtrace.collect(model, batches(question), options=CaptureOptions(projection=logra))
scores = gradtrace.Attributor("grad_cos", train).score(queries, topk=5)

top = scores.topk(3)
for rank, (train_id, value) in enumerate(zip(top.ids[0], top.values[0].tolist()), start=1):
    text = next(d["text"] for d in docs if d["id"] == train_id)
    print(f"{rank}. {value:+.3f}  {train_id:<28} {text[:60]}")
scores.save("runs/api-scores", overwrite=True)  # a re-run replaces its own scores
