"""``reference``: eq. (4) literally - a loop over heads in float64. The oracle of every test.

    head_i = softmax(mask(Q^i K^iT / sqrt(d_k))) V^i            (docs/equations.md, eq. (4))

Attention sinks (OpenAI 2025, gpt-oss model card) are written literally: head i's logit ``sink_i`` is
appended to every row of its scores as one more column, the softmax runs over the widened row, and the
sink's column is dropped before P V (it takes probability mass, it has no value).

Slow and memory-hungry on purpose: it is the readable definition, never picked by ``auto``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..core.numerics import acc_dtype
from ..core.problem import AttentionOutput, Problem
from .dense import check_score_size, modify_scores, safe_softmax


class ReferenceBackend:
    name = "reference"
    summary = "textbook per-head loop of eq. (4) in float64 (the test oracle)"

    def why_not(self, p: Problem) -> str | None:
        return "the float64 per-head oracle is for tests; ask for it with backend='reference'"

    def run(self, p: Problem) -> AttentionOutput:
        check_score_size(p, self.name, torch.float64)
        q, k, v = (t.to(torch.float64) for t in (p.q, p.k, p.v))
        heads, weights, lses = [], [], []
        for i in range(p.Hq):
            j = i // p.G  # the kv head that query head i reads (GQA grouping)
            s = torch.matmul(q[:, i], k[:, j].transpose(-1, -2)) * p.scale  # (B, Nq, Nk)
            heads.append(s)
        s = torch.stack(heads, dim=1)  # (B, Hq, Nq, Nk)
        s = modify_scores(s, p)
        if p.sinks is None:
            w, lse = safe_softmax(s)
        else:
            sink = p.sinks.to(torch.float64).view(1, p.Hq, 1, 1).expand(p.B, p.Hq, p.Nq, 1)  # (B, Hq, Nq, 1)
            w_ext, lse = safe_softmax(torch.cat([s, sink], dim=-1))  # (B, Hq, Nq, Nk + 1): the sink column
            w = w_ext[..., :-1]  # (B, Hq, Nq, Nk): the sink's column dropped
        if p.dropout_p > 0.0:
            w = F.dropout(w, p=p.dropout_p)
        for i in range(p.Hq):
            weights.append(torch.matmul(w[:, i], v[:, i // p.G]))  # (B, Nq, Dv)
            lses.append(lse[:, i])
        out = torch.stack(weights, dim=1)  # (B, Hq, Nq, Dv)
        lse_out = lse.to(acc_dtype(p.dtype))
        return AttentionOutput(
            out.to(p.dtype),
            w.to(p.dtype) if p.return_weights else None,
            lse_out if p.return_lse else None,
        )


BACKEND = ReferenceBackend()
