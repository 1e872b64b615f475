"""Handout §8.1 as a learner writes it: attention with named axes (einsum), an additive mask.

Test data for tests/handout/test_grade.py: only an attention function, so the other kinds are skipped.
"""

import math

import torch


def attention(q, k, v, mask=None):
    """q, k: (..., T, d_k); v: (..., T, d_v); mask: additive, 0 where a key may be seen, -inf where hidden."""
    scores = torch.einsum("...id,...jd->...ij", q, k) / math.sqrt(q.size(-1))  # (..., Tq, Tk)
    if mask is not None:
        scores = scores + mask
    weights = torch.softmax(scores, dim=-1)  # over the keys
    return torch.einsum("...ij,...je->...ie", weights, v)  # (..., Tq, d_v)
