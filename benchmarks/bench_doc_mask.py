"""A small model's step on packed windows (--doc-mask) under each shape of the document mask.

    python benchmarks/bench_doc_mask.py [--seqs 256,512,1024,2048] [--tokens 2048] [--rounds 5]
                                        [--out benchmarks/results/doc_mask_attention.json]

The `small` preset cut to 2 layers, bf16 autocast, one thread, `--tokens` tokens a batch of
documents 16-400 tokens long (seeded). Paths: the dense (b, 1, t, t) mask under the explicit
kernel and under SDPA, SDPA over each document alone, and FlexAttention (compiled; forward only
on a CPU, where torch has no FlexAttention backward). Each path's forward + backward (forward
alone for flex on a CPU), median of `--rounds`, paths alternating round by round.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import time
from pathlib import Path
from unittest import mock

import torch

import models.llama as llama
from benchmarks.host import host_class
from models import ZeroStackForCausalLM, get_config, set_attention_kernel, set_document_mask
from models.documents import DocumentStarts, document_mask

EOS = 2
# name: (kernel, the mask's shape forced on it, or None for the kernel's own)
PATHS = {
    "explicit, dense mask": ("explicit", lambda docs, positions: document_mask(docs)),
    "sdpa, dense mask": ("sdpa", lambda docs, positions: document_mask(docs)),
    "sdpa, per document": ("sdpa", lambda docs, positions: DocumentStarts(positions == 0)),
    "flex": ("flex", None),
}


def packed_batch(batch: int, seq: int, vocab: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (batch, seq), generator=gen)
    for row in ids:
        at = 0
        while (at := at + int(torch.randint(16, 401, (), generator=gen))) < seq:
            row[at - 1] = EOS
    return ids


def step(model, ids, kernel: str, shape, train: bool) -> float:
    set_attention_kernel(model, kernel)
    forced = mock.patch.object(llama, "document_attention_mask", lambda d, p, k: shape(d, p))
    start = time.perf_counter()
    with forced if shape else contextlib.nullcontext():
        with torch.autocast("cpu", dtype=torch.bfloat16), torch.set_grad_enabled(train):
            loss = model(input_ids=ids, labels=ids).loss
        if train:
            loss.backward()
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seqs", default="256,512,1024,2048")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default="benchmarks/results/doc_mask_attention.json")
    args = p.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = get_config("small", num_hidden_layers=2, max_position_embeddings=4096)
    model = ZeroStackForCausalLM(config)
    set_document_mask(model, EOS)
    rows = []
    for seq in map(int, args.seqs.split(",")):
        ids = packed_batch(max(1, args.tokens // seq), seq, model.config.vocab_size)
        times = {name: [] for name in PATHS}
        for name, (kernel, shape) in PATHS.items():  # warm-up: flex compiles here
            start = time.perf_counter()
            step(model, ids, kernel, shape, train=kernel != "flex")
            rows.append(dict(seq=seq, path=name, first_call_ms=(time.perf_counter() - start) * 1e3))
        for _ in range(args.rounds):
            for name, (kernel, shape) in PATHS.items():
                times[name].append(step(model, ids, kernel, shape, train=kernel != "flex"))
                model.zero_grad(set_to_none=True)
        # forward alone too, for every path, so flex (forward only here) has its peers
        fwd = {name: [] for name in PATHS}
        for _ in range(args.rounds):
            for name, (kernel, shape) in PATHS.items():
                fwd[name].append(step(model, ids, kernel, shape, train=False))
        for name, (kernel, _) in PATHS.items():
            row = dict(seq=seq, batch=ids.shape[0], path=name)
            row["documents"] = int((ids == EOS).sum()) + ids.shape[0]
            row["forward_ms"] = statistics.median(fwd[name])
            row["forward_backward_ms"] = (
                None if kernel == "flex" else statistics.median(times[name])
            )
            rows.append(row)
            print(json.dumps(row), flush=True)
    from benchmarks.provenance import today

    result = dict(
        date=today(),
        host=host_class(),
        torch=torch.__version__,
        threads=1,
        model="small, 2 layers, bf16 autocast",
        rounds=args.rounds,
        rows=[r for r in rows if "forward_ms" in r],
        first_calls=[r for r in rows if "first_call_ms" in r],
    )
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
