"""Attention inside the documents of a packed window (`set_document_mask`, the trainer's --doc-mask).

Three shapes of the same mask, one per kernel (`document_attention_mask`):
- FlexAttention's BlockMask ("flex"): one entry per 128 x 128 block, so the kernel skips the
  blocks that cross documents. Built from the documents' block ranges, so nothing of size
  seq x seq exists at any point (`create_block_mask` would build the dense mask first).
- where each document starts ("sdpa"): each document runs alone through SDPA's causal kernel.
- a dense (batch, 1, seq, seq) boolean ("explicit", which holds seq x seq scores anyway).

On a CPU (no FlexAttention backward there) SDPA per document was as fast as or faster than the
dense mask under SDPA or the explicit kernel at every length measured (docs/bench_attention.md):
the dense mask stays only for the explicit kernel asked for by name.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

BLOCK = 128  # FlexAttention's default block, on CPUs and GPUs


def document_positions(
    input_ids: torch.Tensor, separator: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(document index, position within its document) of every token of packed windows (batch, seq)
    in which `separator` (the data's EOS) ends each document. The separator belongs to the document
    it ends; the token after it starts the next one at position 0.
    E.g. ids [a, b, EOS, c, EOS, d] -> documents [0, 0, 0, 1, 1, 2], positions [0, 1, 2, 0, 1, 0]."""
    ends = input_ids == separator
    docs = ends.cumsum(-1) - ends.long()
    index = torch.arange(input_ids.shape[-1], device=input_ids.device).expand_as(input_ids)
    # Where each token's document starts: one past the last separator before it (0 for none).
    after_end = F.pad(torch.where(ends, index + 1, 0)[..., :-1], (1, 0))
    return docs, index - after_end.cummax(-1).values


def document_mask(docs: torch.Tensor) -> torch.Tensor:
    """Boolean (batch, 1, seq, seq) mask, True = attend: causal, and within the query's document."""
    t = docs.shape[-1]
    causal = torch.ones(t, t, dtype=torch.bool, device=docs.device).tril_()
    return (docs[:, :, None] == docs[:, None, :]).unsqueeze(1) & causal


def _ordered(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(count, indices) per row of a (batch, n, n) block map, as BlockMask stores them: the
    kept blocks' columns first, ascending, then the rest."""
    counts = blocks.sum(-1, dtype=torch.int32)
    indices = torch.argsort((~blocks).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return counts[:, None], indices[:, None]


def document_block_mask(docs: torch.Tensor) -> BlockMask:
    """FlexAttention's mask for documents (batch, seq) as `document_positions` numbers them:
    causal, and within the query's document. Documents only grow along a window, so a pair of
    blocks needs looking at only where the keys' last document reaches the queries' first, and is
    whole (no per-token mask inside it) where both blocks lie in one document below the diagonal.
    Memory: (seq / 128)^2 per window, not seq^2."""
    b, t = docs.shape
    n = -(-t // BLOCK)
    # Padded to whole blocks with the last document, so the mask reads in bounds everywhere.
    padded = torch.cat([docs, docs[:, -1:].expand(b, n * BLOCK - t)], dim=1)
    first, last = padded[:, ::BLOCK], padded[:, BLOCK - 1 :: BLOCK]  # (batch, n) each
    q_first, q_last = first[:, :, None], last[:, :, None]
    k_first, k_last = first[:, None, :], last[:, None, :]
    lower = torch.ones(n, n, dtype=torch.bool, device=docs.device).tril_()
    below = torch.ones(n, n, dtype=torch.bool, device=docs.device).tril_(-1)
    touched = lower & (k_last >= q_first)
    whole = below & (k_first == q_last)
    partial = touched & ~whole

    def same_document(batch, head, q, kv):
        return (kv <= q) & (padded[batch, q] == padded[batch, kv])

    return BlockMask.from_kv_blocks(
        *_ordered(partial),
        *_ordered(whole),
        BLOCK_SIZE=BLOCK,
        mask_mod=same_document,
        seq_lengths=(t, t),
    )


class DocumentStarts(NamedTuple):
    """(batch, seq) booleans, True where a document starts: SDPA runs each document alone."""

    starts: torch.Tensor


@torch.compiler.disable  # a loop over this batch's documents: one graph per batch otherwise
def per_document_attention(q, k, v, starts: torch.Tensor) -> torch.Tensor:
    """Causal SDPA over each document of each window alone, q (b, heads, t, d), k and v
    (b, kv_heads, t, d); `starts` (b, t) marks where documents start. No (t, t) mask: each
    document takes SDPA's fused causal kernel."""
    t, gqa = q.shape[2], k.shape[1] != q.shape[1]
    rows = []
    for row in range(q.shape[0]):
        edges = starts[row].nonzero().flatten().tolist() + [t]  # starts[row, 0] is always set
        rows.append(
            torch.cat(
                [
                    F.scaled_dot_product_attention(
                        q[row : row + 1, :, a:b],
                        k[row : row + 1, :, a:b],
                        v[row : row + 1, :, a:b],
                        is_causal=b - a > 1,
                        enable_gqa=gqa,
                    )
                    for a, b in zip(edges, edges[1:])
                ],
                dim=2,
            )
        )
    return torch.cat(rows)


def document_attention_mask(docs: torch.Tensor, positions: torch.Tensor, kernel: str):
    """The document mask in the shape `kernel` takes (see the module's docstring), from
    `document_positions`' documents and positions (batch, seq): a BlockMask, DocumentStarts
    or a dense boolean."""
    if kernel == "flex":
        compiled_flex()  # before the blocks run (see _FLEX)
        return document_block_mask(docs)
    if kernel == "explicit":
        return document_mask(docs)
    return DocumentStarts(positions == 0)


# Uncompiled, flex_attention is a reference that builds every score. Compiled once a process, on
# the first block mask (built in the model's forward, before any block runs): a module global so
# that compiled blocks inline it, and not at import, which would cost every process that never
# packs (torch.compile loads Inductor).
_FLEX = None


def compiled_flex():
    global _FLEX
    if _FLEX is None:
        _FLEX = torch.compile(flex_attention, dynamic=False)
    return _FLEX


def flex_document_attention(q, k, v, block_mask: BlockMask) -> torch.Tensor:
    """FlexAttention of q (b, heads, t, d) over k, v (b, kv_heads, t, d) under `block_mask`.
    Backward needs a GPU: torch's FlexAttention has none on CPUs."""
    return compiled_flex()(q, k, v, block_mask=block_mask, enable_gqa=k.shape[1] != q.shape[1])
