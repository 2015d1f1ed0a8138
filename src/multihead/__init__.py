"""multihead: multi-head attention, every variant, exact and fast, proven against real models.

Quick tour::

    import torch, multihead as mh
    q = torch.randn(2, 8, 128, 64); k = v = torch.randn(2, 2, 128, 64)      # GQA: 8 query, 2 kv heads
    out = mh.attention(q, k, v, mask=mh.causal() & mh.padding([128, 100]))
    print(mh.explain(q, k, v, mask=mh.sliding_window(16)))
"""

from . import startup  # noqa: F401  (first: Ctrl-C while `multihead` starts, see startup.py)

# isort: split
from . import approx, cost, data, eval, heads, parallel, pretrained, serve, variants
from .core.biases import Bias, alibi, alibi_slopes, custom_bias, softcap
from .core.functional import AttentionOutput, attention, backends, explain
from .core.masks import Mask, causal, custom, document, key_padding, padding, prefix_lm, sliding_window
from .core.varlen import varlen_attention
from .models import quant
from .models.lm import LMConfig, TransformerLM
from .models.padding import left_pad
from .nn import compat
from .nn.attention import MultiHeadAttention
from .nn.feed_forward import FeedForward
from .nn.kv_cache import KVCache
from .nn.layers import Decoder, Encoder, TransformerLayer
from .nn.norms import RMSNorm
from .nn.positions import LearnedPositions, RotaryEmbedding, SinusoidalPositions

__version__ = "0.1.0"

__all__ = [
    "AttentionOutput",
    "Bias",
    "Decoder",
    "Encoder",
    "FeedForward",
    "KVCache",
    "LMConfig",
    "LearnedPositions",
    "Mask",
    "MultiHeadAttention",
    "RMSNorm",
    "RotaryEmbedding",
    "SinusoidalPositions",
    "TransformerLM",
    "TransformerLayer",
    "alibi",
    "alibi_slopes",
    "approx",
    "attention",
    "backends",
    "causal",
    "compat",
    "cost",
    "custom",
    "custom_bias",
    "data",
    "document",
    "eval",
    "explain",
    "heads",
    "key_padding",
    "left_pad",
    "padding",
    "parallel",
    "prefix_lm",
    "pretrained",
    "quant",
    "serve",
    "sliding_window",
    "softcap",
    "variants",
    "varlen_attention",
]
